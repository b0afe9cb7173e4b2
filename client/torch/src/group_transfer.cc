#include "group_transfer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "chunk_pinning.h"
#include "memoffload/client/log.h"

namespace memoffload::torch {
namespace {

using client::Client;

// What an arena view's DataPtr holds: its group, whose space stays reserved
// (and mapped, through g->client) while the view lives.
struct ArenaViewRef {
  std::shared_ptr<Group> group;
};

void DropArenaView(void* context) {
  std::unique_ptr<ArenaViewRef> ref(static_cast<ArenaViewRef*>(context));
  std::function<void()> release;
  {
    std::lock_guard<std::mutex> lock(ref->group->views_mu);
    if (--ref->group->arena_views == 0) {
      release = std::move(ref->group->deferred_release);
      ref->group->deferred_release = nullptr;
    }
  }
  if (release) release();
}

// The arena address of [offset, offset + length) of the group's byte stream
// when it lies in one extent; nullptr otherwise.
uint8_t* ContiguousAddress(const Client& c, const std::vector<Extent>& extents, uint64_t offset,
                           uint64_t length) {
  uint64_t pos = 0;
  for (const Extent& e : extents) {
    if (offset < pos + e.length) {
      if (offset + length > pos + e.length) return nullptr;
      uint8_t* base = c.Address(e);
      return base == nullptr ? nullptr : base + (offset - pos);
    }
    pos += e.length;
  }
  return nullptr;
}

}  // namespace

Result<c10::Storage> RestoreOrView(const std::shared_ptr<Group>& g, const StoredStorage& s,
                                   ReadyToken* copied) {
  *copied = 0;
  if (g->arena_views_allowed && s.device.is_cpu() && s.nbytes > 0) {
    uint8_t* data = ContiguousAddress(*g->client, g->read_extents, s.offset, s.nbytes);
    if (data != nullptr) {
      {
        std::lock_guard<std::mutex> lock(g->views_mu);
        ++g->arena_views;
      }
      auto* ref = new ArenaViewRef{g};
      c10::DataPtr ptr(data, ref, &DropArenaView, c10::Device(c10::kCPU));
      return c10::Storage(c10::Storage::use_byte_size_t(), s.nbytes, std::move(ptr),
                          /*allocator=*/nullptr, /*resizable=*/false);
    }
  }
  return RestoreStorage(*g, s, copied);
}

bool CopyOutInline(Group& g, StoredStorage& s) {
  if (s.keep || !s.device.is_cpu() || !g.reserved.load(std::memory_order_acquire)) return false;
  if (s.offset + s.nbytes > g.reserved_bytes) return false;
  const uint8_t* src = static_cast<const uint8_t*>(s.source.data());
  const auto start = std::chrono::steady_clock::now();
  Status st = g.client->ForEachPiece(g.write_extents, s.offset, s.nbytes,
                                     [&](uint8_t* dst, uint64_t done, uint64_t n) {
                                       return s.engine->CopyOut(s.device, src + done, dst, n, 0);
                                     });
  g.inline_copy_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!st.ok()) return false;  // the worker tries again at Close and reports
  std::lock_guard<std::mutex> lock(g.mu);
  s.copied = true;
  return true;
}

Result<c10::Storage> RestoreStorage(const Group& g, const StoredStorage& s, ReadyToken* copied) {
  *copied = 0;
  c10::Storage out;
  if (s.device.is_cpu()) {
    try {
      out = at::empty({static_cast<int64_t>(s.nbytes)},
                      at::TensorOptions().dtype(at::kByte).device(s.device))
                .storage();
    } catch (const std::exception& ex) {
      return Internal(std::string("allocating a restored storage failed: ") + ex.what());
    }
  } else {
    // The engine decides where device memory comes from (the CUDA engine:
    // torch's caching allocator, for the stream its copy runs on).
    Result<c10::DataPtr> data = s.engine->AllocateForCopyIn(s.device, s.nbytes);
    if (!data.ok()) return data.status();
    out = c10::Storage(c10::Storage::use_byte_size_t(), s.nbytes, std::move(data).value(),
                       /*allocator=*/nullptr, /*resizable=*/false);
  }
  uint8_t* dst = static_cast<uint8_t*>(out.mutable_data());
  Status st = g.client->ForEachPiece(g.read_extents, s.offset, s.nbytes,
                                     [&](uint8_t* src, uint64_t done, uint64_t n) {
                                       return s.engine->CopyIn(s.device, src, dst + done, n);
                                     });
  // Even after a failed piece: the token covers what was queued.
  Result<ReadyToken> token = s.engine->FinishCopyIn(s.device);
  if (!token.ok()) return token.status();
  if (!st.ok()) {
    s.engine->SyncAndDropToken(*token);
    return st;
  }
  *copied = *token;
  return out;
}

GroupTransfer::GroupTransfer(DaemonLink* link, StatsBook* stats, CopyEngine* cuda_engine,
                             std::mutex* training_mu)
    : link_(link), stats_(stats), cuda_engine_(cuda_engine), training_mu_(training_mu) {}

void GroupTransfer::Reserve(Group& g, uint64_t bytes) {
  g.reserve_tried = true;
  std::shared_ptr<Client> c = link_->Ensure();
  if (!c) {
    g.reserve_status = Unavailable("memoffloadd is not reachable");
    return;
  }
  Result<client::Reservation> r = c->Reserve(g.daemon_id, bytes);
  if (!r.ok()) {
    g.reserve_status = r.status();
    link_->NoteFailure(r.status(), "Reserve");
    return;
  }
  g.client = c;
  g.write_extents = r->extents;
  g.reserved_bytes = r->reserved_bytes;
  g.held_bytes = r->reserved_bytes;
  stats_->AddHeld(g.held_bytes);
  // Only the reservation made while the group is open: Close's never meets a
  // copy on the training thread.
  if (!g.reserve_closed) g.reserved.store(true, std::memory_order_release);
  if (cuda_engine_) {
    // Every chunk a group lands in gets registered.
    for (const Extent& e : g.write_extents) {
      if (!PrepareChunk(cuda_engine_, *c, e.chunk) && !warned_unsized_chunk_) {
        warned_unsized_chunk_ = true;
        client::Log(
            client::LogLevel::kWarning, StatusCode::kInternal,
            "arena chunk " + std::to_string(e.chunk) +
                " has no size or mapping in the attach reply; it is not registered with CUDA "
                "(logged once)");
      }
    }
  }
}

void GroupTransfer::CopyOut(Group& g, StoredStorage& s) {
  if (s.keep) return;
  if (!g.client || s.offset + s.nbytes > g.reserved_bytes) return;  // handled at Close
  if (s.source.nbytes() < s.nbytes || s.source.data() != s.data_at_add) {
    // Freed or reallocated in place since it was saved (FSDP frees its
    // gathered weights with resize_(0) and gathers them again into the same
    // storage before backward): copying would read freed memory. Keep the
    // storage itself; whoever resized it owns its content. Best effort: the
    // Python hooks skip parameters before they get here.
    s.keep = true;
    const std::string reason =
        "kept in memory: a saved storage of " + std::to_string(s.nbytes) +
        " bytes was resized or freed in place after it was saved (a parameter?)";
    stats_->Count([&reason](OffloaderStats& st) {
      st.last_skip_reason = reason;
      st.last_skip_code = StatusCode::kFailedPrecondition;
    });
    return;
  }
  const ReadyToken ready = s.ready;
  s.ready = 0;
  const uint8_t* src = static_cast<const uint8_t*>(s.source.data());
  bool first = true;
  const auto start = std::chrono::steady_clock::now();
  Status st = g.client->ForEachPiece(
      g.write_extents, s.offset, s.nbytes, [&](uint8_t* dst, uint64_t done, uint64_t n) {
        const ReadyToken token = first ? ready : 0;
        first = false;
        return s.engine->CopyOut(s.device, src + done, dst, n, token);
      });
  g.copy_out_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (first) s.engine->DropToken(ready);  // zero bytes: no piece consumed it
  if (!st.ok()) {
    link_->NoteFailure(st, "copy to the arena");
    return;
  }
  std::lock_guard<std::mutex> lock(g.mu);
  s.copied = true;
}

void GroupTransfer::Close(Group& g) {
  std::vector<std::shared_ptr<StoredStorage>> storages;
  uint64_t total = 0;
  {
    std::lock_guard<std::mutex> lock(*training_mu_);
    storages = g.storages;
    total = g.bump;
  }
  g.reserve_closed = true;
  g.copy_out_seconds += g.inline_copy_seconds;
  if (!g.reserve_tried && total > 0) Reserve(g, AlignUp(total, kAlignBytes));
  if (g.client && total > g.reserved_bytes) {
    // The group grew beyond last step's size: trade the reservation for
    // one of the full size (sources are still held; copy everything).
    DropReservation(g);
    {
      std::lock_guard<std::mutex> lock(g.mu);
      for (auto& s : storages) s->copied = false;
    }
    Reserve(g, AlignUp(total, kAlignBytes));
  }
  uint64_t used = 0;
  uint64_t stored = 0;
  uint64_t kept = 0;
  for (auto& s : storages) {
    if (!s->copied) CopyOut(g, *s);
    if (s->ready != 0) {
      s->engine->DropToken(s->ready);
      s->ready = 0;
    }
    if (s->copied) {
      used = std::max(used, s->offset + s->nbytes);
      stored += s->nbytes;
    } else {
      kept += s->nbytes;
    }
  }
  if (g.client && used == 0) DropReservation(g);
  if (g.client) {
    Result<client::CommitInfo> commit =
        g.client->Commit(g.daemon_id, used, {stored, g.copy_out_seconds});
    if (commit.ok()) {
      g.in_arena = true;
      if (commit->committed_bytes < g.held_bytes) {
        stats_->SubtractHeld(g.held_bytes - commit->committed_bytes);
        g.held_bytes = commit->committed_bytes;
      }
      std::lock_guard<std::mutex> lock(g.mu);
      for (auto& s : storages) {
        if (!s->copied) continue;
        s->offloaded = true;
        s->source = c10::Storage();
      }
    } else {
      link_->NoteFailure(commit.status(), "Commit");
      DropReservation(g);
      kept += stored;
      stored = 0;
    }
  }
  // A failed Reserve keeps everything; NoteFailure already counted it.
  stats_->CountWithSlot(g.slot, [&](OffloaderStats& st, SlotStats& slot) {
    st.offloaded_bytes += stored;
    st.skipped_bytes += kept;
    if (stored > 0) ++st.groups_offloaded;
    if (kept > 0) ++st.groups_skipped;
    if (kept > 0 && st.last_skip_reason.empty()) {
      st.last_skip_reason = "group grew beyond its reservation";
      st.last_skip_code = StatusCode::kResourceExhausted;
    }
    slot.offloaded_bytes += stored;
    slot.skipped_bytes += kept;
    if (stored > 0) ++slot.groups_offloaded;
    if (kept > 0) ++slot.groups_skipped;
  });
}

void GroupTransfer::DropReservation(Group& g) {
  Status st = g.client->Release(g.daemon_id);
  if (!st.ok() && !IsTransport(st.code())) link_->NoteFailure(st, "Release");
  g.client.reset();
  LetGoOfHeld(g);
}

void GroupTransfer::LetGoOfHeld(Group& g) {
  stats_->SubtractHeld(g.held_bytes);
  g.held_bytes = 0;
}

void GroupTransfer::Prefetch(const std::shared_ptr<Group>& group) {
  Group& g = *group;
  if (!g.in_arena) {
    g.prefetch_promise.set_value(Status::Ok());
    return;
  }
  Result<client::Placement> placement = g.client->Prefetch(g.daemon_id);
  if (placement.ok()) {
    g.read_extents = placement->extents;
  } else if (IsTransport(placement.status().code()) ||
             ((placement.status().code() == StatusCode::kNotFound ||
               placement.status().code() == StatusCode::kUnauthenticated) &&
              !link_->IsCurrent(g.client))) {
    // The daemon is gone (or restarted and no longer knows the session):
    // the data is still in this process's mapping of the old chunks, whose
    // extents nobody else was given.
    link_->NoteFailure(placement.status(), "Prefetch");
    g.read_extents = g.write_extents;
  } else {
    link_->NoteFailure(placement.status(), "Prefetch");
    g.prefetch_promise.set_value(
        DataLoss("offload group " + std::to_string(g.key) +
                 " cannot be read back: " + placement.status().ToString()));
    return;
  }
  std::vector<std::shared_ptr<StoredStorage>> storages;
  std::vector<bool> read_later;  // by storage: some entry is still live
  {
    std::lock_guard<std::mutex> lock(*training_mu_);
    storages = g.storages;
    read_later.assign(storages.size(), false);
    for (const Entry& e : g.entries) {
      if (e.live) read_later[e.storage] = true;
    }
  }
  uint64_t bytes = 0;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < storages.size(); ++i) {
    auto& s = storages[i];
    // A device storage whose entries all died unread (a discarded branch) is
    // not copied back: nothing will read it. (CPU storages keep their
    // behaviour.)
    if (!s->offloaded || (!s->device.is_cpu() && !read_later[i])) continue;
    ReadyToken copied = 0;
    Result<c10::Storage> restored = RestoreOrView(group, *s, &copied);
    if (!restored.ok()) {
      g.prefetch_promise.set_value(restored.status());
      return;
    }
    std::lock_guard<std::mutex> lock(g.mu);
    s->restored = *restored;
    s->engine->SyncAndDropToken(s->restored_ready);  // a previous round's, done long ago
    s->restored_ready = copied;
    bytes += s->nbytes;
  }
  g.copy_in_bytes += bytes;
  g.copy_in_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_->CountWithSlot(g.slot, [bytes](OffloaderStats& st, SlotStats& slot) {
    st.prefetched_bytes += bytes;
    slot.prefetched_bytes += bytes;
  });
  g.prefetch_promise.set_value(Status::Ok());
}

void GroupTransfer::Release(Group& g) {
  for (auto& s : g.storages) {
    if (s->ready != 0) {
      s->engine->DropToken(s->ready);
      s->ready = 0;
    }
    // The copy back may still be reading the arena range the Release below
    // gives back: wait for it.
    std::lock_guard<std::mutex> lock(g.mu);
    if (s->restored_ready != 0) {
      s->engine->SyncAndDropToken(s->restored_ready);
      s->restored_ready = 0;
    }
  }
  if (g.client) {
    Status st = g.client->Release(g.daemon_id, {g.copy_in_bytes, g.copy_in_seconds});
    if (!st.ok() && !IsTransport(st.code())) link_->NoteFailure(st, "Release");

    g.client.reset();
    LetGoOfHeld(g);
  }
  if (!g.prefetch_issued) g.prefetch_promise.set_value(Status::Ok());
}

}  // namespace memoffload::torch
