#include "memoffload/torch/group_offloader.h"

#include <ATen/ATen.h>

#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

#include "group.h"
#include "group_transfer.h"
#include "memoffload/client/log.h"
#include "memoffload/torch/copy_engine.h"
#include "session.h"
#include "stats_book.h"
#include "tensor_packing.h"
#include "worker.h"

namespace memoffload::torch {
namespace {

using Clock = std::chrono::steady_clock;

std::unique_ptr<CopyEngine> MaybeCudaEngine(const OffloaderOptions& options) {
  if (!options.use_cuda) return nullptr;
  Result<std::unique_ptr<CopyEngine>> cuda = MakeCudaCopyEngine();
  if (!cuda.ok()) return nullptr;
  return std::move(cuda).value();
}

}  // namespace

// The training side of the offloader: the group table, each group's entries
// and backward rounds. Everything that talks to the daemon or copies bytes is
// posted to the worker (GroupTransfer), in order.
class GroupOffloader::Impl {
 public:
  explicit Impl(const OffloaderOptions& options)
      : host_engine_(MakeHostCopyEngine()),
        cuda_engine_(MaybeCudaEngine(options)),
        session_(options, /*pinning_engine=*/cuda_engine_.get(), &stats_),
        transfer_(&session_, &stats_, cuda_engine_.get(), &mu_) {
    stats_.Count([this](OffloaderStats& s) { s.engine = cuda_engine_ ? "cuda" : "host"; });
  }

  ~Impl() {
    std::vector<std::shared_ptr<Group>> groups;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [key, g] : groups_) groups.push_back(g);
      groups_.clear();
    }
    for (auto& g : groups) PostRelease(g);
    worker_.Flush();
    sink_->Close();
  }

  void AttachNow() {
    stats_.Count([](OffloaderStats& s) { ++s.blocking_rpcs; });
    worker_.Post([this] { session_.Ensure(/*force=*/true); });
    worker_.Flush();
  }

  Status BeginGroup(uint64_t key, int64_t slot, bool arena_views_allowed = true) {
    auto g = std::make_shared<Group>();
    g->key = key;
    g->slot = slot;
    g->arena_views_allowed = arena_views_allowed;
    g->prefetched = g->prefetch_promise.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (groups_.count(key) != 0) {
        return InvalidArgument("group key " + std::to_string(key) + " is already in use");
      }
      g->daemon_id = ++next_daemon_id_;
      if (slot >= 0) {
        auto it = learned_bytes_.find(slot);
        if (it != learned_bytes_.end()) g->planned_bytes = it->second;
      }
      groups_[key] = g;
    }
    stats_.CountWithSlot(slot, [](OffloaderStats& s, SlotStats& slot_stats) {
      ++s.groups;
      ++s.groups_live;
      ++slot_stats.groups;
      ++slot_stats.groups_live;
    });
    if (g->planned_bytes > 0) {
      const uint64_t bytes = g->planned_bytes;
      worker_.Post([this, g, bytes] { transfer_.Reserve(*g, bytes); });
    }
    return Status::Ok();
  }

  Result<int64_t> Add(uint64_t key, const at::Tensor& tensor, uintptr_t stream) {
    MEMOFFLOAD_RETURN_IF_ERROR(CheckPackable(tensor));
    CopyEngine* engine = EngineFor(tensor.device());  // null: kept in memory
    std::shared_ptr<Group> g;
    Packed packed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end() || !it->second->open) {
        return FailedPrecondition("group " + std::to_string(key) + " is not open");
      }
      g = it->second;
      Result<Packed> added = PackLocked(*g, tensor, engine, stream);
      if (!added.ok()) return added.status();
      packed = std::move(added).value();
    }
    // Counted in skipped_bytes when the group closes, like any storage that
    // did not make it into the arena.
    if (!packed.kept.ok()) NoteKept(packed.kept);
    // The engine's MarkReady contract: FAILED_PRECONDITION is a stream that
    // is capturing a CUDA graph.
    const bool capturing = packed.kept.code() == StatusCode::kFailedPrecondition;
    bool copied_here = false;
    if (std::shared_ptr<StoredStorage> s = packed.copy_now) {
      // CPU: one memcpy on this thread, like a clone, instead of waking the
      // worker for every tensor; before the reservation is in place, Close
      // copies it (the source is held until Commit either way). A device
      // storage's copy starts now, on the engine's stream.
      copied_here = CopyOutInline(*g, *s);
      if (!copied_here && !s->device.is_cpu()) {
        worker_.Post([this, g, s] { transfer_.CopyOut(*g, *s); });
      }
    }
    stats_.CountTensor(packed.dedup, copied_here, capturing);
    return packed.index;
  }

  Status CloseGroup(uint64_t key) {
    std::shared_ptr<Group> g;
    bool release = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end() || !it->second->open) {
        return FailedPrecondition("group " + std::to_string(key) + " is not open");
      }
      g = it->second;
      g->open = false;
      g->by_impl.clear();
      if (g->slot >= 0 && g->bump > 0) learned_bytes_[g->slot] = AlignUp(g->bump, kAlignBytes);
      // A BeginGroup group goes with its last entry; one without a live
      // entry (every saved tensor stayed in place, or was dropped while the
      // group was open) has none left to drop: it goes now (else it stayed
      // in groups_ for good). OffloadGroup's wait for the caller's
      // ReleaseGroup.
      if (g->arena_views_allowed && g->live == 0) {
        release = true;
        groups_.erase(it);
      }
    }
    worker_.Post([this, g] { transfer_.Close(*g); });
    if (release) PostRelease(g);
    return Status::Ok();
  }

  void PrefetchGroup(uint64_t key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(key);
    if (it == groups_.end() || it->second->open) return;
    IssuePrefetchLocked(it->second);
  }

  bool WouldNotWait(uint64_t key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(key);
    if (it == groups_.end()) return true;
    const Group& g = *it->second;
    return g.open || (g.prefetch_issued &&
                      g.prefetched.wait_for(std::chrono::seconds(0)) == std::future_status::ready);
  }

  // Get's path that needs no wait, no prefetch to issue and no copy: the
  // whole of it under one hold of mu_.
  std::optional<Result<at::Tensor>> GetIfReady(uint64_t key, int64_t index) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(key);
    if (it == groups_.end()) return Result<at::Tensor>(NotFoundGroup(key));
    Group& g = *it->second;
    if (index < 0 || index >= static_cast<int64_t>(g.entries.size())) {
      return Result<at::Tensor>(NoSuchEntry(key, index));
    }
    const Entry& e = g.entries[index];
    const StoredStorage& s = *g.storages[e.storage];
    if (!s.device.is_cpu()) return std::nullopt;
    if (!g.open && !(g.prefetch_issued &&
                     g.prefetched.wait_for(std::chrono::seconds(0)) == std::future_status::ready)) {
      return std::nullopt;
    }
    if (Status st = CheckUnmodified(e, key); !st.ok()) return Result<at::Tensor>(st);
    if (!g.open) {
      const Status& prefetched = g.prefetched.get();
      if (!prefetched.ok()) return Result<at::Tensor>(prefetched);
    }
    c10::Storage storage;
    {
      std::lock_guard<std::mutex> storages_lock(g.mu);
      storage = s.source ? s.source : s.restored;
    }
    if (!storage) return std::nullopt;  // a second backward: Get reads it again
    Result<at::Tensor> out = Unpack(e, storage);
    if (out.ok()) MarkUnpackedLocked(g, index);
    return out;
  }

  Result<at::Tensor> Get(uint64_t key, int64_t index, uintptr_t stream) {
    std::shared_ptr<Group> g;
    std::shared_ptr<StoredStorage> s;
    Entry e;
    bool demand = false;
    bool open = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end()) return NotFoundGroup(key);
      g = it->second;
      if (index < 0 || index >= static_cast<int64_t>(g->entries.size())) {
        return NoSuchEntry(key, index);
      }
      e = g->entries[index];
      MEMOFFLOAD_RETURN_IF_ERROR(CheckUnmodified(e, key));
      s = g->storages[e.storage];
      open = g->open;
      if (!open && !g->prefetch_issued) {
        demand = true;
        IssuePrefetchLocked(g);
      }
    }
    c10::Storage storage;
    if (open) {
      // Still in its forward: the group holds every source.
      std::lock_guard<std::mutex> lock(g->mu);
      storage = s->source;
    } else {
      // Closed: wait for the prefetch (queued after the close), so that every
      // entry of a storage sees the same final state and views stay views of
      // one storage.
      if (demand) stats_.Count([](OffloaderStats& st) { ++st.blocking_rpcs; });
      if (g->prefetched.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
        const auto start = Clock::now();
        g->prefetched.wait();
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        stats_.Count([seconds](OffloaderStats& st) {
          ++st.prefetch_waits;
          st.prefetch_wait_seconds += seconds;
        });
      }
      MEMOFFLOAD_RETURN_IF_ERROR(g->prefetched.get());
      std::lock_guard<std::mutex> lock(g->mu);
      if (s->source) {
        storage = s->source;
      } else if (s->restored) {
        storage = s->restored;
      } else {
        // A second backward over the same graph: the round's copy was
        // dropped, the arena still holds the data until the group dies.
        ReadyToken copied = 0;
        Result<c10::Storage> again = RestoreOrView(g, *s, &copied);
        if (!again.ok()) return again.status();
        s->restored = *again;
        s->engine->SyncAndDropToken(s->restored_ready);
        s->restored_ready = copied;
        storage = *again;
        stats_.Count([](OffloaderStats& st) { ++st.rereads; });
      }
      if (storage.unsafeGetStorageImpl() == s->restored.unsafeGetStorageImpl() &&
          !s->device.is_cpu()) {
        // CUDA: the consumer stream waits for the H2D copy, the training
        // thread does not; the consumer's use is recorded, so the block is
        // not handed to the next copy back before that stream is done.
        if (s->restored_ready != 0) {
          MEMOFFLOAD_RETURN_IF_ERROR(s->engine->WaitOnStream(s->restored_ready, stream));
        }
        MEMOFFLOAD_RETURN_IF_ERROR(s->engine->RecordUse(s->device, storage.data_ptr(), stream));
      }
    }
    Result<at::Tensor> out = Unpack(e, storage);
    if (!out.ok()) return out.status();
    MarkUnpacked(g, index);
    return out;
  }

  Status DropEntry(uint64_t key, int64_t index) {
    std::shared_ptr<Group> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end()) return Status::Ok();
      Group& g = *it->second;
      if (index < 0 || index >= static_cast<int64_t>(g.entries.size())) {
        return InvalidArgument("entry " + std::to_string(index) + " is not in group " +
                               std::to_string(key));
      }
      Entry& e = g.entries[index];
      if (!e.live) return Status::Ok();
      e.live = false;
      --g.live;
      if (e.unpacked) --g.unpacked;
      if (g.live == 0 && !g.open) {
        release = it->second;
        groups_.erase(it);
      } else {
        MaybeEndRoundLocked(g);
      }
    }
    if (release) PostRelease(release);
    return Status::Ok();
  }

  void ReleaseGroup(uint64_t key) {
    std::shared_ptr<Group> g;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end()) return;
      g = it->second;
      groups_.erase(it);
    }
    PostRelease(g);
  }

  Result<std::vector<at::Tensor>> GetGroup(uint64_t key, uintptr_t stream) {
    int64_t n = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end()) return NotFound("group " + std::to_string(key) + " is unknown");
      n = static_cast<int64_t>(it->second->entries.size());
    }
    std::vector<at::Tensor> out;
    for (int64_t i = 0; i < n; ++i) {
      Result<at::Tensor> t = Get(key, i, stream);
      if (!t.ok()) return t.status();
      out.push_back(*t);
    }
    return out;
  }

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
  CopyEngine* EngineFor(c10::Device device) {
    if (device.is_cpu()) return host_engine_.get();
    if (cuda_engine_ && cuda_engine_->Handles(device)) return cuda_engine_.get();
    return nullptr;
  }

  // A storage stays in memory because of `why`: the reason is kept in the
  // stats and logged once per message.
  void NoteKept(const Status& why) {
    const std::string reason = "kept in memory: " + why.message();  // the code: last_skip_code
    stats_.Count([&reason, &why](OffloaderStats& s) {
      s.last_skip_reason = reason;
      s.last_skip_code = why.code();
    });
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      first = logged_kept_.insert(why.message()).second;
    }
    if (first) {
      client::Log(client::LogLevel::kWarning, why.code(),
                  "a saved tensor stays where it is (" + why.ToString() +
                      "); training goes on (logged once)");
    }
  }

  void IssuePrefetchLocked(const std::shared_ptr<Group>& g) {
    if (g->prefetch_issued) return;
    g->prefetch_issued = true;
    // Prefetch owes the group's prefetch promise: if it throws, the unpack
    // waiting on it gets an error instead of hanging.
    worker_.Post([this, g] { transfer_.Prefetch(g); },
                 [g](const char* what) {
                   try {
                     g->prefetch_promise.set_value(
                         Status(StatusCode::kInternal, std::string("prefetch failed: ") + what));
                   } catch (const std::future_error&) {
                     // Already set before the throw: the waiter has its answer.
                   }
                 });
  }

  void MarkUnpacked(const std::shared_ptr<Group>& g, int64_t index) {
    std::lock_guard<std::mutex> lock(mu_);
    MarkUnpackedLocked(*g, index);
  }

  void MarkUnpackedLocked(Group& g, int64_t index) {
    Entry& e = g.entries[index];
    if (e.unpacked || !e.live) return;
    e.unpacked = true;
    ++g.unpacked;
    MaybeEndRoundLocked(g);
  }

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
  void MaybeEndRoundLocked(Group& g) {
    if (g.live == 0 || g.unpacked < g.live) return;
    for (Entry& e : g.entries) e.unpacked = false;
    g.unpacked = 0;
    std::lock_guard<std::mutex> lock(g.mu);
    for (auto& s : g.storages) s->restored = c10::Storage();
  }

  // The group's space goes back once autograd (or the caller) is done with
  // it and no storage over its arena bytes is alive any more.
  void PostRelease(const std::shared_ptr<Group>& g) {
    stats_.CountWithSlot(g->slot, [](OffloaderStats& s, SlotStats& slot_stats) {
      --s.groups_live;
      --slot_stats.groups_live;
    });
    std::vector<c10::Storage> views;
    {
      std::lock_guard<std::mutex> lock(g->mu);
      for (auto& s : g->storages) {
        // CPU restored storages (arena views among them) are not needed by
        // the group any more; CUDA ones wait for Release's sync.
        if (s->device.is_cpu() && s->restored) views.push_back(std::move(s->restored));
      }
    }
    views.clear();  // may drop views: outside the group's locks
    {
      std::lock_guard<std::mutex> lock(g->views_mu);
      if (g->arena_views > 0) {
        std::shared_ptr<ReleaseSink> sink = sink_;
        g->deferred_release = [sink, g] { sink->Post(g); };
        return;
      }
    }
    PostReleaseNow(g);
  }

  void PostReleaseNow(const std::shared_ptr<Group>& g) {
    worker_.Post([this, g] { transfer_.Release(*g); });
  }

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
  Session session_;
  GroupTransfer transfer_;

  std::shared_ptr<ReleaseSink> sink_ = std::make_shared<ReleaseSink>(this);

  // Last: destroyed (joined) first.
  Worker worker_{[](const char* what) {
    client::Log(client::LogLevel::kError, StatusCode::kInternal,
                std::string("a background task threw (") + what +
                    "); this is a bug (logged once, counted in stats()[\"internal_errors\"])");
  }};
};

std::shared_ptr<GroupOffloader> GroupOffloader::Create(const OffloaderOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  impl->AttachNow();
  return std::shared_ptr<GroupOffloader>(new GroupOffloader(std::move(impl)));
}

GroupOffloader::GroupOffloader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GroupOffloader::~GroupOffloader() = default;

Status GroupOffloader::BeginGroup(uint64_t key, int64_t slot) {
  return impl_->BeginGroup(key, slot);
}
Result<int64_t> GroupOffloader::Add(uint64_t key, const at::Tensor& tensor, uintptr_t stream) {
  return impl_->Add(key, tensor, stream);
}
Status GroupOffloader::CloseGroup(uint64_t key) { return impl_->CloseGroup(key); }
void GroupOffloader::PrefetchGroup(uint64_t key) { impl_->PrefetchGroup(key); }
Result<at::Tensor> GroupOffloader::Get(uint64_t key, int64_t entry, uintptr_t stream) {
  return impl_->Get(key, entry, stream);
}
Status GroupOffloader::DropEntry(uint64_t key, int64_t entry) {
  return impl_->DropEntry(key, entry);
}
void GroupOffloader::ReleaseGroup(uint64_t key) { impl_->ReleaseGroup(key); }
bool GroupOffloader::WouldNotWait(uint64_t key) { return impl_->WouldNotWait(key); }
std::optional<Result<at::Tensor>> GroupOffloader::GetIfReady(uint64_t key, int64_t entry) {
  return impl_->GetIfReady(key, entry);
}

Status GroupOffloader::OffloadGroup(uint64_t key, const std::vector<at::Tensor>& tensors,
                                    uintptr_t stream, int64_t slot) {
  MEMOFFLOAD_RETURN_IF_ERROR(impl_->BeginGroup(key, slot, /*arena_views_allowed=*/false));
  for (const at::Tensor& t : tensors) {
    Result<int64_t> added = impl_->Add(key, t, stream);
    if (!added.ok()) {
      impl_->ReleaseGroup(key);
      return added.status();
    }
  }
  return impl_->CloseGroup(key);
}

Result<std::vector<at::Tensor>> GroupOffloader::GetGroup(uint64_t key, uintptr_t stream) {
  return impl_->GetGroup(key, stream);
}
void GroupOffloader::Flush() { impl_->Flush(); }
OffloaderStats GroupOffloader::stats() const { return impl_->stats(); }
SlotStats GroupOffloader::slot_stats(int64_t first_slot, int64_t end_slot) const {
  return impl_->slot_stats(first_slot, end_slot);
}
uint64_t GroupOffloader::TakeArenaHeldPeak() { return impl_->TakeArenaHeldPeak(); }

}  // namespace memoffload::torch
