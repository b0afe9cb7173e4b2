// The saved-tensor hooks of memoffload.torch in C++: PackHook and UnpackHook
// are the callables given to torch.autograd.graph.saved_tensors_hooks, so a
// saved CPU tensor costs no Python frame on its way into the arena and back.
// PackHook decides what stays in place exactly as the Python rules it
// replaces (memoffload/param_skip.py): too small, parameters and buffers by
// storage identity or by their view's base, low-precision copies of weights
// through their autograd history. CUDA tensors go to a Python fallback (the
// current stream and record_stream live there).
#include "python_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "memoffload/torch/group_offloader.h"
#include "memoffload/torch/log.h"
#include "python_errors.h"

namespace memoffload::torch::python {
namespace {

// Autograd nodes between a parameter and a low-precision copy of it: the
// cast and views of either side (param_skip.py's _CAST_NODE, _VIEW_NODES).
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

// What a pack call decided (param_skip.py's NOT_PARAM, PARAM, WEIGHT_COPY).
enum class Kind { kNotParam, kParam, kWeightCopy };

}  // namespace

// Bytes a handle's pack hooks kept in place, by reason (read by
// memoffload.counters._Counters). Training thread only.
struct PackCounters {
  uint64_t small_bytes = 0;
  uint64_t param_bytes = 0;  // parameters and buffers, weight copies included
  uint64_t weight_copy_bytes = 0;
};

// What autograd keeps for an offloaded saved tensor: when it is dropped, so
// is the entry, and the group goes when its last entry does.
class SavedEntry {
 public:
  SavedEntry(std::shared_ptr<GroupOffloader> off, uint64_t key, int64_t entry)
      : off_(std::move(off)), key_(key), entry_(entry) {}
  ~SavedEntry() {
    Status st = off_->DropEntry(key_, entry_);
    if (!st.ok()) Log(LogLevel::kError, st.code(), "dropping a saved tensor: " + st.ToString());
  }
  SavedEntry(const SavedEntry&) = delete;
  SavedEntry& operator=(const SavedEntry&) = delete;

  py::object Unpack() const {
    Result<at::Tensor> r = [&] {
      if (off_->WouldNotWait(key_)) return off_->Get(key_, entry_);
      py::gil_scoped_release release;  // the worker may need the GIL meanwhile
      return off_->Get(key_, entry_);
    }();
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(Take(std::move(r))));
  }

 private:
  const std::shared_ptr<GroupOffloader> off_;
  const uint64_t key_;
  const int64_t entry_;
};

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
        parameter_type_(py::module_::import("torch.nn").attr("Parameter")) {}

  py::object operator()(py::handle obj) {
    if (!THPVariable_Check(obj.ptr())) return py::reinterpret_borrow<py::object>(obj);
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (t.layout() != c10::kStrided) return py::reinterpret_borrow<py::object>(obj);
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (nbytes < min_tensor_bytes_) {
      counters_->small_bytes += nbytes;
      return py::reinterpret_borrow<py::object>(obj);
    }
    const Kind kind = Classify(obj, t);
    if (kind != Kind::kNotParam) {
      counters_->param_bytes += nbytes;
      if (kind == Kind::kWeightCopy) counters_->weight_copy_bytes += nbytes;
      return py::reinterpret_borrow<py::object>(obj);
    }
    if (!t.device().is_cpu()) return cuda_pack_(obj);
    Result<int64_t> entry = off_->Add(key_, t);
    // Not strided or without storage: stays as it is.
    if (!entry.ok() && entry.status().code() == StatusCode::kInvalidArgument) {
      return py::reinterpret_borrow<py::object>(obj);
    }
    return py::cast(std::make_unique<SavedEntry>(off_, key_, Take(std::move(entry))));
  }

 private:
  bool IsParameterObject(py::handle obj) const {
    return PyObject_IsInstance(obj.ptr(), parameter_type_.ptr()) == 1;
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

  // param_skip.py's _ParamSkip.__call__.
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
  // AccumulateGrad (param_skip.py's _weight_copy).
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
  std::optional<std::unordered_set<uintptr_t>> storages_;
};

// SavedEntry: through the offloader; a tensor (kept in place): itself;
// anything else (a CUDA handle): the Python fallback.
class UnpackHook {
 public:
  explicit UnpackHook(py::object fallback) : fallback_(std::move(fallback)) {}
  py::object operator()(py::handle packed) const {
    if (THPVariable_Check(packed.ptr())) return py::reinterpret_borrow<py::object>(packed);
    if (py::isinstance<SavedEntry>(packed)) return packed.cast<const SavedEntry&>().Unpack();
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
  py::class_<SavedEntry>(m, "SavedEntry");
  py::class_<PackHook>(m, "PackHook")
      .def(py::init<std::shared_ptr<GroupOffloader>, uint64_t, int64_t, py::object, bool,
                    std::shared_ptr<PackCounters>, py::object>(),
           py::arg("offloader"), py::arg("key"), py::arg("min_tensor_bytes"),
           py::arg("param_storages"), py::arg("offload_weights"), py::arg("counters"),
           py::arg("cuda_pack"))
      .def("__call__", &PackHook::operator(), py::arg("tensor"))
      // memoffload.checkpointing.OWN_HOOK_ATTR: not a foreign hook.
      .def_property_readonly("_memoffload_pack", [](const PackHook&) { return true; });
  py::class_<UnpackHook>(m, "UnpackHook")
      .def(py::init<py::object>(), py::arg("fallback"))
      .def("__call__", &UnpackHook::operator(), py::arg("packed"));
}

}  // namespace memoffload::torch::python
