// SessionTable's Reserve path: admission, placement (TryReserve), the waiting
// reserves and their deadlines. Which waiter goes first is ReserveQueue's
// business; this file decides whether one fits, and answers it.
#include <future>

#include "core/session_table.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

std::string MillisecondsSince(std::chrono::steady_clock::time_point from) {
  return std::to_string(static_cast<int64_t>(
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - from).count()));
}

}  // namespace

ReserveQueue::Limits SessionTable::QueueLimits() const {
  ReserveQueue::Limits limits;
  const Policy& policy = quota_.policy();
  limits.max_waiters = policy.max_waiting_reserves;
  limits.max_waiters_per_tenant = policy.max_waiting_reserves_per_tenant;
  limits.aging = std::chrono::milliseconds(policy.reserve_aging_ms);
  return limits;
}

std::string SessionTable::QueueTenant(const Session& session) const {
  return session.tenant.empty() ? "uid:" + std::to_string(session.peer.uid) : session.tenant;
}

bool SessionTable::QuotaHeld(const ReserveQueue::Waiter& waiter) {
  auto pending = pending_.find(waiter.ticket);
  if (pending == pending_.end()) return true;
  auto session = sessions_.find(pending->second.session_id);
  if (session == sessions_.end()) return true;  // answered when it closes
  return !quota_.Check(UsageOf(session->second), waiter.bytes).allowed() ||
         UidChunksHold(session->second, waiter.bytes, pending->second.single_extent);
}

Status SessionTable::QueuedBehind(const std::string& tenant, uint64_t rounded, uint64_t ahead_bytes,
                                  size_t ahead_count) const {
  const uint64_t usable = UsableBytes();
  const uint64_t used = arena_->allocator().used_bytes();
  const uint64_t available = usable > used ? usable - used : 0;
  const uint64_t needed = ahead_bytes + rounded;
  return ResourceExhausted(
      "arena full: " + FormatSize(rounded) + " requested behind " + std::to_string(ahead_count) +
      " earlier waiting reserve" + (ahead_count == 1 ? "" : "s") + " of the same tenant (" +
      tenant + ") needing " + FormatSize(ahead_bytes) +
      " (a tenant's reserves are served in arrival order); " + FormatSize(available) +
      " available (" + FormatSize(used) + " in use of " + FormatSize(usable) +
      " usable; node reserve " + FormatSize(quota_.policy().node_reserve_bytes) + "), short by " +
      FormatSize(needed > available ? needed - available : 0));
}

uint64_t SessionTable::ReserveAsync(uint64_t session_id, const std::string& token,
                                    uint64_t group_id, uint64_t size_bytes, bool single_extent,
                                    std::optional<Clock::time_point> wait_until, ReserveDone done,
                                    std::function<bool()> cancelled) {
  ReserveRequest request{session_id, group_id, size_bytes, single_extent, wait_until};
  RejectReason reject = RejectReason::kNone;
  Completions others;  // answers to other waiters (cancelled ones)
  std::optional<Result<ReserveResult>> answer;
  uint64_t ticket = 0;
  {
    absl::MutexLock lock(&mu_);
    ticket = AdmitReserve(request, token, &done, &cancelled, &answer, &reject, &others);
  }
  Run(&others);
  if (!answer.has_value()) return ticket;
  const RejectReason reason = answer->ok() ? RejectReason::kNone : reject;
  done(std::move(*answer), reason);
  return 0;
}

Status SessionTable::CheckReserveNeverFits(const Session& s, const ReserveRequest& r,
                                           uint64_t rounded, RejectReason* reject) {
  if (auto it = s.groups.find(r.group_id); it != s.groups.end()) {
    return FailedPrecondition("group " + std::to_string(r.group_id) + " already exists (" +
                              GroupStateName(it->second.state) +
                              "); Release it before reserving it again");
  }
  if (r.size_bytes == 0) return InvalidArgument("size_bytes must be positive");
  if (draining_) {
    *reject = RejectReason::kDraining;
    return DrainingRefusal("new reservations are refused");
  }
  // Each rule once. The usable arena and every quota (QuotaPolicy::Check:
  // session and job limits, group count) are asked here and nowhere else on
  // this path: a request over a whole limit fails now, one its own quota
  // holds back may wait (below). Free space is asked once, in TryReserve.
  MEMOFFLOAD_RETURN_IF_ERROR(quota_.CheckFitsArena(r.size_bytes, arena_->capacity_bytes(), reject));
  if (r.single_extent && rounded > arena_->chunk_size_bytes()) {
    *reject = RejectReason::kTooLarge;
    return ResourceExhausted(
        "a single-extent group of " + FormatSize(rounded) + " is larger than a chunk (" +
        FormatSize(arena_->chunk_size_bytes()) +
        ", arena.chunk_size): an extent never spans chunks, so it can never fit; reserve it "
        "without single_extent, or in smaller groups");
  }
  return Status::Ok();
}

uint64_t SessionTable::AdmitReserve(const ReserveRequest& r, const std::string& token,
                                    ReserveDone* done, std::function<bool()>* cancelled,
                                    std::optional<Result<ReserveResult>>* answer,
                                    RejectReason* reject, Completions* others) {
  auto answered = [answer](Result<ReserveResult>&& result) -> uint64_t {
    answer->emplace(std::move(result));
    return 0;
  };
  Result<Session*> session = Authenticate(r.session_id, token);
  if (!session.ok()) return answered(session.status());
  Session& s = **session;
  const uint64_t rounded = PageRounded(r.size_bytes);
  if (Status st = CheckReserveNeverFits(s, r, rounded, reject); !st.ok()) return answered(st);
  QuotaDecision quota = quota_.Check(UsageOf(s), rounded);
  if (quota.verdict == QuotaVerdict::kNever) {
    *reject = quota.reason;
    return answered(std::move(quota.status));
  }
  if (Status st = CheckFitsUidChunks(s, rounded, reject); !st.ok()) return answered(st);

  // With nobody waiting (the common case) nobody is ahead: no queue walk,
  // and the clock is read only if this request is about to wait.
  const bool anyone_waiting = queue_.size() != 0;
  std::string tenant;
  Clock::time_point now;
  ReserveQueue::Before before;
  if (anyone_waiting) {
    tenant = QueueTenant(s);
    now = Clock::now();
    before = queue_.Ahead(tenant, now,
                          [this](const ReserveQueue::Waiter& w)
                              ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return QuotaHeld(w); });
  }
  Status refusal;
  if (!quota.allowed()) {
    *reject = quota.reason;
    refusal = std::move(quota.status);  // its own quota: it waits without blocking anyone
  } else if (before.same_tenant_count != 0) {
    *reject = RejectReason::kArenaFull;
    refusal = QueuedBehind(tenant, rounded, before.same_tenant_bytes, before.same_tenant_count);
  } else {
    Result<ReserveResult> placed =
        TryReserve(&s, r.group_id, rounded, r.single_extent, before.keep_free_bytes, reject);
    if (placed.ok() || placed.status().code() != StatusCode::kResourceExhausted) {
      return answered(std::move(placed));
    }
    refusal = placed.status();
  }
  if (!r.wait_until.has_value()) return answered(refusal);
  if (!anyone_waiting) {
    tenant = QueueTenant(s);
    now = Clock::now();
  }
  if (*r.wait_until <= now) {
    *reject = RejectReason::kWaitTimeout;
    return answered(
        ResourceExhausted("waited 0 ms for " + FormatSize(rounded) +
                          ": the deadline leaves no time to wait; refusal: " + refusal.message()));
  }
  Result<uint64_t> ticket = queue_.Add(tenant, rounded, now, *r.wait_until, s.peer.uid);
  if (!ticket.ok()) {
    // Callers that went away still count until asked: ask them now.
    DropCancelledWaiters(others);
    ticket = queue_.Add(tenant, rounded, now, *r.wait_until, s.peer.uid);
  }
  if (!ticket.ok()) {
    *reject = RejectReason::kTooManyWaiters;
    return answered(ticket.status());
  }
  pending_.emplace(*ticket, PendingReserve{r.session_id, r.group_id, rounded, r.single_extent, now,
                                           refusal, std::move(*done), std::move(*cancelled)});
  deadline_changed_.SignalAll();
  return *ticket;
}

Status SessionTable::Place(const Session& s, uint64_t rounded, bool single_extent,
                           uint64_t keep_free_bytes, std::vector<Extent>* out,
                           RejectReason* reject) {
  ExtentAllocator& alloc = arena_->allocator();
  // Capacity, once: the room left by the usable arena now, with and without
  // the aged waiter's bytes.
  const uint64_t used = alloc.used_bytes();
  const ArenaRoom room = quota_.Room(arena_->capacity_bytes(), used, rounded, keep_free_bytes);
  auto arena_full = [&](uint64_t keep_free) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    *reject = RejectReason::kArenaFull;
    return quota_.ArenaFull(room, used, rounded, keep_free);
  };
  if (!room.fits) return arena_full(0);
  // keep_free_bytes holds back only what the aged waiter could use: any free
  // byte with TenantMode::kNone, else the empty chunks a tenant may claim
  // (bytes in a tenant's own chunks are of no use to another tenant).
  Status placed;
  if (tenant_chunks_.mode() == TenantMode::kNone) {
    if (!room.leaves_kept_free) return arena_full(keep_free_bytes);
    placed = alloc.AllocateInto(rounded, single_extent, nullptr, out);
  } else {
    // Only the tenant's own chunks (its pool); take over empty ones until
    // it fits, as many as its uid may own.
    placed = alloc.AllocateInPool(rounded, single_extent, s.owned->pool, out);
    if (!placed.ok() && room.leaves_kept_free) {
      MEMOFFLOAD_RETURN_IF_ERROR(UidChunksFor(s, rounded, single_extent, reject));
      MEMOFFLOAD_RETURN_IF_ERROR(ClaimsCover(s, rounded, single_extent, reject));
    }
    while (!placed.ok()) {
      if (!room.leaves_kept_free) return arena_full(keep_free_bytes);
      bool capped = false;
      const int64_t c = ClaimableFor(s, &capped);
      if (capped) {
        return quota_.MayTakeChunks(s.peer.uid, tenant_chunks_.UidChunks(s.peer.uid), 1, rounded,
                                    reject);
      }
      if (c < 0 || !Claim(static_cast<uint32_t>(c), s.tenant, s.peer.uid).ok()) break;
      placed = alloc.AllocateInPool(rounded, single_extent, s.owned->pool, out);  // c is in it
    }
  }
  if (!placed.ok()) {
    *reject = RejectReason::kArenaFull;
    return ResourceExhausted("arena full: cannot reserve " + FormatSize(rounded) +
                             (tenant_chunks_.mode() == TenantMode::kNone
                                  ? ""
                                  : " in the chunks of tenant " + s.tenant +
                                        " (chunks of other tenants are not shared)") +
                             ": " + placed.message());
  }
  const uint64_t max_extents = quota_.policy().max_extents_per_reserve;
  if (out->size() > max_extents) {
    const size_t count = out->size();
    FreeExtents(*out);
    out->clear();
    *reject = RejectReason::kTooFragmented;
    return ResourceExhausted(
        "arena fragmented: " + FormatSize(rounded) + " would take " + std::to_string(count) +
        " extents, more than quotas.max_extents_per_reserve (" + std::to_string(max_extents) +
        "); nothing was reserved: reserve smaller groups, or wait for space to coalesce");
  }
  return Status::Ok();
}

Result<ReserveResult> SessionTable::TryReserve(Session* session, uint64_t group_id,
                                               uint64_t rounded, bool single_extent,
                                               uint64_t keep_free_bytes, RejectReason* reject) {
  Session& s = *session;
  GroupNode node = NewGroupNode(group_id);
  Group& g = node.mapped();
  if (Status st = Place(s, rounded, single_extent, keep_free_bytes, &g.extents, reject); !st.ok()) {
    RecycleGroupNode(std::move(node));
    return st;
  }
  g.held_bytes = rounded;
  ledger_.Reserved(&s.account, rounded);
  ReserveResult result{ExtentList(g.extents.begin(), g.extents.end()), rounded};
  s.groups.insert(std::move(node));
  return result;
}

SessionTable::GroupNode SessionTable::NewGroupNode(uint64_t group_id) {
  if (spare_groups_.empty()) {
    GroupMap scratch;
    scratch.emplace(group_id, Group{});
    return scratch.extract(scratch.begin());
  }
  GroupNode node = std::move(spare_groups_.back());
  spare_groups_.pop_back();
  node.key() = group_id;
  return node;
}

void SessionTable::RecycleGroupNode(GroupNode node) {
  if (spare_groups_.size() >= kSpareGroupNodes) return;  // freed here
  Group& g = node.mapped();
  g.state = GroupState::kReserved;
  g.extents.clear();  // keeps its capacity for the next group
  g.held_bytes = 0;
  g.used_bytes = 0;
  g.extent_crc32c.clear();
  g.committed_at = {};
  spare_groups_.push_back(std::move(node));
}

Status SessionTable::CancelledStatus(Clock::time_point waited_from) {
  return Status(StatusCode::kCancelled, "the caller cancelled this reserve after it waited " +
                                            MillisecondsSince(waited_from) +
                                            " ms; nothing was reserved");
}

void SessionTable::DropCancelledWaiters(Completions* out) {
  std::vector<uint64_t> tickets;
  for (const auto& [ticket, p] : pending_) {
    if (p.cancelled && p.cancelled()) tickets.push_back(ticket);
  }
  for (uint64_t ticket : tickets) {
    const Status st = CancelledStatus(pending_.at(ticket).waited_from);
    queue_.Remove(ticket);
    Answer(ticket, st, RejectReason::kCancelled, out);
  }
}

void SessionTable::FailWaitersThatCanNeverFit(Completions* out) {
  std::vector<std::pair<uint64_t, QuotaDecision>> never;
  for (const auto& [ticket, p] : pending_) {
    auto session = sessions_.find(p.session_id);
    if (session == sessions_.end()) continue;  // answered when it closes
    QuotaDecision d;
    if (Status st = quota_.CheckFitsArena(p.rounded, arena_->capacity_bytes(), &d.reason);
        !st.ok()) {
      d.verdict = QuotaVerdict::kNever;
      d.status = st;
    } else if (Status chunks = CheckFitsUidChunks(session->second, p.rounded, &d.reason);
               !chunks.ok()) {
      d.verdict = QuotaVerdict::kNever;
      d.status = chunks;
    } else {
      d = quota_.Check(UsageOf(session->second), p.rounded);
    }
    if (d.verdict == QuotaVerdict::kNever) never.emplace_back(ticket, std::move(d));
  }
  for (auto& [ticket, d] : never) {
    const std::string waited = MillisecondsSince(pending_.at(ticket).waited_from);
    queue_.Remove(ticket);
    Answer(ticket,
           ResourceExhausted(d.status.message() + " (the limit changed while it waited " + waited +
                             " ms)"),
           d.reason, out);
  }
}

Result<ReserveResult> SessionTable::Reserve(uint64_t session_id, const std::string& token,
                                            uint64_t group_id, uint64_t size_bytes,
                                            bool single_extent,
                                            std::optional<Clock::time_point> wait_until,
                                            RejectReason* reject) {
  std::promise<std::pair<Result<ReserveResult>, RejectReason>> answer;
  auto future = answer.get_future();
  ReserveAsync(session_id, token, group_id, size_bytes, single_extent, wait_until,
               [&answer](Result<ReserveResult> result, RejectReason reason) {
                 answer.set_value({std::move(result), reason});
               });
  auto [result, reason] = future.get();
  if (reject != nullptr) *reject = reason;
  return std::move(result);
}

void SessionTable::CancelReserve(uint64_t ticket) {
  Completions done;
  {
    absl::MutexLock lock(&mu_);
    auto pending = pending_.find(ticket);
    if (pending == pending_.end()) return;
    const Status st = CancelledStatus(pending->second.waited_from);
    queue_.Remove(ticket);
    Answer(ticket, st, RejectReason::kCancelled, &done);
    DispatchWaiters(&done);  // it may have held others back
  }
  Run(&done);
}

void SessionTable::Answer(uint64_t ticket, Result<ReserveResult> result, RejectReason reason,
                          Completions* out) {
  auto pending = pending_.find(ticket);
  if (pending == pending_.end()) return;
  ReserveDone done = std::move(pending->second.done);
  pending_.erase(pending);
  if (result.ok()) reason = RejectReason::kNone;
  out->push_back([done = std::move(done), result = std::move(result), reason]() mutable {
    done(std::move(result), reason);
  });
}

void SessionTable::DispatchWaiters(Completions* out) {
  if (queue_.size() == 0) return;
  auto quota_held = [this](const ReserveQueue::Waiter& w)
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return QuotaHeld(w); };
  auto place = [this, out](const ReserveQueue::Waiter& w, uint64_t keep_free_bytes)
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> ReserveQueue::Try {
    PendingReserve& p = pending_.at(w.ticket);
    // A caller that went away is never granted (nobody would release it).
    if (p.cancelled && p.cancelled()) {
      Answer(w.ticket, CancelledStatus(p.waited_from), RejectReason::kCancelled, out);
      return ReserveQueue::Try::kLeft;
    }
    auto session = sessions_.find(p.session_id);
    if (session == sessions_.end()) {
      Answer(w.ticket, NotFound("session " + std::to_string(p.session_id) + " ended while waiting"),
             RejectReason::kNone, out);
      return ReserveQueue::Try::kLeft;
    }
    Session& s = session->second;
    RejectReason reason = RejectReason::kNone;
    if (s.groups.count(p.group_id) != 0) {
      Answer(w.ticket,
             FailedPrecondition("group " + std::to_string(p.group_id) +
                                " was reserved by another call while this one waited"),
             RejectReason::kNone, out);
      return ReserveQueue::Try::kLeft;
    }
    // Its quotas were checked once, by quota_held, just before this call.
    Result<ReserveResult> r =
        TryReserve(&s, p.group_id, p.rounded, p.single_extent, keep_free_bytes, &reason);
    if (!r.ok() && r.status().code() == StatusCode::kResourceExhausted) {
      p.last = r.status();
      // Its uid's chunk limit holds it, not the arena: others go on.
      return reason == RejectReason::kUidChunks ? ReserveQueue::Try::kQuotaHeld
                                                : ReserveQueue::Try::kNoRoom;
    }
    const bool placed = r.ok();
    Answer(w.ticket, std::move(r), reason, out);
    return placed ? ReserveQueue::Try::kPlaced : ReserveQueue::Try::kLeft;
  };
  queue_.Dispatch(Clock::now(), quota_held, place);
}

void SessionTable::FailAllWaiters(const Status& status, RejectReason reason, Completions* out) {
  for (const ReserveQueue::Waiter& w : queue_.TakeAll()) {
    auto pending = pending_.find(w.ticket);
    if (pending == pending_.end()) continue;
    Answer(w.ticket,
           Status(status.code(), status.message() + " after it waited " +
                                     MillisecondsSince(pending->second.waited_from) + " ms"),
           reason, out);
  }
}

void SessionTable::FailSessionWaiters(uint64_t session_id, Completions* out) {
  std::vector<uint64_t> tickets;
  for (const auto& [ticket, p] : pending_) {
    if (p.session_id == session_id) tickets.push_back(ticket);
  }
  for (uint64_t ticket : tickets) {
    queue_.Remove(ticket);
    Answer(ticket,
           NotFound("session " + std::to_string(session_id) +
                    " ended while this reserve waited; nothing was reserved"),
           RejectReason::kNone, out);
  }
}

void SessionTable::ExpireWaitersLoop() {
  mu_.Lock();
  while (!stopping_) {
    const std::optional<Clock::time_point> next = queue_.NextDeadline();
    if (next.has_value()) {
      const Clock::duration left = *next - Clock::now();
      if (left > Clock::duration::zero()) {
        deadline_changed_.WaitWithTimeout(&mu_, absl::FromChrono(left));
      }
    } else {
      deadline_changed_.Wait(&mu_);
    }
    if (stopping_) break;
    Completions done;
    for (const ReserveQueue::Waiter& w : queue_.TakeExpired(Clock::now())) {
      auto pending = pending_.find(w.ticket);
      if (pending == pending_.end()) continue;
      Answer(
          w.ticket,
          ResourceExhausted("waited " + MillisecondsSince(pending->second.waited_from) +
                            " ms for " + FormatSize(w.bytes) +
                            " until the deadline; last refusal: " + pending->second.last.message()),
          RejectReason::kWaitTimeout, &done);
    }
    if (done.empty()) continue;
    DispatchWaiters(&done);  // an expired aged waiter may have held others back
    mu_.Unlock();
    Run(&done);
    mu_.Lock();
  }
  mu_.Unlock();
}

void SessionTable::Run(Completions* completions) {
  for (auto& completion : *completions) completion();
  completions->clear();
}

}  // namespace memoffload::daemon
