// The state of one offload group, shared by the training side (the
// GroupOffloader's public methods) and the worker thread.
//
// Lock discipline: fields marked "training side" are guarded by the
// offloader's mutex; fields marked "worker side" are written only by the
// worker and read by Get only after `prefetched` is ready; Group::mu guards
// StoredStorage::{copied, offloaded, source, restored, restored_ready}.
#ifndef MEMOFFLOAD_TORCH_SRC_GROUP_H_
#define MEMOFFLOAD_TORCH_SRC_GROUP_H_

#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <vector>

#include "memoffload/client/client.h"
#include "memoffload/common/status.h"
#include "memoffload/shared_mem/extent.h"
#include "memoffload/torch/copy_engine.h"

namespace memoffload::torch {

// Placement alignment of storages inside a group (covers every dtype and the
// CUDA copy engine's preferred alignment).
constexpr uint64_t kAlignBytes = 256;

inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// One storage of a group, stored once however many entries view it.
struct StoredStorage {
  c10::Device device{c10::kCPU};
  uint64_t nbytes = 0;
  uint64_t offset = 0;           // in the group's byte stream
  ReadyToken ready = 0;          // consumed by the copy (worker) or at release
  CopyEngine* engine = nullptr;  // null when `keep`
  // Kept in memory from the start (no copy engine for its device, or the
  // engine could not mark it ready): never copied, counted as skipped.
  bool keep = false;
  // The storage's data address when it was added: a copy finds out whether
  // the storage was freed or reallocated in place since (FSDP frees its
  // gathered weights with resize_(0) at the end of a forward).
  const void* data_at_add = nullptr;
  bool copy_queued = false;  // training side: copied (CPU) or posted at Add
  // Written by the worker; read by Get under Group::mu.
  bool copied = false;     // bytes are in the reservation (not yet committed)
  bool offloaded = false;  // committed; `source` dropped
  c10::Storage source;     // held until offloaded, or for good when skipped
  c10::Storage restored;   // prefetched copy; dropped after each backward round
  // The engine's token for the copy into `restored` (CUDA: an event on the
  // H2D stream; 0 when complete). Get makes the consumer stream wait on it;
  // Release waits for it before the arena range goes back to the daemon.
  ReadyToken restored_ready = 0;
};

// One added tensor: a view (sizes, strides, offset, dtype) of a stored storage.
// Sizes and strides of up to 5 dimensions live inline (no heap allocation per
// saved tensor, as in TensorImpl).
struct Entry {
  int32_t storage = 0;
  c10::SmallVector<int64_t, 5> sizes;
  c10::SmallVector<int64_t, 5> strides;
  int64_t storage_offset = 0;
  caffe2::TypeMeta dtype;
  c10::Device device{c10::kCPU};
  c10::VariableVersion version{c10::VariableVersion::Disabled::DISABLED};
  uint32_t saved_version = 0;
  bool live = true;
  bool unpacked = false;  // in the current backward round
};

struct Group {
  uint64_t key = 0;
  int64_t slot = -1;
  uint64_t daemon_id = 0;
  // Training side, guarded by the offloader's mutex.
  bool open = true;
  // Unpack may hand out CPU storages over the arena bytes (the saved-tensor
  // hooks). The explicit API (OffloadGroup) gets copies: its ReleaseGroup
  // returns the space at once, whoever still holds the tensors.
  bool arena_views_allowed = true;
  uint64_t planned_bytes = 0;  // reserved at Begin (0: reserve at close)
  uint64_t bump = 0;
  // While open; open addressing: no node allocated per stored storage.
  ska::flat_hash_map<c10::StorageImpl*, int32_t> by_impl;
  std::vector<std::shared_ptr<StoredStorage>> storages;
  std::vector<Entry> entries;
  int64_t live = 0;
  int64_t unpacked = 0;
  bool prefetch_issued = false;
  std::shared_future<Status> prefetched;
  std::promise<Status> prefetch_promise;
  // Set (release) by the worker once the reservation at Begin succeeded;
  // from then until Close, `client`, `write_extents` and `reserved_bytes`
  // do not change, so the training thread may copy CPU storages into the
  // reservation itself (acquire).
  std::atomic<bool> reserved{false};
  // Training side: time of the copies made on the training thread (read by
  // Close, which is posted after them).
  double inline_copy_seconds = 0;
  // Worker side; read by Get only after `prefetched` is ready.
  std::shared_ptr<client::Client> client;  // set once the reservation succeeded
  std::vector<Extent> write_extents;
  uint64_t reserved_bytes = 0;
  // Arena bytes the daemon counts for the group: the reservation, then what
  // the Commit kept; 0 once released (StatsBook's arena_held_bytes sums it).
  uint64_t held_bytes = 0;
  bool reserve_tried = false;
  bool reserve_closed = false;  // Close began: no more copies on the training thread
  Status reserve_status;
  bool in_arena = false;  // committed
  std::vector<Extent> read_extents;
  // Copy time measured on the worker (host side: for the CUDA engine, the
  // time to issue the copies), reported to the daemon with Commit / Release.
  double copy_out_seconds = 0;
  uint64_t copy_in_bytes = 0;
  double copy_in_seconds = 0;

  // Guards StoredStorage::{copied, offloaded, source, restored, restored_ready}.
  std::mutex mu;

  // Storages handed out over the arena bytes themselves (CPU zero-copy
  // unpack), alive until their last tensor dies. The group's space goes back
  // to the daemon only once none is left: a release asked for earlier waits
  // in `deferred_release`. Lock order: mu (or the offloader's) before
  // views_mu; nothing is taken after views_mu but the worker's queue.
  std::mutex views_mu;
  int64_t arena_views = 0;                 // GUARDED_BY(views_mu)
  std::function<void()> deferred_release;  // GUARDED_BY(views_mu)
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_GROUP_H_
