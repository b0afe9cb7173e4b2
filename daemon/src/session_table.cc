#include "memoffload/daemon/session_table.h"

#include <sys/random.h>

#include <cerrno>

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
    case CloseReason::kShutdown:
      return "shutdown";
  }
  return "unknown";
}

Result<std::string> NewSessionToken() {
  unsigned char raw[16];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("getrandom", errno);
    }
    got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string token(32, '0');
  for (size_t i = 0; i < sizeof(raw); ++i) {
    token[2 * i] = kHex[raw[i] >> 4];
    token[2 * i + 1] = kHex[raw[i] & 0xf];
  }
  return token;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // The length of a token is public; its content is not.
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = diff | static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

SessionTable::SessionTable(Arena* arena, SessionTableOptions options)
    : arena_(arena), options_(options) {}

Result<SessionGrant> SessionTable::Open(const Hello& hello, const PeerCredentials& peer) {
  Result<std::string> token = NewSessionToken();
  if (!token.ok()) return token.status();
  std::lock_guard<std::mutex> lock(mu_);
  Session s;
  s.grant.session_id = next_session_id_++;
  s.grant.token = std::move(token).value();
  s.grant.limit_bytes = options_.session_max_bytes;
  if (hello.max_bytes != 0 && (s.grant.limit_bytes == 0 || hello.max_bytes < s.grant.limit_bytes)) {
    s.grant.limit_bytes = hello.max_bytes;
  }
  s.hello = hello;
  s.peer = peer;
  s.opened_at = Clock::now();
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
  sessions_.erase(it);
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

Result<ReserveResult> SessionTable::Reserve(uint64_t session_id, const std::string& token,
                                            uint64_t group_id, uint64_t size_bytes,
                                            bool single_extent) {
  std::lock_guard<std::mutex> lock(mu_);
  Result<Session*> session = Authenticate(session_id, token);
  if (!session.ok()) return session.status();
  Session& s = **session;
  if (auto it = s.groups.find(group_id); it != s.groups.end()) {
    return FailedPrecondition("group " + std::to_string(group_id) + " already exists (" +
                              GroupStateName(it->second.state) +
                              "); Release it before reserving it again");
  }
  if (size_bytes == 0) return InvalidArgument("size_bytes must be positive");
  const uint64_t capacity = arena_->capacity_bytes();
  if (size_bytes > capacity) {
    return ResourceExhausted("group of " + FormatSize(size_bytes) +
                             " is larger than the whole arena (" + FormatSize(capacity) + ")");
  }
  const uint64_t page = arena_->page_bytes();
  const uint64_t rounded = (size_bytes + page - 1) / page * page;
  if (s.grant.limit_bytes != 0 && s.held_bytes + rounded > s.grant.limit_bytes) {
    return ResourceExhausted("session limit: session " + std::to_string(session_id) + " holds " +
                             FormatSize(s.held_bytes) + " of its " +
                             FormatSize(s.grant.limit_bytes) + " limit; " + FormatSize(rounded) +
                             " more would exceed it by " +
                             FormatSize(s.held_bytes + rounded - s.grant.limit_bytes));
  }
  Result<std::vector<Extent>> extents = arena_->allocator().Allocate(rounded, single_extent);
  if (!extents.ok()) {
    return ResourceExhausted("arena full: cannot reserve " + FormatSize(rounded) + ": " +
                             extents.status().message());
  }
  Group g;
  g.extents = std::move(extents).value();
  g.held_bytes = rounded;
  s.held_bytes += rounded;
  reserved_bytes_ += rounded;
  ++groups_;
  ReserveResult result{g.extents, rounded};
  s.groups.emplace(group_id, std::move(g));
  return result;
}

Result<CommitResult> SessionTable::Commit(uint64_t session_id, const std::string& token,
                                          uint64_t group_id, uint64_t used_bytes) {
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
  Result<std::vector<Extent>> kept = arena_->allocator().Trim(g.extents, used_bytes);
  if (!kept.ok()) return Internal("trimming group: " + kept.status().message());
  uint64_t kept_bytes = 0;
  for (const Extent& e : *kept) kept_bytes += e.length;
  const uint64_t returned = g.held_bytes - kept_bytes;
  reserved_bytes_ -= g.held_bytes;
  committed_bytes_ += kept_bytes;
  (*session)->held_bytes -= returned;
  g.extents = std::move(kept).value();
  g.held_bytes = kept_bytes;
  g.used_bytes = used_bytes;
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
  return PrefetchResult{g.extents, g.used_bytes};
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
  --groups_;
  s.groups.erase(it);
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
  a.sessions = static_cast<uint32_t>(sessions_.size());
  a.groups = groups_;
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
    snap.limit_bytes = s.grant.limit_bytes;
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
      for (const Extent& e : g.extents) sum += e.length;
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
