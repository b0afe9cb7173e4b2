// GroupOffloader::Impl, private to group_offloader.cc (construction and the
// forward path) and group_offloader_backward.cc (reads, drops, releases).
#ifndef MEMOFFLOAD_TORCH_SRC_GROUP_OFFLOADER_IMPL_H_
#define MEMOFFLOAD_TORCH_SRC_GROUP_OFFLOADER_IMPL_H_

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "daemon_link.h"
#include "group.h"
#include "group_transfer.h"
#include "memoffload/client/log.h"
#include "memoffload/torch/copy_engine.h"
#include "memoffload/torch/group_offloader.h"
#include "stats_book.h"
#include "worker.h"

namespace memoffload::torch {

// The training side of the offloader: the group table, each group's entries
// and backward rounds. Everything that talks to the daemon or copies bytes is
// posted to the worker (GroupTransfer), in order.
class GroupOffloader::Impl {
 public:
  explicit Impl(const OffloaderOptions& options);
  ~Impl();

  // The training thread's calls (GroupOffloader's); the forward path is in
  // group_offloader.cc, the backward path (reads, drops, releases) in
  // group_offloader_backward.cc.
  void AttachNow();
  Status BeginGroup(uint64_t key, int64_t slot, bool arena_views_allowed = true);
  Result<int64_t> Add(uint64_t key, const at::Tensor& tensor, uintptr_t stream);
  Status CloseGroup(uint64_t key);
  void PrefetchGroup(uint64_t key);
  bool WouldNotWait(uint64_t key);

  // Get's path that needs no wait, no prefetch to issue and no copy: the
  // whole of it under one hold of mu_.
  std::optional<Result<at::Tensor>> GetIfReady(uint64_t key, int64_t index);
  Result<at::Tensor> Get(uint64_t key, int64_t index, uintptr_t stream);
  Status DropEntry(uint64_t key, int64_t index);
  void ReleaseGroup(uint64_t key);
  Result<std::vector<at::Tensor>> GetGroup(uint64_t key, uintptr_t stream);

  void Flush() { worker_.Flush(); }

  OffloaderStats stats() const {
    OffloaderStats s = stats_.Snapshot();
    s.internal_errors = worker_.thrown();
    if (cuda_engine_) s.unpinned_bytes = cuda_engine_->UnpinnedHostBytes();
    return s;
  }
  SlotStats slot_stats(int64_t first, int64_t end) const { return stats_.SlotSum(first, end); }
  uint64_t TakeArenaHeldPeak() { return stats_.TakeHeldPeak(); }

 private:
  using Clock = std::chrono::steady_clock;

  CopyEngine* EngineFor(c10::Device device);
  // A storage stays in memory because of `why`: the reason is kept in the
  // stats and logged once per message.
  void NoteKept(const Status& why);
  // Posts the group's prefetch once. Under mu_.
  void IssuePrefetchLocked(const std::shared_ptr<Group>& g);
  void MarkUnpacked(const std::shared_ptr<Group>& g, int64_t index);
  // Under mu_.
  void MarkUnpackedLocked(Group& g, int64_t index);
  static Status NotFoundGroup(uint64_t key) {
    return NotFound("group " + std::to_string(key) + " was released");
  }
  static Status NoSuchEntry(uint64_t key, int64_t index) {
    return InvalidArgument("entry " + std::to_string(index) + " is not in group " +
                           std::to_string(key));
  }

  // Every live entry was unpacked once: this backward no longer needs the
  // restored copies (autograd holds what it still uses). A CUDA copy may
  // still be queued into one (its entry died unread): its memory came from
  // AllocateForCopyIn, whose block serves only later copies on the same
  // stream, so dropping it here is safe; Release waits for the copy before
  // the arena range goes back.
  void MaybeEndRoundLocked(Group& g);

  // The group's space goes back once autograd (or the caller) is done with
  // it and no storage over its arena bytes is alive any more.
  void PostRelease(const std::shared_ptr<Group>& g);
  void PostReleaseNow(const std::shared_ptr<Group>& g);

  // Where the last arena view of a group posts its deferred release; after
  // the offloader is gone, nowhere (the session ends when the last group
  // holding its client dies, and the daemon reclaims the space).
  class ReleaseSink {
   public:
    explicit ReleaseSink(Impl* impl) : impl_(impl) {}
    void Post(const std::shared_ptr<Group>& g) {
      std::lock_guard<std::mutex> lock(mu_);
      if (impl_ != nullptr) impl_->PostReleaseNow(g);
    }
    void Close() {
      std::lock_guard<std::mutex> lock(mu_);
      impl_ = nullptr;
    }

   private:
    std::mutex mu_;
    Impl* impl_;  // GUARDED_BY(mu_)
  };

  std::unique_ptr<CopyEngine> host_engine_;
  std::unique_ptr<CopyEngine> cuda_engine_;
  StatsBook stats_;

  std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Group>> groups_;    // GUARDED_BY(mu_)
  std::unordered_map<int64_t, uint64_t> learned_bytes_;  // GUARDED_BY(mu_)
  uint64_t next_daemon_id_ = 0;                          // GUARDED_BY(mu_)
  std::set<std::string> logged_kept_;                    // GUARDED_BY(mu_)

  // Worker-only.
  DaemonLink link_;
  GroupTransfer transfer_;

  std::shared_ptr<ReleaseSink> sink_ = std::make_shared<ReleaseSink>(this);

  // Last: destroyed (joined) first.
  Worker worker_{[](const char* what) {
    client::Log(client::LogLevel::kError, StatusCode::kInternal,
                std::string("a background task threw (") + what +
                    "); this is a bug (logged once, counted in stats()[\"internal_errors\"])");
  }};
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_GROUP_OFFLOADER_IMPL_H_
