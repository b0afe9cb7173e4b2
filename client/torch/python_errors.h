// Statuses become Python exceptions at the edge: the memoffload.errors class
// of the status code (memoffload.Error and one subclass per code, each with
// .code; InvalidArgument is also a ValueError). Needs the GIL (WithoutGil
// runs the call that produces the status without it).
#ifndef MEMOFFLOAD_TORCH_PYTHON_ERRORS_H_
#define MEMOFFLOAD_TORCH_PYTHON_ERRORS_H_

#include <torch/extension.h>

#include <utility>

#include "memoffload/common/status.h"

namespace memoffload::torch::python {

namespace py = pybind11;

[[noreturn]] inline void Raise(const Status& st) {
  py::object exc = py::module_::import("memoffload.errors")
                       .attr("error_from_status")(static_cast<int>(st.code()), st.message());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

inline void Check(const Status& st) {
  if (!st.ok()) Raise(st);
}

template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(r).value();
}

// fn() (a Status or a Result: an RPC, a copy) run without the GIL; its
// error is raised with the GIL back: Take(WithoutGil([&] { return ...; })).
template <typename Fn>
auto WithoutGil(Fn&& fn) -> decltype(fn()) {
  py::gil_scoped_release release;
  return fn();
}

}  // namespace memoffload::torch::python

#endif  // MEMOFFLOAD_TORCH_PYTHON_ERRORS_H_
