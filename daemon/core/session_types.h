// What SessionTable hands out: session grants, the results of its calls
// and the snapshots behind memoffloadctl status and the metrics. Plain
// values, copied out under the table's lock.
#ifndef MEMOFFLOAD_DAEMON_SESSION_TYPES_H_
#define MEMOFFLOAD_DAEMON_SESSION_TYPES_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// GCC 12 at -O3 takes small_vector's copy of its inline elements for an
// overread (-Wstringop-overread, a known false positive): off for its code.
// (Clang, for the sanitizer builds, has no such warning.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overread"
#include <boost/container/small_vector.hpp>
#pragma GCC diagnostic pop
#else
#include <boost/container/small_vector.hpp>
#endif

#include "memoffload/shared_mem/attach_wire.h"
#include "memory/arena.h"

namespace memoffload::daemon {

// The metric series of a session's (job id, rank) (metrics.h); opaque here.
struct RankSeries;

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;                // primary
  std::vector<gid_t> groups{};  // supplementary (SO_PEERGROUPS)
};

enum class GroupState { kReserved, kCommitted, kRead };
const char* GroupStateName(GroupState state);

// A checkpoint region: written by the session that created it, then
// committed and readable by every session of its (uid, job id).
enum class RegionState { kWriting, kCommitted };
const char* RegionStateName(RegionState state);

struct RegionSnapshot {
  std::string name;
  uid_t uid = 0;
  std::string job_id;
  RegionState state = RegionState::kWriting;
  uint64_t used_bytes = 0;
  uint64_t held_bytes = 0;
  double committed_unix = 0;      // 0 while writing
  double expires_in_seconds = 0;  // 0 while writing
  double ttl_seconds = 0;
  bool checksummed = false;
  uint32_t readers = 0;
  bool recovered = false;  // kept across a restart of the daemon
};

// Why a session ended; a label of the sessions-closed metric.
// kProcessExited: the pidfd watch saw the peer die while another process
// (e.g. a forked child) still held its broker connection.
enum class CloseReason { kLifelineClosed, kProcessExited, kShutdown };
inline constexpr int kCloseReasonCount = 3;
const char* CloseReasonName(CloseReason reason);

struct SessionGrant {
  uint64_t session_id = 0;
  std::string token;
  uint64_t limit_bytes = 0;  // 0: no per-session limit
};

// A reserve's extents, copied into its answer: most groups take one to four,
// which stay inline (no allocation on the request path).
using ExtentList = boost::container::small_vector<Extent, 4>;

struct ReserveResult {
  ExtentList extents;
  uint64_t reserved_bytes = 0;
};

// `series` in these is the session's, as given to Open (may be null); the
// copy keeps it alive while the caller counts the request's bytes.
struct CommitResult {
  uint64_t committed_bytes = 0;
  uint64_t returned_bytes = 0;
  std::shared_ptr<RankSeries> series;
};

struct PrefetchResult {
  std::vector<Extent> extents;
  uint64_t used_bytes = 0;
  std::vector<uint32_t> extent_crc32c;
  std::shared_ptr<RankSeries> series;
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
  uint64_t node_reserve_bytes = 0;
  uint32_t sessions = 0;
  uint32_t sessions_by_kind[kSessionKindCount] = {};  // by SessionKind
  uint64_t held_by_kind[kSessionKindCount] = {};      // their groups' bytes
  uint64_t groups = 0;                                // of every session but placed state's blocks
  uint64_t state_blocks = 0;  // placed state: the groups of state-kind sessions
  uint64_t state_bytes = 0;   // and the bytes they hold
  double state_share = 0;     // quotas.state_share
  uint32_t waiting_reserves = 0;
  bool draining = false;
  bool shutting_down = false;       // draining for SIGTERM: undrain is refused
  uint32_t owned_chunks = 0;        // chunks currently assigned to a tenant
  uint64_t replaced_backings = 0;   // chunks given a new memfd on a change of tenant, total
  uint64_t unfaulted_backings = 0;  // of which no pre-faulted spare was ready
  uint32_t spare_backings = 0;      // pre-faulted memfds ready now
  uint32_t stale_backings = 0;      // retired memfds some process still keeps
  uint64_t stale_bytes = 0;         // their size (outside the arena's capacity)
  // Extents of groups that the allocator refused to free, total: each one
  // is a bug in the table's bookkeeping (logged as an error).
  uint64_t free_errors = 0;
  // Checkpoint regions (writing and committed, deleted ones still read
  // included) and the arena bytes they hold.
  uint32_t regions = 0;
  uint32_t committed_regions = 0;
  uint64_t region_bytes = 0;
  uint64_t committed_region_bytes = 0;
  uint64_t region_max_bytes = 0;
  uint64_t regions_expired = 0;  // deleted by their TTL, total
  // Sessions this start took from a take-over (SessionTable::AdoptSessions):
  // resumed by their process, waiting for it, closed as not resumed in time,
  // and records refused; the longest a resumed one waited.
  uint32_t handed_resumed = 0;
  uint32_t handed_waiting = 0;
  uint32_t handed_not_resumed = 0;
  uint32_t handed_dropped = 0;
  double longest_resume_wait_seconds = 0;
  // What sessions still hold in groups (a drain waits for it): all but the
  // free bytes and the regions'.
  uint64_t group_bytes() const { return capacity_bytes - free_bytes - region_bytes; }
};

// One chunk fd handed to a session: the chunk, the generation of its backing
// and the backing itself (kept alive while its fd is being sent).
struct ChunkGrant {
  uint32_t index = 0;
  uint64_t generation = 0;
  std::shared_ptr<const Chunk> backing;
};

struct SessionSnapshot {
  uint64_t session_id = 0;
  std::string job_id;
  int32_t rank = -1;
  int32_t local_rank = -1;
  PeerCredentials peer;
  SessionKind kind = SessionKind::kOther;
  uint64_t held_bytes = 0;
  uint64_t groups = 0;  // 0 for a state session: its groups are its blocks
  uint64_t blocks = 0;  // a state session's placed blocks
  uint64_t limit_bytes = 0;
  double age_seconds = 0;
};

// What one uid holds now, over all its job ids: what the per-uid limits
// count (memoffloadctl status).
struct UidSnapshot {
  uid_t uid = 0;
  uint32_t sessions = 0;
  uint64_t held_bytes = 0;    // its sessions' groups: quotas.uid_max_bytes
  uint32_t owned_chunks = 0;  // its tenants' chunks: quotas.uid_max_chunks
  uint64_t region_bytes = 0;  // its regions: regions.uid_max_bytes
  uint64_t regions = 0;       // regions.max_per_uid
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SESSION_TYPES_H_
