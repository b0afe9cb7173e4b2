// The saved-tensor hooks of memoffload.torch in C++: PackHook and UnpackHook
// are the callables given to torch.autograd.graph.saved_tensors_hooks, so a
// saved CPU tensor costs no Python frame on its way into the arena and back.
// PackHook decides what stays in place (the only copy of these rules; the
// Python side, memoffload/torch/_param_skip.py, lists the group's parameter
// storages): too small, parameters and buffers by storage identity or by
// their view's base, low-precision copies of weights through their autograd
// history. CUDA tensors go to a Python fallback (the
// current stream and record_stream live there).
#include "python_hooks.h"

#include <structmember.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "memoffload/client/log.h"
#include "memoffload/torch/group_offloader.h"
#include "python_errors.h"

namespace memoffload::torch::python {
namespace {

// Autograd nodes between a parameter and a low-precision copy of it: the
// cast and views of either side.
constexpr const char* kCastNode = "ToCopyBackward0";
constexpr std::array<const char*, 11> kViewNodes = {
    "TBackward0",          "TransposeBackward0", "PermuteBackward0",       "ViewBackward0",
    "UnsafeViewBackward0", "AsStridedBackward0", "ExpandBackward0",        "SliceBackward0",
    "SelectBackward0",     "SplitBackward0",     "SplitWithSizesBackward0"};
constexpr int kMaxWeightHops = 6;

bool IsViewNode(const std::string& name) {
  for (const char* v : kViewNodes) {
    if (name == v) return true;
  }
  return false;
}

// std::shared_ptr before torch 2.10-ish, c10::intrusive_ptr on 2.13.
using NodePtr = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

// What a pack call decided.
enum class Kind { kNotParam, kParam, kWeightCopy };

}  // namespace

// Bytes a handle's pack hooks kept in place, by reason (read by
// memoffload.torch._counters._Counters). Training thread only.
struct PackCounters {
  uint64_t small_bytes = 0;
  uint64_t param_bytes = 0;  // parameters and buffers, weight copies included
  uint64_t weight_copy_bytes = 0;
};

// What autograd keeps for an offloaded saved tensor: when it is dropped, so
// is the entry, and the group goes when its last entry does. A plain CPython
// object rather than a pybind11 class: one is made and dropped per saved
// tensor, and pybind11's instance registry (a hash map insert and erase per
// object) and type lookups cost as much as the rest of pack.
// (PyObject_HEAD is a macro without its semicolon.)
// clang-format off
struct SavedEntryObject {
  PyObject_HEAD
  // Set by NewSavedEntry (the type cannot be instantiated from Python).
  std::shared_ptr<GroupOffloader> off;
  uint64_t key;
  int64_t entry;
  PyObject* weakrefs;
};
// clang-format on

PyTypeObject* saved_entry_type = nullptr;  // set once by BindSavedTensorHooks

// What pack returns for a tensor `obj` that stays where it is: a detached
// alias (same storage, sizes, strides and version counter) when it has
// autograd history, else `obj` itself. Autograd keeps what pack returns in
// the node that saved it; for a saved output (RMSNorm's rsqrt, softmax's
// result) the tensor's grad_fn is that very node, so returning it as-is
// makes a reference cycle through C++ that the garbage collector cannot
// see: a graph dropped without backward is never freed, nor the groups its
// offloaded entries hold. Unpack rebuilds the saved variable from the alias
// and autograd's own metadata, so gradients do not change. A leaf holds its
// gradient accumulator weakly: no cycle, no alias needed.
py::object KeptInPlace(py::handle obj, const at::Tensor& t) {
  if (t.is_leaf()) return py::reinterpret_borrow<py::object>(obj);
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t.detach()));
}

void SavedEntryDealloc(PyObject* self) {
  auto* e = reinterpret_cast<SavedEntryObject*>(self);
  if (e->weakrefs != nullptr) PyObject_ClearWeakRefs(self);
  if (e->off) {
    Status st = e->off->DropEntry(e->key, e->entry);
    if (!st.ok())
      client::Log(client::LogLevel::kError, st.code(), "dropping a saved tensor: " + st.ToString());
  }
  e->off.~shared_ptr<GroupOffloader>();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);  // a heap type: each instance holds a reference
}

PyMemberDef saved_entry_members[] = {
    {"__weaklistoffset__", T_PYSSIZET,
     static_cast<Py_ssize_t>(offsetof(SavedEntryObject, weakrefs)), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot saved_entry_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&SavedEntryDealloc)},
    {Py_tp_members, saved_entry_members},
    {Py_tp_doc, const_cast<char*>("An offloaded saved tensor (memoffload.torch's pack hook).")},
    {0, nullptr}};

PyType_Spec saved_entry_spec = {"memoffload._C.SavedEntry", sizeof(SavedEntryObject), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
                                saved_entry_slots};

py::object NewSavedEntry(std::shared_ptr<GroupOffloader> off, uint64_t key, int64_t entry) {
  PyObject* obj = saved_entry_type->tp_alloc(saved_entry_type, 0);  // zeroed
  if (obj == nullptr) throw py::error_already_set();
  auto* e = reinterpret_cast<SavedEntryObject*>(obj);
  new (&e->off) std::shared_ptr<GroupOffloader>(std::move(off));
  e->key = key;
  e->entry = entry;
  return py::reinterpret_steal<py::object>(obj);
}

py::object UnpackSavedEntry(const SavedEntryObject& e) {
  std::optional<Result<at::Tensor>> now = e.off->GetIfReady(e.key, e.entry);
  Result<at::Tensor> r = [&] {
    if (now.has_value()) return std::move(*now);
    py::gil_scoped_release release;  // the worker may need the GIL meanwhile
    return e.off->Get(e.key, e.entry);
  }();
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(Take(std::move(r))));
}

class PackHook {
 public:
  // `param_storages()`: the storage identities (StorageImpl addresses) of
  // the group's modules' parameters and buffers, asked at the first call
  // that needs them. `cuda_pack(tensor)`: packs a non-CPU tensor.
  PackHook(std::shared_ptr<GroupOffloader> off, uint64_t key, int64_t min_tensor_bytes,
           py::object param_storages, bool offload_weights, std::shared_ptr<PackCounters> counters,
           py::object cuda_pack)
      : off_(std::move(off)),
        key_(key),
        min_tensor_bytes_(min_tensor_bytes),
        param_storages_(std::move(param_storages)),
        offload_weights_(offload_weights),
        counters_(std::move(counters)),
        cuda_pack_(std::move(cuda_pack)),
        parameter_type_(py::module_::import("torch.nn").attr("Parameter")),
        is_param_name_(py::str("_is_param")),
        class_name_(py::str("__class__")) {}

  py::object operator()(py::handle obj) {
    if (!THPVariable_Check(obj.ptr())) return py::reinterpret_borrow<py::object>(obj);
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (t.layout() != c10::kStrided) return KeptInPlace(obj, t);
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (nbytes < min_tensor_bytes_) {
      counters_->small_bytes += nbytes;
      return KeptInPlace(obj, t);
    }
    const Kind kind = Classify(obj, t);
    if (kind != Kind::kNotParam) {
      counters_->param_bytes += nbytes;
      if (kind == Kind::kWeightCopy) counters_->weight_copy_bytes += nbytes;
      return KeptInPlace(obj, t);
    }
    if (!t.device().is_cpu()) return cuda_pack_(obj);
    Result<int64_t> entry = off_->Add(key_, t);
    // Not strided or without storage: stays as it is.
    if (!entry.ok() && entry.status().code() == StatusCode::kInvalidArgument) {
      return KeptInPlace(obj, t);
    }
    return NewSavedEntry(off_, key_, Take(std::move(entry)));
  }

 private:
  // isinstance(obj, torch.nn.Parameter) for a tensor `obj`, as Parameter's
  // metaclass answers it (_ParameterMeta.__instancecheck__: a subclass, a
  // tensor whose _is_param is true, or a __class__ naming a subclass)
  // without its Python frame, which cost as much as the rest of pack.
  bool IsParameterObject(py::handle obj) const {
    auto* param_type = reinterpret_cast<PyTypeObject*>(parameter_type_.ptr());
    if (PyObject_TypeCheck(obj.ptr(), param_type)) return true;
    return AttributeIsTrue(obj, is_param_name_) || ClassIsParameter(obj, param_type);
  }

  // getattr(obj, name, False) is truthy; errors count as false (as the
  // metaclass's getattr would raise them, PyObject_IsInstance's -1 was
  // false here too).
  static bool AttributeIsTrue(py::handle obj, const py::object& name) {
    PyObject* value = nullptr;
    if (LookupAttr(obj.ptr(), name.ptr(), &value) <= 0) {
      PyErr_Clear();
      return false;
    }
    const int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (truth < 0) PyErr_Clear();
    return truth == 1;
  }

  bool ClassIsParameter(py::handle obj, PyTypeObject* param_type) const {
    PyObject* cls = nullptr;
    if (LookupAttr(obj.ptr(), class_name_.ptr(), &cls) <= 0) {
      PyErr_Clear();
      return false;
    }
    const bool is_param = cls != reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())) &&
                          PyType_Check(cls) &&
                          PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls), param_type);
    Py_DECREF(cls);
    return is_param;
  }

  // 1 and a new reference: found; 0: no such attribute; -1: an error.
  static int LookupAttr(PyObject* obj, PyObject* name, PyObject** out) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, out);
#else
    return _PyObject_LookupAttr(obj, name, out);
#endif
  }

  const std::unordered_set<uintptr_t>& Storages() {
    if (!storages_) {
      storages_.emplace();
      for (py::handle k : param_storages_()) storages_->insert(k.cast<uintptr_t>());
    }
    return *storages_;
  }

  bool InStorages(const at::Tensor& t) {
    const std::unordered_set<uintptr_t>& keys = Storages();
    return !keys.empty() &&
           keys.count(reinterpret_cast<uintptr_t>(t.storage().unsafeGetStorageImpl())) != 0;
  }

  // A parameter or buffer of the group's modules (itself, a view of one, or
  // a tensor over its storage), a low-precision copy of a weight, or neither.
  Kind Classify(py::handle obj, const at::Tensor& t) {
    if (IsParameterObject(obj) || (t.is_leaf() && t.requires_grad())) return Kind::kParam;
    if (t.is_view()) {
      const at::TensorBase& base = t._base();
      if (base.is_leaf() && base.requires_grad()) return Kind::kParam;
      py::object base_obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(base));
      if (IsParameterObject(base_obj)) return Kind::kParam;
    }
    if (InStorages(t)) return Kind::kParam;
    if (!offload_weights_ && t.grad_fn() && WeightCopy(t)) return Kind::kWeightCopy;
    return Kind::kNotParam;
  }

  // A cast (possibly with views around it) leading to a parameter's
  // AccumulateGrad.
  bool WeightCopy(const at::Tensor& t) {
    NodePtr node = t.grad_fn();
    bool cast = false;
    for (int hop = 0; hop < kMaxWeightHops; ++hop) {
      if (!node) return false;
      if (auto* acc = dynamic_cast<::torch::autograd::AccumulateGrad*>(node.get())) {
        if (!cast) return false;
        const at::Tensor& v = acc->variable;
        py::object v_obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(v));
        return IsParameterObject(v_obj) || InStorages(v);
      }
      const std::string name = node->name();
      if (name == kCastNode) {
        cast = true;
      } else if (!IsViewNode(name)) {
        return false;
      }
      NodePtr next;
      for (const ::torch::autograd::Edge& edge : node->next_edges()) {
        if (edge.function) {
          next = edge.function;
          break;
        }
      }
      node = std::move(next);
    }
    return false;
  }

  const std::shared_ptr<GroupOffloader> off_;
  const uint64_t key_;
  const int64_t min_tensor_bytes_;
  py::object param_storages_;
  const bool offload_weights_;
  const std::shared_ptr<PackCounters> counters_;
  py::object cuda_pack_;
  py::object parameter_type_;
  py::object is_param_name_;
  py::object class_name_;
  std::optional<std::unordered_set<uintptr_t>> storages_;
};

// SavedEntry: through the offloader; a tensor (kept in place): itself;
// anything else (a CUDA handle): the Python fallback.
class UnpackHook {
 public:
  explicit UnpackHook(py::object fallback) : fallback_(std::move(fallback)) {}
  py::object operator()(py::handle packed) const {
    if (THPVariable_Check(packed.ptr())) return py::reinterpret_borrow<py::object>(packed);
    if (Py_TYPE(packed.ptr()) == saved_entry_type) {
      return UnpackSavedEntry(*reinterpret_cast<const SavedEntryObject*>(packed.ptr()));
    }
    return fallback_(packed);
  }

 private:
  py::object fallback_;
};

void BindSavedTensorHooks(py::module_& m) {
  py::class_<PackCounters, std::shared_ptr<PackCounters>>(m, "PackCounters")
      .def(py::init<>())
      .def_readwrite("small_bytes", &PackCounters::small_bytes)
      .def_readwrite("param_bytes", &PackCounters::param_bytes)
      .def_readwrite("weight_copy_bytes", &PackCounters::weight_copy_bytes);
  PyObject* type = PyType_FromSpec(&saved_entry_spec);
  if (type == nullptr) throw py::error_already_set();
  saved_entry_type = reinterpret_cast<PyTypeObject*>(type);
  m.add_object("SavedEntry", py::reinterpret_borrow<py::object>(type));
  py::class_<PackHook>(m, "PackHook")
      .def(py::init<std::shared_ptr<GroupOffloader>, uint64_t, int64_t, py::object, bool,
                    std::shared_ptr<PackCounters>, py::object>(),
           py::arg("offloader"), py::arg("key"), py::arg("min_tensor_bytes"),
           py::arg("param_storages"), py::arg("offload_weights"), py::arg("counters"),
           py::arg("cuda_pack"))
      .def("__call__", &PackHook::operator(), py::arg("tensor"))
      // memoffload.torch._activation_checkpoint.OWN_HOOK_ATTR: not a foreign hook.
      .def_property_readonly("_memoffload_pack", [](const PackHook&) { return true; });
  py::class_<UnpackHook>(m, "UnpackHook")
      .def(py::init<py::object>(), py::arg("fallback"))
      .def("__call__", &UnpackHook::operator(), py::arg("packed"));
}

}  // namespace memoffload::torch::python
