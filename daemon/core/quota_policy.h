// QuotaPolicy: whether a Reserve's bytes are within its quotas and within
// the usable arena.
//
// A pure decision object: no lock, no thread, no clock, no table. The caller
// passes what the request's session and job hold (QuotaUsage) and what the
// arena holds; SessionTable owns one (ABSL_GUARDED_BY its mutex). Each rule
// is decided here once per try, so the caller never checks a limit again.
//
// Rules:
// - The usable arena is capacity - quotas.node_reserve_bytes (0 when the
//   reserve covers the arena). A request larger than it can never fit.
// - A session's limit is the smaller non-zero one of quotas.session_max_bytes
//   and its hello's max_bytes; a job's, of quotas.job_max_bytes and the
//   smallest job_max_bytes a hello of the job asked for; a uid's (all its
//   sessions, whatever job ids they name), quotas.uid_max_bytes. 0: no limit.
// - A request larger than its session's, its job's or its uid's whole limit
//   can never fit (kNever). Otherwise its own quota holds it back (kHeld)
//   while its session holds quotas.max_groups_per_session groups, or while
//   its session's, its job's or its uid's held bytes plus the request exceed
//   the limit.
//   Checked in that order; the first that fails names the refusal.
// - Placed state (a session of SessionKind::kState): what the state
//   sessions of one job hold together is at most its share,
//   quotas.state_share x the job's effective limit (its limit above, or
//   the usable arena when it has none, whichever is lower), rounded down.
//   A request larger than the share can never fit (kNever, checked after
//   the job's whole limit); one the job's state already holds too much for
//   is held back (kHeld, checked after the job's held bytes). Other kinds are not counted against
//   the share: they keep the rest of the job's limit. A state session's own limit (its hello's
//   max_bytes) lowers what it may hold below the share.
// - With tenants, the chunks the tenants of one uid own (whatever job ids
//   they name) are at most quotas.uid_max_chunks (0: no limit): a request
//   larger than that many chunks can never fit; one that needs a chunk
//   more while its uid owns that many is held back by its own quota. A
//   uid's bytes limit alone lets it pin a chunk with each of a few small
//   groups or regions; this bounds the chunks it keeps from others.
// - Checkpoint regions: none at all with regions.max_bytes = 0. A new one
//   is refused while its job holds regions.max_per_job regions, its uid
//   (over all its job ids) regions.max_per_uid, or the node
//   regions.max_count (checked in that order); and when its bytes would take
//   its job past regions.job_max_bytes, its uid past regions.uid_max_bytes or
//   the node past regions.max_bytes (in that order). The per-uid limits are
//   by default an eighth of regions.max_count and half of regions.max_bytes
//   (config.cc resolves them); 0: no per-job or per-uid limit. With tenants
//   the chunks regions pin are bounded by regions.max_bytes too.
// - Room: a request fits the arena now when used + bytes <= usable. It
//   leaves an aged waiter's keep_free_bytes free when used + bytes +
//   keep_free_bytes <= usable too.
#ifndef MEMOFFLOAD_DAEMON_QUOTA_POLICY_H_
#define MEMOFFLOAD_DAEMON_QUOTA_POLICY_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "config/config.h"
#include "memoffload/common/status.h"
#include "memoffload/shared_mem/attach_wire.h"

namespace memoffload::daemon {

// Why a Reserve was refused; a label of the rejections metric.
enum class RejectReason {
  kNone,
  kTooLarge,  // larger than the usable arena: can never fit
  kSessionLimit,
  kJobLimit,
  kArenaFull,    // usable arena (capacity - node reserve) is full
  kWaitTimeout,  // waited until the deadline
  kTooManyWaiters,
  kDraining,
  kCancelled,      // the caller cancelled (or its deadline passed) while waiting
  kTooFragmented,  // would take more than quotas.max_extents_per_reserve extents
  kGroupLimit,     // the session holds quotas.max_groups_per_session groups
  kUidLimit,       // quotas.uid_max_bytes: what all sessions of the uid hold
  kUidChunks,      // quotas.uid_max_chunks: the chunks the uid's tenants own
  kStateShare,     // quotas.state_share: what the job's placed state may hold
};
inline constexpr int kRejectReasonCount = 14;
const char* RejectReasonName(RejectReason reason);

// What a request is measured against: its session's and its job's holdings
// now, and who they are (named in refusals).
struct QuotaUsage {
  uint64_t session_id = 0;
  uint64_t session_held_bytes = 0;
  uint64_t session_groups = 0;
  uint64_t session_asked_bytes = 0;  // the hello's max_bytes; 0: none
  std::string_view job_id;           // outlives the call
  uid_t uid = 0;
  uint64_t job_held_bytes = 0;
  uint64_t job_asked_bytes = 0;            // smallest job_max_bytes asked; 0: none
  uint64_t uid_held_bytes = 0;             // all sessions of the uid
  SessionKind kind = SessionKind::kOther;  // the session's
  uint64_t job_state_held_bytes = 0;       // what the job's state sessions hold
  uint64_t usable_bytes = 0;               // the usable arena: a job's limit when it has none
};

enum class QuotaVerdict {
  kAllowed,  // within every quota
  kHeld,     // its own quota holds it back now; it may fit later
  kNever,    // larger than a whole limit: it can never fit
};

struct QuotaDecision {
  QuotaVerdict verdict = QuotaVerdict::kAllowed;
  RejectReason reason = RejectReason::kNone;
  Status status;  // RESOURCE_EXHAUSTED naming the limit and the excess, unless allowed
  bool allowed() const { return verdict == QuotaVerdict::kAllowed; }
};

// What a new region is measured against: what its job, its uid (over all
// its job ids) and the node hold now, and who they are (named in refusals).
struct RegionUsage {
  std::string_view job_id;  // outlives the call
  uid_t uid = 0;
  uint64_t job_regions = 0;
  uint64_t job_held_bytes = 0;
  uint64_t uid_regions = 0;
  uint64_t uid_held_bytes = 0;
  uint64_t node_regions = 0;
  uint64_t node_held_bytes = 0;
};

// The arena's room for a request now (Room).
struct ArenaRoom {
  bool fits = false;              // used + bytes <= usable
  bool leaves_kept_free = false;  // and keep_free_bytes more
  uint64_t usable_bytes = 0;
  uint64_t available_bytes = 0;  // usable - used, or 0
};

class QuotaPolicy {
 public:
  explicit QuotaPolicy(const Policy& policy = Policy{}) : policy_(policy) {}

  const Policy& policy() const { return policy_; }

  // capacity - node reserve, or 0 when the reserve covers the arena.
  uint64_t UsableBytes(uint64_t capacity_bytes) const;
  // The limits in force; 0: no limit.
  uint64_t SessionLimit(uint64_t asked_bytes) const;
  uint64_t JobLimit(uint64_t asked_bytes) const;
  // The share of a job's bytes its placed state may hold (quotas.state_share
  // of the job's limit, or of `usable_bytes` when that is lower or there is
  // none).
  uint64_t StateShareBytes(uint64_t job_asked_bytes, uint64_t usable_bytes) const;

  // RESOURCE_EXHAUSTED (kTooLarge) when `size_bytes` exceeds the usable
  // arena of `capacity_bytes`: it can never fit, however long it waits.
  Status CheckFitsArena(uint64_t size_bytes, uint64_t capacity_bytes, RejectReason* reject) const;
  // The one quota check of a try to place `bytes` (page-rounded) for
  // `usage`: every session and job limit and the group count, once.
  QuotaDecision Check(const QuotaUsage& usage, uint64_t bytes) const;
  // quotas.uid_max_chunks: RESOURCE_EXHAUSTED (kUidChunks) when `bytes`
  // exceed the whole limit of `uid` in chunks of `chunk_bytes` (it can never
  // fit), else OK. 0: no limit.
  Status CheckFitsUidChunks(uid_t uid, uint64_t bytes, uint64_t chunk_bytes,
                            RejectReason* reject) const;
  // Whether a placement of `bytes` for `uid`, whose tenants own
  // `owned_chunks`, may take over `more_chunks` chunks more: OK, or
  // RESOURCE_EXHAUSTED (kUidChunks) naming the limit (the request waits for
  // its uid's own chunks to have room).
  Status MayTakeChunks(uid_t uid, uint32_t owned_chunks, uint64_t more_chunks, uint64_t bytes,
                       RejectReason* reject) const;
  // FAILED_PRECONDITION when regions are disabled (regions.max_bytes = 0).
  Status CheckRegionsEnabled() const;
  // The region counts of `usage`: RESOURCE_EXHAUSTED naming the first limit
  // that leaves no room for one more region (job, uid, node).
  Status CheckRegionCount(const RegionUsage& usage) const;
  // The region bytes: RESOURCE_EXHAUSTED naming the first limit that region
  // `name` of `bytes` (page-rounded) would exceed (job, uid, node), and
  // whether it can never fit.
  Status CheckRegionBytes(const RegionUsage& usage, const std::string& name, uint64_t bytes) const;
  // With tenants: RESOURCE_EXHAUSTED when region `name` would pin
  // `more_chunk_bytes` more of the arena's chunks to `tenant` (of `uid`)
  // while regions pin `pinned_chunk_bytes` in all, `uid_chunk_bytes` of them
  // for `uid`'s regions: past regions.max_bytes (the node), or past
  // regions.uid_max_bytes (the uid: a uid that pins small regions in many
  // chunks leaves the rest to others). A uid that pins none yet may pin up
  // to `first_region_chunk_bytes` (what its first region needs at best:
  // its whole chunks and one it may straddle), so a chunk larger than the
  // uid's share still lets every uid keep a checkpoint, but a small region
  // scattered over many chunks does not. The message names the limit.
  Status CheckRegionChunks(const std::string& name, const std::string& tenant, uid_t uid,
                           uint64_t pinned_chunk_bytes, uint64_t uid_chunk_bytes,
                           uint64_t more_chunk_bytes, uint64_t first_region_chunk_bytes) const;
  // The one capacity check of a placement: whether `bytes` fit the usable
  // arena now, and leave keep_free_bytes free.
  ArenaRoom Room(uint64_t capacity_bytes, uint64_t used_bytes, uint64_t bytes,
                 uint64_t keep_free_bytes) const;
  // RESOURCE_EXHAUSTED (kArenaFull) naming `bytes`, what is available and
  // the shortfall given `room`, and keep_free_bytes when not 0.
  Status ArenaFull(const ArenaRoom& room, uint64_t used_bytes, uint64_t bytes,
                   uint64_t keep_free_bytes) const;

 private:
  // regions.max_per_uid and regions.uid_max_bytes, whose messages say how
  // to raise them.
  Status CheckUidRegionCount(uid_t uid, uint64_t held_count) const;
  Status CheckUidRegionBytes(uid_t uid, uint64_t held_bytes, const std::string& name,
                             uint64_t bytes) const;

  Policy policy_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_QUOTA_POLICY_H_
