// Packing tensors into a group by storage identity, and unpacking them as
// views of one restored storage.
//
// A group stores each storage once, identified by its StorageImpl (held alive
// while the group is open, so its address cannot be reused); each tensor is an
// Entry that records its view of that storage and its version counter.
#ifndef MEMOFFLOAD_TORCH_SRC_TENSOR_PACKING_H_
#define MEMOFFLOAD_TORCH_SRC_TENSOR_PACKING_H_

#include <ATen/Tensor.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <memory>

#include "group.h"
#include "memoffload/common/status.h"
#include "memoffload/torch/copy_engine.h"

namespace memoffload::torch {

// OK when `tensor` can be offloaded: defined, strided, with a storage.
Status CheckPackable(const at::Tensor& tensor);

struct Packed {
  int64_t index = 0;   // the new entry
  bool dedup = false;  // its storage was already in the group
  // Set when the storage is new and fits the group's planned reservation:
  // its copy can be posted to the worker now.
  std::shared_ptr<StoredStorage> copy_now;
  // Not OK when the new storage stays in memory (StoredStorage::keep): why.
  Status kept;
};

// Adds `tensor` to the open group `g` as a new entry, placing its storage in
// the group's byte stream unless the group already holds it. `engine` marks
// the storage ready on `stream`; when `engine` is null or cannot mark it, the
// storage is kept in memory (the entry still restores the tensor) and
// Packed::kept says why. Caller holds the offloader's mutex.
Result<Packed> PackLocked(Group& g, const at::Tensor& tensor, CopyEngine* engine, uintptr_t stream);

// FAILED_PRECONDITION, with PyTorch's in-place message, when the entry's
// tensor was modified since it was packed into group `key`.
Status CheckUnmodified(const Entry& e, uint64_t key);

// The entry's tensor: a view of `storage` with its sizes, strides, offset,
// dtype and device.
Result<at::Tensor> Unpack(const Entry& e, const c10::Storage& storage);

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_TENSOR_PACKING_H_
