#include "tensor_packing.h"

#include <ATen/ATen.h>
#include <c10/core/TensorOptions.h>

#include <exception>
#include <sstream>
#include <string>
#include <utility>

namespace memoffload::torch {
namespace {

std::string DescribeTensor(const Entry& e) {
  std::ostringstream out;
  out << "[" << e.dtype.name() << " " << c10::IntArrayRef(e.sizes) << "]";
  return out.str();
}

}  // namespace

Status CheckPackable(const at::Tensor& tensor) {
  if (!tensor.defined()) return InvalidArgument("undefined tensor");
  if (tensor.layout() != c10::kStrided || !tensor.has_storage()) {
    return InvalidArgument("only strided tensors with storage can be offloaded");
  }
  return Status::Ok();
}

Result<Packed> PackLocked(Group& g, const at::Tensor& tensor, CopyEngine* engine,
                          uintptr_t stream) {
  Packed packed;
  const c10::Storage& storage = tensor.storage();
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  int32_t storage_index = 0;
  auto found = g.by_impl.find(impl);
  if (found != g.by_impl.end()) {
    storage_index = found->second;
    packed.dedup = true;
  } else {
    auto s = std::make_shared<StoredStorage>();
    s->device = tensor.device();
    s->nbytes = storage.nbytes();
    s->source = storage;
    s->data_at_add = storage.data();
    if (engine == nullptr) {
      packed.kept = Unavailable("no copy engine for device " + tensor.device().str());
    } else {
      Result<ReadyToken> ready = engine->MarkReady(tensor.device(), stream);
      if (ready.ok()) {
        s->ready = *ready;
        s->engine = engine;
      } else {
        packed.kept = ready.status();
      }
    }
    if (!packed.kept.ok()) {
      // Takes no room in the group's byte stream.
      s->keep = true;
    } else {
      s->offset = AlignUp(g.bump, kAlignBytes);
      g.bump = s->offset + s->nbytes;
      if (g.planned_bytes > 0 && g.bump <= g.planned_bytes) {
        s->copy_queued = true;
        packed.copy_now = s;
      }
    }
    storage_index = static_cast<int32_t>(g.storages.size());
    g.storages.push_back(s);
    g.by_impl.emplace(impl, storage_index);
  }
  Entry e;
  e.storage = storage_index;
  const c10::IntArrayRef sizes = tensor.sizes();
  const c10::IntArrayRef strides = tensor.strides();
  e.sizes.assign(sizes.begin(), sizes.end());
  e.strides.assign(strides.begin(), strides.end());
  e.storage_offset = tensor.storage_offset();
  e.dtype = tensor.dtype();
  e.device = tensor.device();
  e.version = tensor.unsafeGetTensorImpl()->version_counter();
  if (e.version.enabled()) e.saved_version = e.version.current_version();
  g.entries.push_back(std::move(e));
  ++g.live;
  packed.index = static_cast<int64_t>(g.entries.size()) - 1;
  return packed;
}

Status CheckUnmodified(const Entry& e, uint64_t key) {
  if (e.version.enabled() && e.version.current_version() != e.saved_version) {
    return FailedPrecondition(
        "one of the variables needed for gradient computation has been modified by an "
        "inplace operation: " +
        DescribeTensor(e) + " is at version " + std::to_string(e.version.current_version()) +
        "; expected version " + std::to_string(e.saved_version) +
        " instead. (memoffload: it was saved in offload group " + std::to_string(key) + ")");
  }
  return Status::Ok();
}

Result<at::Tensor> Unpack(const Entry& e, const c10::Storage& storage) {
  // The TensorImpl is made directly (not at::empty + set_, two dispatcher
  // round trips): this runs once per saved tensor in backward.
  try {
    const c10::DispatchKeySet keys(
        c10::computeDispatchKey(e.dtype.toScalarType(), c10::kStrided, e.device));
    at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), keys, e.dtype);
    out.unsafeGetTensorImpl()->set_sizes_and_strides(e.sizes, e.strides, e.storage_offset);
    return out;
  } catch (const std::exception& ex) {
    return Internal(std::string("restoring a tensor failed: ") + ex.what());
  }
}

}  // namespace memoffload::torch
