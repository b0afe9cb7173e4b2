// GroupOffloader: moves groups of tensors into the memoffloadd arena and back.
//
// A group is one forward invocation of one layer (or one explicit
// OffloadGroup call), named by a caller-chosen 64-bit key. Life of a group:
//
//   BeginGroup(key, slot) -> Add(key, tensor)* -> CloseGroup(key)
//     -> PrefetchGroup(key) -> Get(key, entry)* -> ReleaseGroup(key)
//
// or, from C++ trainers, OffloadGroup(key, tensors) / PrefetchGroup(key) /
// GetGroup(key) / ReleaseGroup(key).
//
// Promises:
// - Tensors that share a storage (a tensor and its transpose, a tensor saved
//   twice) are stored once and come back as views of one restored storage with
//   their original sizes, strides, storage offset, dtype and device. Storages
//   are identified by their StorageImpl, held alive while the group is open so
//   that an address cannot be reused by another storage.
// - The group holds every source storage until its copy is complete and the
//   daemon accepted the Commit; then it lets go of it.
// - `slot` names the recurring place of a group (a layer index). The group is
//   reserved at BeginGroup with the size its slot had last time, and Reserve,
//   copies, Commit, Prefetch and Release all run on one worker thread: in
//   steady state the calling thread never waits for an RPC. Get waits only for
//   its own group's prefetch.
// - When the daemon is unreachable or refuses space (RESOURCE_EXHAUSTED, quota)
//   the group keeps its tensors where they are and Get returns them; the
//   reason is logged once per status code and the bytes are counted as
//   skipped. The worker attaches a new session when the daemon is back.
// - Get refuses (FAILED_PRECONDITION, with PyTorch's in-place message) a
//   tensor whose version counter moved since Add.
//
// Thread-safety: all public methods may be called from any thread; groups are
// guarded by the offloader's mutex, each group's storages by its own mutex.
#ifndef MEMOFFLOAD_TORCH_GROUP_OFFLOADER_H_
#define MEMOFFLOAD_TORCH_GROUP_OFFLOADER_H_

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload::torch {

struct OffloaderOptions {
  std::string runtime_dir;  // "": $MEMOFFLOAD_RUNTIME_DIR or the default
  std::string job_id = "torch";
  int32_t rank = -1;
  int32_t local_rank = -1;
  int rpc_timeout_ms = 10000;
  // Minimum time between two attach attempts while the daemon is away.
  int reconnect_interval_ms = 1000;
  // Try the CUDA engine (falls back to the host engine when unavailable).
  bool use_cuda = true;
};

struct OffloaderStats {
  uint64_t offloaded_bytes = 0;   // written into the arena and committed
  uint64_t prefetched_bytes = 0;  // read back from the arena
  // Kept in memory: no space, no daemon, an error, no copy engine for the
  // tensor's device, or a storage resized in place before its copy.
  uint64_t skipped_bytes = 0;
  uint64_t groups = 0;            // groups begun
  uint64_t groups_offloaded = 0;  // groups committed to the arena
  uint64_t groups_skipped = 0;    // groups (partly) kept in memory
  uint64_t groups_live = 0;       // groups not yet released
  // A gauge: arena bytes the live groups hold (reserved, or committed and not
  // yet released), as the daemon counts them for this session.
  uint64_t arena_held_bytes = 0;
  uint64_t tensors = 0;       // entries added
  uint64_t deduplicated = 0;  // entries that shared an already added storage
  // Storages copied into the arena by the thread that added them (CPU, the
  // group's reservation already in place); the worker copies the others.
  uint64_t caller_copies = 0;
  uint64_t blocking_rpcs = 0;   // RPCs the calling thread waited for
  uint64_t prefetch_waits = 0;  // Get calls that waited for a prefetch
  double prefetch_wait_seconds = 0;
  uint64_t rereads = 0;  // storages read again (a second backward)
  // Storages kept in place because their stream was capturing a CUDA graph
  // (also in skipped_bytes; logged once).
  uint64_t capture_skipped = 0;
  // Bytes of arena chunks in use for CUDA copies that are not registered
  // with the driver (copies through them are pageable, slower).
  uint64_t unpinned_bytes = 0;
  uint64_t reconnects = 0;  // sessions attached after a loss
  uint64_t rpc_errors = 0;
  // Background tasks that threw: a bug (the first is logged as an error).
  uint64_t internal_errors = 0;
  bool connected = false;
  std::string engine;  // "host" or "cuda"
  std::string last_skip_reason;
  // The status behind last_skip_reason (kOk while nothing was kept).
  StatusCode last_skip_code = StatusCode::kOk;
};

// The counters of the groups of some slots (e.g. the layers of one Python
// handle): the per-group part of OffloaderStats.
struct SlotStats {
  uint64_t groups = 0;
  uint64_t groups_offloaded = 0;
  uint64_t groups_skipped = 0;
  // Begun and not yet released: held by a live autograd graph (or by the
  // caller of the explicit API) until its last entry is dropped.
  uint64_t groups_live = 0;
  uint64_t offloaded_bytes = 0;
  uint64_t prefetched_bytes = 0;
  uint64_t skipped_bytes = 0;
};

class GroupOffloader {
 public:
  // Attaches to the daemon (one blocking RPC). Never fails for want of a
  // daemon: without one every group is skipped until an attach succeeds.
  static std::shared_ptr<GroupOffloader> Create(const OffloaderOptions& options);
  ~GroupOffloader();  // waits for queued work, releases every live group
  GroupOffloader(const GroupOffloader&) = delete;
  GroupOffloader& operator=(const GroupOffloader&) = delete;

  // Opens group `key`; `slot` < 0: no size learning (reserved at close).
  Status BeginGroup(uint64_t key, int64_t slot);
  // Adds a tensor to an open group and returns its entry index. `stream`: the
  // cudaStream_t (as integer) that produced a CUDA tensor; 0: legacy default.
  // A tensor no copy engine can move (a CUDA tensor without the CUDA engine,
  // or its stream could not be marked) is still added but kept where it is,
  // counted in skipped_bytes, the reason logged once. INVALID_ARGUMENT for
  // an undefined or non-strided tensor.
  Result<int64_t> Add(uint64_t key, const at::Tensor& tensor, uintptr_t stream = 0);
  // Add and CloseGroup of one group are called from one thread: Add may copy
  // a CPU storage into the group's reservation on the calling thread.
  Status CloseGroup(uint64_t key);
  // Starts bringing the group back (asynchronous). Unknown keys are ignored.
  // Cannot fail: what goes wrong later is seen by Get.
  void PrefetchGroup(uint64_t key);
  // The tensor of `entry`, waiting for the group's prefetch if needed.
  // `stream` (CUDA, a cudaStream_t as integer; 0: legacy default): the stream
  // that will use it. That stream waits (an event, not the calling thread)
  // for the copy back; the caller records the tensor on it
  // (record_stream) if it may be freed on another.
  //
  // CPU tensors of groups made with BeginGroup come back without a copy: as
  // views of a storage over the arena bytes themselves, which holds the
  // group's space until it dies (the group's Release waits for its last such
  // storage). Writes to one stay inside its own storage's bytes.
  Result<at::Tensor> Get(uint64_t key, int64_t entry, uintptr_t stream = 0);
  // Get(key, entry) for a CPU entry when it returns without waiting for the
  // worker (the group is open, unknown, or its prefetch is complete; one
  // lock round instead of WouldNotWait + Get); nullopt when Get would wait,
  // or for a device entry.
  std::optional<Result<at::Tensor>> GetIfReady(uint64_t key, int64_t entry);
  // Whether Get(key, ...) returns without waiting for the worker (the group
  // is open, unknown, or its prefetch is complete).
  bool WouldNotWait(uint64_t key);
  // The entry will not be asked for again; a BeginGroup group is released
  // when its last entry is dropped after CloseGroup, or at CloseGroup when no
  // entry is live then (none was added, or all were dropped while open).
  Status DropEntry(uint64_t key, int64_t entry);
  // Forgets the group and returns its space (asynchronous; once the last
  // tensor Get handed out over its arena bytes is gone). Unknown keys are
  // ignored. Cannot fail: a failed Release is logged and counted by the
  // worker.
  void ReleaseGroup(uint64_t key);

  // Explicit API for C++ trainers: Begin + Add each + Close. GetGroup
  // returns copies: ReleaseGroup gives the space back at once. `slot` as in
  // BeginGroup (e.g. the layer index) enables reservation ahead of the copies.
  Status OffloadGroup(uint64_t key, const std::vector<at::Tensor>& tensors, uintptr_t stream = 0,
                      int64_t slot = -1);
  // Every entry of the group in Add order; `stream` as in Get.
  Result<std::vector<at::Tensor>> GetGroup(uint64_t key, uintptr_t stream = 0);

  // Waits until the worker has run everything queued so far.
  void Flush();
  OffloaderStats stats() const;
  // Sum over the groups begun with a slot in [first_slot, end_slot).
  SlotStats slot_stats(int64_t first_slot, int64_t end_slot) const;
  // The most arena bytes held at once (stats().arena_held_bytes) since the
  // previous call, or since the offloader was made; the next window starts
  // at the bytes held now. One reader per offloader (the framework
  // callbacks, once per log line): a second reader splits the windows.
  uint64_t TakeArenaHeldPeak();

  class Impl;

 private:
  explicit GroupOffloader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_GROUP_OFFLOADER_H_
