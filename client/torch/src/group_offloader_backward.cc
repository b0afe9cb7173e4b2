// GroupOffloader::Impl's backward path: reading entries back (Get, with the
// prefetch it waits for), the rounds of a backward, dropping entries and
// releasing groups (group_offloader_impl.h).
#include <chrono>
#include <future>

#include "group_offloader_impl.h"
#include "tensor_packing.h"

namespace memoffload::torch {

void GroupOffloader::Impl::PrefetchGroup(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = groups_.find(key);
  if (it == groups_.end() || it->second->open) return;
  IssuePrefetchLocked(it->second);
}

bool GroupOffloader::Impl::WouldNotWait(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = groups_.find(key);
  if (it == groups_.end()) return true;
  const Group& g = *it->second;
  return g.open || (g.prefetch_issued &&
                    g.prefetched.wait_for(std::chrono::seconds(0)) == std::future_status::ready);
}

std::optional<Result<at::Tensor>> GroupOffloader::Impl::GetIfReady(uint64_t key, int64_t index) {
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

Result<at::Tensor> GroupOffloader::Impl::Get(uint64_t key, int64_t index, uintptr_t stream) {
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

Status GroupOffloader::Impl::DropEntry(uint64_t key, int64_t index) {
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

void GroupOffloader::Impl::ReleaseGroup(uint64_t key) {
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

Result<std::vector<at::Tensor>> GroupOffloader::Impl::GetGroup(uint64_t key, uintptr_t stream) {
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

void GroupOffloader::Impl::IssuePrefetchLocked(const std::shared_ptr<Group>& g) {
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

void GroupOffloader::Impl::MarkUnpacked(const std::shared_ptr<Group>& g, int64_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  MarkUnpackedLocked(*g, index);
}

void GroupOffloader::Impl::MarkUnpackedLocked(Group& g, int64_t index) {
  Entry& e = g.entries[index];
  if (e.unpacked || !e.live) return;
  e.unpacked = true;
  ++g.unpacked;
  MaybeEndRoundLocked(g);
}

void GroupOffloader::Impl::MaybeEndRoundLocked(Group& g) {
  if (g.live == 0 || g.unpacked < g.live) return;
  for (Entry& e : g.entries) e.unpacked = false;
  g.unpacked = 0;
  std::lock_guard<std::mutex> lock(g.mu);
  for (auto& s : g.storages) s->restored = c10::Storage();
}

void GroupOffloader::Impl::PostRelease(const std::shared_ptr<Group>& g) {
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

void GroupOffloader::Impl::PostReleaseNow(const std::shared_ptr<Group>& g) {
  worker_.Post([this, g] { transfer_.Release(*g); });
}

}  // namespace memoffload::torch
