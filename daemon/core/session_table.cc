#include "core/session_table.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/log.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {

const char* GroupStateName(GroupState state) {
  switch (state) {
    case GroupState::kReserved:
      return "reserved";
    case GroupState::kCommitted:
      return "committed";
    case GroupState::kRead:
      return "read";
  }
  return "unknown";
}

const char* CloseReasonName(CloseReason reason) {
  switch (reason) {
    case CloseReason::kLifelineClosed:
      return "lifeline_closed";
    case CloseReason::kProcessExited:
      return "process_exited";
    case CloseReason::kShutdown:
      return "shutdown";
  }
  return "unknown";
}

std::string SessionTable::JobKey(uid_t uid, const std::string& job_id) {
  return std::to_string(uid) + ":" + job_id;
}

SessionTable::SessionTable(Arena* arena, const Policy& policy, TenantMode tenant_mode,
                           FreshBacking* fresh_backing)
    : arena_(arena),
      quota_(policy),
      tenant_chunks_(arena->chunk_count(), tenant_mode),
      fresh_backing_(fresh_backing) {
  // No chunk has a tenant yet: every one in the allocator's pool of no
  // tenant, whatever a table before this one over the same arena left.
  for (uint32_t c = 0; c < arena_->chunk_count(); ++c) {
    if (Status st = arena_->allocator().SetChunkPool(c, TenantChunks::kNoTenantPool); !st.ok()) {
      MO_LOG_ERROR("internal error: chunk %u back to pool 0: %s", c, st.ToString().c_str());
    }
  }
  queue_.SetLimits(QueueLimits());
  deadline_thread_ = std::thread([this] { ExpireWaitersLoop(); });
}

SessionTable::~SessionTable() {
  Completions done;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    FailAllWaiters(Unavailable("memoffloadd is stopping; nothing was reserved"),
                   RejectReason::kDraining, &done);
  }
  deadline_changed_.SignalAll();
  deadline_thread_.join();
  Run(&done);
}

void SessionTable::SetPolicy(const Policy& policy) {
  Completions done;
  {
    absl::MutexLock lock(&mu_);
    quota_ = QuotaPolicy(policy);
    queue_.SetLimits(QueueLimits());
    FailWaitersThatCanNeverFit(&done);
    DispatchWaiters(&done);
  }
  Run(&done);
}

void SessionTable::SetFrozen(bool frozen) {
  Completions done;
  {
    absl::MutexLock lock(&mu_);
    frozen_ = frozen;
    if (frozen) {
      FailAllWaiters(Unavailable(std::string(kTakeoverPause) +
                                 ": this waiting reserve was answered; nothing was reserved"),
                     RejectReason::kDraining, &done);
    }
  }
  Run(&done);
}

Status SessionTable::SetDraining(bool draining) {
  Completions done;
  bool started = false;
  {
    absl::MutexLock lock(&mu_);
    if (!draining && shutting_down_) {
      return FailedPrecondition(
          "memoffloadd is shutting down (SIGTERM drain): undrain is refused; it exits once "
          "sessions release or the drain deadline passes");
    }
    if (!draining && frozen_) {
      return FailedPrecondition(
          "memoffloadd is handing the node to a new daemon (--take-over): undrain is refused");
    }
    started = draining && !draining_;
    draining_ = draining;
    if (draining) {
      FailAllWaiters(Unavailable("memoffloadd is draining: this waiting reserve was refused "
                                 "until 'memoffloadctl undrain'"),
                     RejectReason::kDraining, &done);
    }
  }
  Run(&done);
  if (started && drain_listener_) drain_listener_("memoffloadd is draining (memoffloadctl drain)");
  return Status::Ok();
}

void SessionTable::BeginShutdown() {
  Completions done;
  bool started = false;
  {
    absl::MutexLock lock(&mu_);
    started = !shutting_down_;
    shutting_down_ = true;
    draining_ = true;
    FailAllWaiters(
        Unavailable("memoffloadd is shutting down (SIGTERM): this waiting reserve was refused"),
        RejectReason::kDraining, &done);
  }
  Run(&done);
  if (started && drain_listener_) drain_listener_("memoffloadd is shutting down (SIGTERM)");
}

bool SessionTable::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

uint64_t SessionTable::UsableBytes() const { return quota_.UsableBytes(arena_->capacity_bytes()); }

uint64_t SessionTable::PageRounded(uint64_t size_bytes) const {
  const uint64_t page = arena_->page_bytes();  // a power of two
  return (size_bytes + page - 1) & ~(page - 1);
}

Status SessionTable::DrainingRefusal(const std::string& refused) const {
  return Unavailable(shutting_down_ ? "memoffloadd is shutting down (SIGTERM): " + refused
                                    : "memoffloadd is draining: " + refused +
                                          " until 'memoffloadctl undrain'");
}

QuotaUsage SessionTable::UsageOf(const Session& s) const {
  QuotaUsage u;
  u.session_id = s.grant.session_id;
  u.session_held_bytes = s.account.held_bytes;
  u.session_groups = s.groups.size();
  u.session_asked_bytes = s.hello.max_bytes;
  u.job_id = s.hello.job_id;
  u.uid = s.peer.uid;
  u.job_held_bytes = s.account.job->held_bytes;
  u.job_asked_bytes = s.account.job->requested_limit;
  u.uid_held_bytes = s.account.uid->held_bytes;
  u.kind = s.hello.kind;
  u.job_state_held_bytes = s.account.job->state_held_bytes;
  u.usable_bytes = UsableBytes();
  return u;
}

std::string SessionTable::TenantFor(uid_t uid, const std::string& job_id) const {
  switch (tenant_chunks_.mode()) {
    case TenantMode::kUid:
      return "uid:" + std::to_string(uid);
    case TenantMode::kJob:
      // The uid keeps another user who names the same job id out of its chunks.
      return "job:" + std::to_string(uid) + ":" + job_id;
    case TenantMode::kNone:
      break;
  }
  return "";
}

Result<SessionGrant> SessionTable::Open(const Hello& hello, const PeerCredentials& peer,
                                        std::shared_ptr<RankSeries> series) {
  Result<std::string> token = NewSessionToken();
  if (!token.ok()) return token.status();
  Completions done;
  absl::ReleasableMutexLock lock(&mu_);
  if (draining_) return DrainingRefusal("new sessions are refused");  // shutting down too
  if (frozen_) return Unavailable(std::string(kTakeoverPause) + ": attach again in a moment");
  Session s;
  s.grant.session_id = next_session_id_++;
  s.grant.token = std::move(token).value();
  s.hello = hello;
  s.tenant = TenantFor(peer.uid, hello.job_id);

  s.job_key = JobKey(peer.uid, hello.job_id);
  s.grant.limit_bytes = quota_.SessionLimit(hello.max_bytes);
  s.peer = peer;
  s.opened_at = Clock::now();
  s.series = std::move(series);
  s.account = ledger_.Open(s.job_key, peer.uid, hello.kind);
  Ledger::Job& job = *s.account.job;
  if (s.account.uid->sessions == 1) WarnIfSharedWithoutUidLimits(peer.uid);
  bool job_limit_lowered = false;
  if (hello.job_max_bytes != 0 &&
      (job.requested_limit == 0 || hello.job_max_bytes < job.requested_limit)) {
    job.requested_limit = hello.job_max_bytes;
    job_limit_lowered = job.sessions > 1;
  }
  s.owned = tenant_chunks_.Join(s.tenant, peer.uid);
  SessionGrant grant = s.grant;
  sessions_.emplace(grant.session_id, std::move(s));
  // The job's other sessions may have waiters the new limit can never fit.
  if (job_limit_lowered) FailWaitersThatCanNeverFit(&done);
  lock.Release();
  Run(&done);
  return grant;
}

Result<SessionTable::Closed> SessionTable::Close(uint64_t session_id, CloseReason) {
  Completions done;
  absl::ReleasableMutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFound("session " + std::to_string(session_id) + " is not open");
  }
  uint64_t reclaimed = 0;
  for (auto& [id, group] : it->second.groups) {
    ledger_.Released(&it->second.account, group.state, group.held_bytes);
    FreeExtents(group.extents);
    reclaimed += group.held_bytes;
  }
  ledger_.Close(it->second.job_key, it->second.peer.uid, it->second.hello.kind);
  Closed closed;
  closed.group_bytes = reclaimed;
  ForgetRegionsOf(it->second, &closed);
  tenant_chunks_.Forget(session_id);
  // Dropped after the lock: the last reference takes the metrics' lock.
  std::shared_ptr<RankSeries> series = std::move(it->second.series);
  tenant_chunks_.Leave(it->second.tenant);
  sessions_.erase(it);
  FailSessionWaiters(session_id, &done);
  DispatchWaiters(&done);
  lock.Release();
  series.reset();
  Run(&done);
  return closed;
}

Result<SessionTable::Session*> SessionTable::Authenticate(uint64_t session_id,
                                                          const std::string& token) {
  // First: a daemon that handed its sessions on (and closes them as it
  // exits) must not answer NOT_FOUND for one its successor holds.
  if (frozen_) {
    return Unavailable(std::string(kTakeoverPause) + ": nothing was done; send it again");
  }
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFound("session " + std::to_string(session_id) +
                    " is not open (it ended, or the daemon restarted): attach again");
  }
  if (!ConstantTimeEquals(it->second.grant.token, token)) {
    return Unauthenticated("session token does not match session " + std::to_string(session_id));
  }
  if (it->second.detached) {
    return Unavailable(std::string(kTakeoverPause) + ": session " + std::to_string(session_id) +
                       " was handed on and waits for its process to resume it over the "
                       "broker socket");
  }
  return &it->second;
}

Result<SessionTable::Group*> SessionTable::FindGroup(Session* session, uint64_t group_id) {
  auto it = session->groups.find(group_id);
  if (it == session->groups.end()) {
    return NotFound("group " + std::to_string(group_id) + " does not exist in session " +
                    std::to_string(session->grant.session_id));
  }
  return &it->second;
}

void SessionTable::FreeExtents(const std::vector<Extent>& extents) {
  for (const Extent& e : extents) {
    // Extents in the table came from the allocator: a refusal is a bug in
    // the bookkeeping (the extent stays as the allocator has it).
    if (Status st = arena_->allocator().Free(e); !st.ok()) {
      ++free_errors_;
      MO_LOG_ERROR("internal error: freeing extent (chunk %u, offset %lu, %lu bytes): %s", e.chunk,
                   static_cast<unsigned long>(e.offset), static_cast<unsigned long>(e.length),
                   st.ToString().c_str());
    }
  }
}

Result<CommitResult> SessionTable::Commit(uint64_t session_id, const std::string& token,
                                          uint64_t group_id, uint64_t used_bytes,
                                          std::vector<uint32_t> extent_crc32c) {
  Completions done;
  absl::ReleasableMutexLock lock(&mu_);
  Result<Session*> session = Authenticate(session_id, token);
  if (!session.ok()) return session.status();
  Result<Group*> group = FindGroup(*session, group_id);
  if (!group.ok()) return group.status();
  Group& g = **group;
  if (g.state != GroupState::kReserved) {
    return FailedPrecondition("group " + std::to_string(group_id) + " is " +
                              GroupStateName(g.state) + "; only a reserved group can be committed");
  }
  if (used_bytes > g.held_bytes) {
    return InvalidArgument("used_bytes " + std::to_string(used_bytes) +
                           " exceeds the group's reserved " + std::to_string(g.held_bytes) +
                           " bytes");
  }
  if (!extent_crc32c.empty()) {
    size_t touched = 0;
    uint64_t pos = 0;
    for (const Extent& e : g.extents) {
      if (pos >= used_bytes) break;
      ++touched;
      pos += e.length;
    }
    if (extent_crc32c.size() != touched) {
      return InvalidArgument("extent_crc32c has " + std::to_string(extent_crc32c.size()) +
                             " checksums; the used bytes span " + std::to_string(touched) +
                             " extents");
    }
  }
  Result<std::vector<Extent>> kept = arena_->allocator().Trim(g.extents, used_bytes);
  if (!kept.ok()) return Internal("trimming group: " + kept.status().message());
  uint64_t kept_bytes = 0;
  for (const Extent& e : *kept) kept_bytes += e.length;
  const uint64_t returned = g.held_bytes - kept_bytes;
  ledger_.Committed(&(*session)->account, g.held_bytes, kept_bytes);
  g.extents = std::move(kept).value();
  g.held_bytes = kept_bytes;
  g.used_bytes = used_bytes;
  g.extent_crc32c = std::move(extent_crc32c);
  g.state = GroupState::kCommitted;
  g.committed_at = Clock::now();
  // Copied under the lock: the session may end once it is released.
  CommitResult result{kept_bytes, returned, (*session)->series};
  if (returned != 0) DispatchWaiters(&done);
  lock.Release();
  Run(&done);
  return result;
}

Result<PrefetchResult> SessionTable::Prefetch(uint64_t session_id, const std::string& token,
                                              uint64_t group_id) {
  absl::MutexLock lock(&mu_);
  Result<Session*> session = Authenticate(session_id, token);
  if (!session.ok()) return session.status();
  Result<Group*> group = FindGroup(*session, group_id);
  if (!group.ok()) return group.status();
  Group& g = **group;
  if (g.state == GroupState::kReserved) {
    return FailedPrecondition("group " + std::to_string(group_id) +
                              " is reserved but not committed; Commit it before Prefetch");
  }
  if (g.state == GroupState::kCommitted) {
    ledger_.Read(g.held_bytes);
    g.state = GroupState::kRead;
  }
  return PrefetchResult{g.extents, g.used_bytes, g.extent_crc32c, (*session)->series};
}

Result<ReleaseResult> SessionTable::Release(uint64_t session_id, const std::string& token,
                                            uint64_t group_id) {
  Completions done;
  Result<ReleaseResult> result = [&] {
    absl::MutexLock lock(&mu_);
    return ReleaseLocked(session_id, token, group_id, &done);
  }();
  Run(&done);
  return result;
}

Result<ReleaseResult> SessionTable::ReleaseLocked(uint64_t session_id, const std::string& token,
                                                  uint64_t group_id, Completions* done) {
  Result<Session*> session = Authenticate(session_id, token);
  if (!session.ok()) return session.status();
  Session& s = **session;
  auto it = s.groups.find(group_id);
  if (it == s.groups.end()) {
    return NotFound("group " + std::to_string(group_id) + " does not exist in session " +
                    std::to_string(session_id));
  }
  Group& g = it->second;
  ReleaseResult result;
  result.released_bytes = g.held_bytes;
  result.state = g.state;
  if (g.state != GroupState::kReserved) {
    result.resident_seconds = std::chrono::duration<double>(Clock::now() - g.committed_at).count();
  }
  ledger_.Released(&s.account, g.state, g.held_bytes);
  FreeExtents(g.extents);
  RecycleGroupNode(s.groups.extract(it));
  DispatchWaiters(done);  // bytes, and a group slot, came back
  return result;
}

ArenaSnapshot SessionTable::Snapshot() const {
  absl::MutexLock lock(&mu_);
  ArenaSnapshot a;
  a.capacity_bytes = arena_->allocator().capacity_bytes();
  a.free_bytes = arena_->allocator().free_bytes();
  a.largest_free_extent_bytes = arena_->allocator().largest_free_extent_bytes();
  const Ledger::Totals& totals = ledger_.totals();
  a.reserved_bytes = totals.reserved_bytes;
  a.committed_bytes = totals.committed_bytes;
  a.read_bytes = totals.read_bytes;
  a.node_reserve_bytes = quota_.policy().node_reserve_bytes;
  a.sessions = static_cast<uint32_t>(sessions_.size());
  a.handed_waiting = handed_waiting_;
  a.handed_resumed = handed_resumed_;
  a.handed_not_resumed = handed_not_resumed_;
  a.handed_dropped = handed_dropped_;
  a.longest_resume_wait_seconds = std::chrono::duration<double>(longest_resume_wait_).count();
  // A state session's groups are its placed blocks: counted apart.
  const Ledger::KindTotals& state = ledger_.kind(SessionKind::kState);
  a.groups = totals.groups - state.groups;
  a.state_blocks = state.groups;
  a.state_bytes = state.held_bytes;
  for (size_t k = 0; k < kSessionKindCount; ++k) {
    a.sessions_by_kind[k] = ledger_.kinds()[k].sessions;
    a.held_by_kind[k] = ledger_.kinds()[k].held_bytes;
  }
  a.state_share = quota_.policy().state_share;
  a.waiting_reserves = static_cast<uint32_t>(queue_.size());
  a.draining = draining_;
  a.shutting_down = shutting_down_;
  a.owned_chunks = tenant_chunks_.owned_chunks();
  a.replaced_backings = replaced_backings_;
  a.free_errors = free_errors_;
  a.regions = region_count_;
  a.committed_regions = committed_region_count_;
  a.region_bytes = region_bytes_;
  a.committed_region_bytes = committed_region_bytes_;
  a.region_max_bytes = quota_.policy().region_max_bytes;
  a.regions_expired = regions_expired_;
  if (fresh_backing_ != nullptr) {
    const FreshBackingStats f = fresh_backing_->Stats();
    a.unfaulted_backings = f.taken_unfaulted;
    a.spare_backings = f.spares;
    a.stale_backings = f.stale_backings;
    a.stale_bytes = f.stale_bytes;
  }
  return a;
}

SessionSnapshot SessionTable::SnapshotOf(uint64_t id, const Session& s,
                                         Clock::time_point now) const {
  SessionSnapshot snap;
  snap.session_id = id;
  snap.job_id = s.hello.job_id;
  snap.rank = s.hello.rank;
  snap.local_rank = s.hello.local_rank;
  snap.peer = s.peer;
  snap.held_bytes = s.account.held_bytes;
  snap.kind = s.hello.kind;
  // A state session's groups are its placed blocks.
  if (s.hello.kind == SessionKind::kState) {
    snap.blocks = s.groups.size();
  } else {
    snap.groups = s.groups.size();
  }
  snap.limit_bytes = quota_.SessionLimit(s.hello.max_bytes);
  snap.age_seconds = std::chrono::duration<double>(now - s.opened_at).count();
  return snap;
}

std::optional<SessionSnapshot> SessionTable::FindSession(uint64_t session_id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return std::nullopt;
  return SnapshotOf(it->first, it->second, Clock::now());
}

std::vector<SessionSnapshot> SessionTable::ListSessions() const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionSnapshot> out;
  const auto now = Clock::now();
  for (const auto& [id, s] : sessions_) out.push_back(SnapshotOf(id, s, now));
  // In the order they opened (ids ascend), whatever the map's order.
  std::sort(out.begin(), out.end(), [](const SessionSnapshot& a, const SessionSnapshot& b) {
    return a.session_id < b.session_id;
  });
  return out;
}

}  // namespace memoffload::daemon
