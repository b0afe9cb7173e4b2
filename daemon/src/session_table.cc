#include "memoffload/daemon/session_table.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "memoffload/shared_mem/units.h"

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

const char* RejectReasonName(RejectReason reason) {
  switch (reason) {
    case RejectReason::kNone:
      return "none";
    case RejectReason::kTooLarge:
      return "too_large";
    case RejectReason::kSessionLimit:
      return "session_limit";
    case RejectReason::kJobLimit:
      return "job_limit";
    case RejectReason::kArenaFull:
      return "arena_full";
    case RejectReason::kWaitTimeout:
      return "wait_timeout";
    case RejectReason::kTooManyWaiters:
      return "too_many_waiters";
    case RejectReason::kDraining:
      return "draining";
  }
  return "unknown";
}

namespace {
constexpr size_t kMaxWaiters = 1024;
}  // namespace

SessionTable::SessionTable(Arena* arena, const Policy& policy, TenantMode tenant_mode)
    : arena_(arena),
      policy_(policy),
      tenant_mode_(tenant_mode),
      chunk_owners_(arena->chunk_count()) {}

void SessionTable::SetPolicy(const Policy& policy) {
  std::lock_guard<std::mutex> lock(mu_);
  policy_ = policy;
  space_freed_.notify_all();
}

void SessionTable::SetDraining(bool draining) {
  std::lock_guard<std::mutex> lock(mu_);
  draining_ = draining;
  space_freed_.notify_all();
}

bool SessionTable::draining() const {
  std::lock_guard<std::mutex> lock(mu_);
  return draining_;
}

uint64_t SessionTable::SessionLimit(const Session& session) const {
  uint64_t limit = policy_.session_max_bytes;
  const uint64_t asked = session.hello.max_bytes;
  if (asked != 0 && (limit == 0 || asked < limit)) limit = asked;
  return limit;
}

uint64_t SessionTable::JobLimit(const Session& session) const {
  uint64_t limit = policy_.job_max_bytes;
  auto it = jobs_.find(session.hello.job_id);
  if (it != jobs_.end() && it->second.requested_limit != 0 &&
      (limit == 0 || it->second.requested_limit < limit)) {
    limit = it->second.requested_limit;
  }
  return limit;
}

Result<SessionGrant> SessionTable::Open(const Hello& hello, const PeerCredentials& peer) {
  Result<std::string> token = NewSessionToken();
  if (!token.ok()) return token.status();
  std::lock_guard<std::mutex> lock(mu_);
  if (draining_) {
    return Unavailable(
        "memoffloadd is draining: new sessions are refused until 'memoffloadctl "
        "undrain'");
  }
  Session s;
  s.grant.session_id = next_session_id_++;
  s.grant.token = std::move(token).value();
  s.hello = hello;
  switch (tenant_mode_) {
    case TenantMode::kUid:
      s.tenant = "uid:" + std::to_string(peer.uid);
      break;
    case TenantMode::kJob:
      s.tenant = "job:" + hello.job_id;
      break;
    case TenantMode::kNone:
      break;
  }

  s.grant.limit_bytes = SessionLimit(s);
  s.peer = peer;
  s.opened_at = Clock::now();
  Job& job = jobs_[hello.job_id];
  ++job.sessions;
  if (hello.job_max_bytes != 0 &&
      (job.requested_limit == 0 || hello.job_max_bytes < job.requested_limit)) {
    job.requested_limit = hello.job_max_bytes;
  }
  SessionGrant grant = s.grant;
  sessions_.emplace(grant.session_id, std::move(s));
  return grant;
}

Result<uint64_t> SessionTable::Close(uint64_t session_id, CloseReason) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFound("session " + std::to_string(session_id) + " is not open");
  }
  uint64_t reclaimed = 0;
  for (auto& [id, group] : it->second.groups) {
    AddStateBytes(group.state, -static_cast<int64_t>(group.held_bytes));
    FreeExtents(group.extents);
    reclaimed += group.held_bytes;
    --groups_;
  }
  auto job = jobs_.find(it->second.hello.job_id);
  if (job != jobs_.end()) {
    job->second.held_bytes -= reclaimed;
    if (--job->second.sessions == 0) jobs_.erase(job);
  }
  for (ChunkOwner& owner : chunk_owners_) {
    owner.holders.erase(std::remove(owner.holders.begin(), owner.holders.end(), session_id),
                        owner.holders.end());
  }
  sessions_.erase(it);
  space_freed_.notify_all();
  return reclaimed;
}

Result<SessionTable::Session*> SessionTable::Authenticate(uint64_t session_id,
                                                          const std::string& token) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFound("session " + std::to_string(session_id) +
                    " is not open (it ended, or the daemon restarted): attach again");
  }
  if (!ConstantTimeEquals(it->second.grant.token, token)) {
    return Unauthenticated("session token does not match session " + std::to_string(session_id));
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

void SessionTable::AddStateBytes(GroupState state, int64_t delta) {
  uint64_t* counter = state == GroupState::kReserved    ? &reserved_bytes_
                      : state == GroupState::kCommitted ? &committed_bytes_
                                                        : &read_bytes_;
  *counter = static_cast<uint64_t>(static_cast<int64_t>(*counter) + delta);
}

void SessionTable::FreeExtents(const std::vector<Extent>& extents) {
  for (const Extent& e : extents) {
    // Extents in the table came from the allocator; a failure here is a bug
    // in our bookkeeping, caught by CheckInvariants in tests.
    Status st = arena_->allocator().Free(e);
    (void)st;
  }
}

Result<ReserveResult> SessionTable::TryReserve(Session* session, uint64_t group_id,
                                               uint64_t rounded, bool single_extent,
                                               RejectReason* reject) {
  Session& s = *session;
  const uint64_t session_limit = SessionLimit(s);
  if (session_limit != 0 && s.held_bytes + rounded > session_limit) {
    *reject = RejectReason::kSessionLimit;
    return ResourceExhausted("session limit: session " + std::to_string(s.grant.session_id) +
                             " holds " + FormatSize(s.held_bytes) + " of its " +
                             FormatSize(session_limit) + " limit; " + FormatSize(rounded) +
                             " more would exceed it by " +
                             FormatSize(s.held_bytes + rounded - session_limit));
  }
  Job& job = jobs_[s.hello.job_id];
  const uint64_t job_limit = JobLimit(s);
  if (job_limit != 0 && job.held_bytes + rounded > job_limit) {
    *reject = RejectReason::kJobLimit;
    return ResourceExhausted("job limit: job '" + s.hello.job_id + "' holds " +
                             FormatSize(job.held_bytes) + " of its " + FormatSize(job_limit) +
                             " limit; " + FormatSize(rounded) + " more would exceed it by " +
                             FormatSize(job.held_bytes + rounded - job_limit));
  }
  const ExtentAllocator& alloc = arena_->allocator();
  const uint64_t usable = alloc.capacity_bytes() - policy_.node_reserve_bytes;
  if (alloc.used_bytes() + rounded > usable) {
    *reject = RejectReason::kArenaFull;
    return ResourceExhausted(
        "arena full: " + FormatSize(rounded) + " requested, " +
        FormatSize(usable > alloc.used_bytes() ? usable - alloc.used_bytes() : 0) + " available (" +
        FormatSize(alloc.used_bytes()) + " in use of " + FormatSize(usable) +
        " usable; node reserve " + FormatSize(policy_.node_reserve_bytes) + ")");
  }
  Result<std::vector<Extent>> extents = Internal("not allocated yet");
  if (tenant_mode_ == TenantMode::kNone) {
    extents = arena_->allocator().Allocate(rounded, single_extent);
  } else {
    // Only the tenant's own chunks; take over empty ones until it fits.
    std::vector<bool> allowed(chunk_owners_.size());
    for (size_t c = 0; c < allowed.size(); ++c) allowed[c] = chunk_owners_[c].tenant == s.tenant;
    while (true) {
      extents = arena_->allocator().Allocate(rounded, single_extent, &allowed);
      if (extents.ok()) break;
      const int64_t c = Claimable(s.tenant);
      if (c < 0) break;
      Claim(static_cast<uint32_t>(c), s.tenant);
      allowed[c] = true;
    }
  }
  if (!extents.ok()) {
    *reject = RejectReason::kArenaFull;
    return ResourceExhausted("arena full: cannot reserve " + FormatSize(rounded) +
                             (tenant_mode_ == TenantMode::kNone
                                  ? ""
                                  : " in the chunks of tenant " + s.tenant +
                                        " (chunks of other tenants are not shared)") +
                             ": " + extents.status().message());
  }
  Group g;
  g.extents = std::move(extents).value();
  g.held_bytes = rounded;
  s.held_bytes += rounded;
  job.held_bytes += rounded;
  reserved_bytes_ += rounded;
  ++groups_;
  ReserveResult result{g.extents, rounded};
  s.groups.emplace(group_id, std::move(g));
  return result;
}

Result<ReserveResult> SessionTable::Reserve(
    uint64_t session_id, const std::string& token, uint64_t group_id, uint64_t size_bytes,
    bool single_extent, std::optional<std::chrono::steady_clock::time_point> wait_until,
    RejectReason* reject) {
  RejectReason ignored_reason;
  if (reject == nullptr) reject = &ignored_reason;
  *reject = RejectReason::kNone;
  std::unique_lock<std::mutex> lock(mu_);
  Result<Session*> session = Authenticate(session_id, token);
  if (!session.ok()) return session.status();
  if (auto it = (*session)->groups.find(group_id); it != (*session)->groups.end()) {
    return FailedPrecondition("group " + std::to_string(group_id) + " already exists (" +
                              GroupStateName(it->second.state) +
                              "); Release it before reserving it again");
  }
  if (size_bytes == 0) return InvalidArgument("size_bytes must be positive");
  if (draining_) {
    *reject = RejectReason::kDraining;
    return Unavailable("memoffloadd is draining: new reservations are refused");
  }
  const uint64_t usable = arena_->capacity_bytes() - policy_.node_reserve_bytes;
  if (size_bytes > usable) {
    *reject = RejectReason::kTooLarge;
    return ResourceExhausted("group of " + FormatSize(size_bytes) +
                             " is larger than the whole usable arena (" + FormatSize(usable) +
                             " of " + FormatSize(arena_->capacity_bytes()) + ")");
  }
  const uint64_t page = arena_->page_bytes();
  const uint64_t rounded = (size_bytes + page - 1) / page * page;
  if (!wait_until.has_value()) {
    return TryReserve(*session, group_id, rounded, single_extent, reject);
  }

  if (waiters_.size() >= kMaxWaiters) {
    *reject = RejectReason::kTooManyWaiters;
    return ResourceExhausted("too many waiting reserves (" + std::to_string(kMaxWaiters) + ")");
  }
  const uint64_t ticket = next_ticket_++;
  waiters_.push_back(ticket);
  const auto waited_from = Clock::now();
  auto leave = [&] {
    waiters_.erase(std::find(waiters_.begin(), waiters_.end(), ticket));
    space_freed_.notify_all();
  };
  Status last;
  while (true) {
    if (draining_) {
      leave();
      *reject = RejectReason::kDraining;
      return Unavailable("memoffloadd started draining while this reserve waited");
    }
    Result<Session*> current = Authenticate(session_id, token);
    if (!current.ok()) {
      leave();
      return current.status();
    }
    if (waiters_.front() == ticket) {
      Result<ReserveResult> r = TryReserve(*current, group_id, rounded, single_extent, reject);
      if (r.ok() || r.status().code() != StatusCode::kResourceExhausted) {
        leave();
        if (r.ok()) *reject = RejectReason::kNone;
        return r;
      }
      last = r.status();
    } else {
      last = ResourceExhausted("queued behind earlier waiting reserves");
    }
    if (space_freed_.wait_until(lock, *wait_until) == std::cv_status::timeout &&
        Clock::now() >= *wait_until) {
      leave();
      const double waited_ms =
          std::chrono::duration<double, std::milli>(Clock::now() - waited_from).count();
      *reject = RejectReason::kWaitTimeout;
      return ResourceExhausted("waited " + std::to_string(static_cast<int64_t>(waited_ms)) +
                               " ms for " + FormatSize(rounded) +
                               " until the deadline; last refusal: " + last.message());
    }
  }
}

Result<CommitResult> SessionTable::Commit(uint64_t session_id, const std::string& token,
                                          uint64_t group_id, uint64_t used_bytes,
                                          std::vector<uint32_t> extent_crc32c) {
  std::lock_guard<std::mutex> lock(mu_);
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
  reserved_bytes_ -= g.held_bytes;
  committed_bytes_ += kept_bytes;
  (*session)->held_bytes -= returned;
  jobs_[(*session)->hello.job_id].held_bytes -= returned;
  if (returned != 0) space_freed_.notify_all();
  g.extents = std::move(kept).value();
  g.held_bytes = kept_bytes;
  g.used_bytes = used_bytes;
  g.extent_crc32c = std::move(extent_crc32c);
  g.state = GroupState::kCommitted;
  g.committed_at = Clock::now();
  return CommitResult{kept_bytes, returned};
}

Result<PrefetchResult> SessionTable::Prefetch(uint64_t session_id, const std::string& token,
                                              uint64_t group_id) {
  std::lock_guard<std::mutex> lock(mu_);
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
    committed_bytes_ -= g.held_bytes;
    read_bytes_ += g.held_bytes;
    g.state = GroupState::kRead;
  }
  return PrefetchResult{g.extents, g.used_bytes, g.extent_crc32c};
}

Result<ReleaseResult> SessionTable::Release(uint64_t session_id, const std::string& token,
                                            uint64_t group_id) {
  std::lock_guard<std::mutex> lock(mu_);
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
  AddStateBytes(g.state, -static_cast<int64_t>(g.held_bytes));
  FreeExtents(g.extents);
  s.held_bytes -= g.held_bytes;
  jobs_[s.hello.job_id].held_bytes -= g.held_bytes;
  --groups_;
  s.groups.erase(it);
  space_freed_.notify_all();
  return result;
}

ArenaSnapshot SessionTable::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  ArenaSnapshot a;
  a.capacity_bytes = arena_->allocator().capacity_bytes();
  a.free_bytes = arena_->allocator().free_bytes();
  a.largest_free_extent_bytes = arena_->allocator().largest_free_extent_bytes();
  a.reserved_bytes = reserved_bytes_;
  a.committed_bytes = committed_bytes_;
  a.read_bytes = read_bytes_;
  a.node_reserve_bytes = policy_.node_reserve_bytes;
  a.sessions = static_cast<uint32_t>(sessions_.size());
  a.groups = groups_;
  a.waiting_reserves = static_cast<uint32_t>(waiters_.size());
  a.draining = draining_;
  for (const ChunkOwner& owner : chunk_owners_) a.owned_chunks += owner.tenant.empty() ? 0 : 1;
  a.zeroed_chunks = zeroed_chunks_;
  a.zeroing_seconds = zeroing_seconds_;
  return a;
}

std::vector<SessionSnapshot> SessionTable::ListSessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SessionSnapshot> out;
  const auto now = Clock::now();
  for (const auto& [id, s] : sessions_) {
    SessionSnapshot snap;
    snap.session_id = id;
    snap.job_id = s.hello.job_id;
    snap.rank = s.hello.rank;
    snap.local_rank = s.hello.local_rank;
    snap.peer = s.peer;
    snap.held_bytes = s.held_bytes;
    snap.groups = s.groups.size();
    snap.limit_bytes = SessionLimit(s);
    snap.age_seconds = std::chrono::duration<double>(now - s.opened_at).count();
    out.push_back(std::move(snap));
  }
  return out;
}

bool SessionTable::SessionLabels(uint64_t session_id, std::string* job_id, int32_t* rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return false;
  *job_id = it->second.hello.job_id;
  *rank = it->second.hello.rank;
  return true;
}

Status SessionTable::CheckInvariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  MEMOFFLOAD_RETURN_IF_ERROR(arena_->allocator().CheckInvariants());
  uint64_t held = 0, groups = 0, by_state[3] = {0, 0, 0};
  for (const auto& [id, s] : sessions_) {
    uint64_t session_held = 0;
    for (const auto& [gid, g] : s.groups) {
      uint64_t sum = 0;
      for (const Extent& e : g.extents) {
        sum += e.length;
        if (tenant_mode_ != TenantMode::kNone && chunk_owners_[e.chunk].tenant != s.tenant) {
          return Internal("group " + std::to_string(gid) + " of tenant " + s.tenant +
                          " has an extent in chunk " + std::to_string(e.chunk) + " of tenant " +
                          chunk_owners_[e.chunk].tenant);
        }
      }

      if (sum != g.held_bytes) {
        return Internal("group " + std::to_string(gid) + " extents sum to " + std::to_string(sum) +
                        ", recorded " + std::to_string(g.held_bytes));
      }
      session_held += g.held_bytes;
      by_state[static_cast<int>(g.state)] += g.held_bytes;
      ++groups;
    }
    if (session_held != s.held_bytes) {
      return Internal("session " + std::to_string(id) + " holds " + std::to_string(session_held) +
                      ", recorded " + std::to_string(s.held_bytes));
    }
    held += session_held;
  }
  if (held != arena_->allocator().used_bytes()) {
    return Internal("sessions hold " + std::to_string(held) + " bytes, allocator says " +
                    std::to_string(arena_->allocator().used_bytes()));
  }
  if (groups != groups_ || by_state[0] != reserved_bytes_ || by_state[1] != committed_bytes_ ||
      by_state[2] != read_bytes_) {
    return Internal("state counters disagree with the groups");
  }
  return Status::Ok();
}

}  // namespace memoffload::daemon
