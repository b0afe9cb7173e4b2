// memoffload._C.HostStateStore (see python_host_state.cc), for
// memoffload.torch's state placement (_state.py).
#ifndef MEMOFFLOAD_TORCH_PYTHON_HOST_STATE_H_
#define MEMOFFLOAD_TORCH_PYTHON_HOST_STATE_H_

#include <torch/extension.h>

namespace memoffload::torch::python {

void BindHostState(pybind11::module_& m);

}  // namespace memoffload::torch::python

#endif  // MEMOFFLOAD_TORCH_PYTHON_HOST_STATE_H_
