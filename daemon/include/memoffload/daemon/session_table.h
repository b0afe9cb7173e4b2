// SessionTable: sessions, their groups, and every byte they hold.
//
// The single authority on who holds which extents. All public methods are
// thread-safe (one mutex guards sessions_, the arena's allocator and the
// counters) and validate their input completely: a bad request returns a
// status and changes nothing. Groups are scoped to their session, so a
// session can only ever name its own groups.
//
// Group states: kReserved (extents writable by the client) -> Commit ->
// kCommitted (the daemon owns the bytes) -> Prefetch -> kRead (extents
// readable) -> Release. Release is valid in every state.
#ifndef MEMOFFLOAD_DAEMON_SESSION_TABLE_H_
#define MEMOFFLOAD_DAEMON_SESSION_TABLE_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "memoffload/daemon/arena.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/status.h"

namespace memoffload::daemon {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

enum class GroupState { kReserved, kCommitted, kRead };
const char* GroupStateName(GroupState state);

// Why a session ended; a label of the sessions-closed metric.
enum class CloseReason { kLifelineClosed, kShutdown };
const char* CloseReasonName(CloseReason reason);

struct SessionGrant {
  uint64_t session_id = 0;
  std::string token;
  uint64_t limit_bytes = 0;  // 0: no per-session limit
};

struct ReserveResult {
  std::vector<Extent> extents;
  uint64_t reserved_bytes = 0;
};

struct CommitResult {
  uint64_t committed_bytes = 0;
  uint64_t returned_bytes = 0;
};

struct PrefetchResult {
  std::vector<Extent> extents;
  uint64_t used_bytes = 0;
};

struct ReleaseResult {
  uint64_t released_bytes = 0;
  GroupState state = GroupState::kReserved;  // state it was released from
  double resident_seconds = 0;               // commit -> release; 0 if never committed
};

struct ArenaSnapshot {
  uint64_t capacity_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint64_t committed_bytes = 0;
  uint64_t read_bytes = 0;
  uint64_t largest_free_extent_bytes = 0;
  uint32_t sessions = 0;
  uint64_t groups = 0;
};

struct SessionSnapshot {
  uint64_t session_id = 0;
  std::string job_id;
  int32_t rank = -1;
  int32_t local_rank = -1;
  PeerCredentials peer;
  uint64_t held_bytes = 0;
  uint64_t groups = 0;
  uint64_t limit_bytes = 0;
  double age_seconds = 0;
};

struct SessionTableOptions {
  uint64_t session_max_bytes = 0;  // 0: no limit
};

class SessionTable {
 public:
  SessionTable(Arena* arena, SessionTableOptions options);
  SessionTable(const SessionTable&) = delete;
  SessionTable& operator=(const SessionTable&) = delete;

  // Creates a session for an attached peer with a fresh random token.
  Result<SessionGrant> Open(const Hello& hello, const PeerCredentials& peer);

  // Ends a session and returns everything it holds to the free pool.
  // Returns the bytes reclaimed; NOT_FOUND if the session is already gone.
  Result<uint64_t> Close(uint64_t session_id, CloseReason reason);

  // Each checks the session (NOT_FOUND), then the token in constant time
  // (UNAUTHENTICATED), then the group and its state.
  Result<ReserveResult> Reserve(uint64_t session_id, const std::string& token, uint64_t group_id,
                                uint64_t size_bytes, bool single_extent);
  Result<CommitResult> Commit(uint64_t session_id, const std::string& token, uint64_t group_id,
                              uint64_t used_bytes);
  Result<PrefetchResult> Prefetch(uint64_t session_id, const std::string& token, uint64_t group_id);
  Result<ReleaseResult> Release(uint64_t session_id, const std::string& token, uint64_t group_id);

  ArenaSnapshot Snapshot() const;
  std::vector<SessionSnapshot> ListSessions() const;
  // Job id and rank of a session, for metric labels; false if unknown.
  bool SessionLabels(uint64_t session_id, std::string* job_id, int32_t* rank) const;

  // Runs the allocator's invariant check plus the table's own accounting.
  Status CheckInvariants() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Group {
    GroupState state = GroupState::kReserved;
    std::vector<Extent> extents;
    uint64_t held_bytes = 0;  // sum of extent lengths
    uint64_t used_bytes = 0;  // valid bytes after Commit
    Clock::time_point committed_at;
  };
  struct Session {
    SessionGrant grant;
    Hello hello;
    PeerCredentials peer;
    Clock::time_point opened_at;
    uint64_t held_bytes = 0;
    std::unordered_map<uint64_t, Group> groups;
  };

  // Finds the session and checks its token. Requires mu_.
  Result<Session*> Authenticate(uint64_t session_id, const std::string& token);
  Result<Group*> FindGroup(Session* session, uint64_t group_id);
  void AddStateBytes(GroupState state, int64_t delta);   // requires mu_
  void FreeExtents(const std::vector<Extent>& extents);  // requires mu_

  Arena* const arena_;
  const SessionTableOptions options_;
  mutable std::mutex mu_;
  uint64_t next_session_id_ = 1;                    // guarded by mu_
  std::unordered_map<uint64_t, Session> sessions_;  // guarded by mu_
  uint64_t reserved_bytes_ = 0;                     // guarded by mu_
  uint64_t committed_bytes_ = 0;                    // guarded by mu_
  uint64_t read_bytes_ = 0;                         // guarded by mu_
  uint64_t groups_ = 0;                             // guarded by mu_
};

// 128-bit random token as 32 lowercase hex digits (getrandom(2)).
Result<std::string> NewSessionToken();
// Compares in time independent of where the strings differ.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SESSION_TABLE_H_
