#include "core/quota_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

// The smaller non-zero of a configured and an asked limit; 0: neither.
uint64_t Tighter(uint64_t configured, uint64_t asked) {
  return asked != 0 && (configured == 0 || asked < configured) ? asked : configured;
}

QuotaDecision Refuse(QuotaVerdict verdict, RejectReason reason, std::string message) {
  return QuotaDecision{verdict, reason, ResourceExhausted(std::move(message))};
}

// What the caller of a region a byte limit refused can do about it.
std::string RegionLimitHint(uint64_t bytes, uint64_t limit) {
  return bytes > limit ? "; it is larger than the whole limit and can never fit"
                       : "; delete old checkpoints (a deleted or expired region still open "
                         "by a reader counts until it is closed)";
}

std::string Regions(uint64_t count) {
  return std::to_string(count) + (count == 1 ? " region" : " regions");
}

// "quotas.state_share 0.5 of the job's 1.00 GiB limit" (or of the usable
// arena): where a job's state share comes from.
std::string ShareOf(double share, uint64_t job_limit, uint64_t usable_bytes) {
  char fraction[32];
  std::snprintf(fraction, sizeof(fraction), "%g", share);
  std::string of = "quotas.state_share " + std::string(fraction) + " of ";
  if (job_limit != 0 && job_limit <= usable_bytes) {
    return of + "the job's " + FormatSize(job_limit) + " limit";
  }
  return of + "the " + FormatSize(usable_bytes) + " usable arena" +
         (job_limit == 0 ? ", the job having no limit" : ", less than the job's limit");
}

}  // namespace

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
    case RejectReason::kCancelled:
      return "cancelled";
    case RejectReason::kTooFragmented:
      return "too_fragmented";
    case RejectReason::kGroupLimit:
      return "group_limit";
    case RejectReason::kUidLimit:
      return "uid_limit";
    case RejectReason::kUidChunks:
      return "uid_chunks";
    case RejectReason::kStateShare:
      return "state_share";
  }
  return "unknown";
}

uint64_t QuotaPolicy::UsableBytes(uint64_t capacity_bytes) const {
  // A reserve at or above the arena leaves nothing (never wraps around).
  return policy_.node_reserve_bytes >= capacity_bytes ? 0
                                                      : capacity_bytes - policy_.node_reserve_bytes;
}

uint64_t QuotaPolicy::SessionLimit(uint64_t asked_bytes) const {
  return Tighter(policy_.session_max_bytes, asked_bytes);
}

uint64_t QuotaPolicy::JobLimit(uint64_t asked_bytes) const {
  return Tighter(policy_.job_max_bytes, asked_bytes);
}

uint64_t QuotaPolicy::StateShareBytes(uint64_t job_asked_bytes, uint64_t usable_bytes) const {
  const uint64_t job_limit = JobLimit(job_asked_bytes);
  const uint64_t limit = job_limit == 0 ? usable_bytes : std::min(job_limit, usable_bytes);
  const double share = policy_.state_share;
  if (share >= 1) return limit;
  // Rounded down, and never past the limit (a double holds 53 bits).
  const double bytes = std::floor(static_cast<double>(limit) * share);
  return bytes <= 0 ? 0 : std::min(limit, static_cast<uint64_t>(bytes));
}

Status QuotaPolicy::CheckFitsArena(uint64_t size_bytes, uint64_t capacity_bytes,
                                   RejectReason* reject) const {
  const uint64_t usable = UsableBytes(capacity_bytes);
  if (size_bytes <= usable) return Status::Ok();
  *reject = RejectReason::kTooLarge;
  return ResourceExhausted("group of " + FormatSize(size_bytes) +
                           " is larger than the whole usable arena (" + FormatSize(usable) +
                           " of " + FormatSize(capacity_bytes) + "; node reserve " +
                           FormatSize(policy_.node_reserve_bytes) + ")");
}

Status QuotaPolicy::CheckFitsUidChunks(uid_t uid, uint64_t bytes, uint64_t chunk_bytes,
                                       RejectReason* reject) const {
  const uint64_t cap = policy_.uid_max_chunks;
  if (cap == 0 || chunk_bytes == 0 || bytes <= cap * chunk_bytes) return Status::Ok();
  *reject = RejectReason::kUidChunks;
  // Exact bytes: FormatSize would show a page over a whole chunk as equal.
  return ResourceExhausted(
      "uid chunk limit: " + std::to_string(bytes) + " bytes is more than the " +
      std::to_string(cap) + (cap == 1 ? " chunk" : " chunks") + " of " + FormatSize(chunk_bytes) +
      " (" + std::to_string(cap * chunk_bytes) + " bytes) the tenants of uid " +
      std::to_string(uid) + " may own (quotas.uid_max_chunks); it can never fit");
}

Status QuotaPolicy::MayTakeChunks(uid_t uid, uint32_t owned_chunks, uint64_t more_chunks,
                                  uint64_t bytes, RejectReason* reject) const {
  const uint64_t cap = policy_.uid_max_chunks;
  if (cap == 0 || more_chunks == 0 || owned_chunks + more_chunks <= cap) return Status::Ok();
  *reject = RejectReason::kUidChunks;
  return ResourceExhausted(
      "uid chunk limit: the tenants of uid " + std::to_string(uid) + " own " +
      std::to_string(owned_chunks) + (owned_chunks == 1 ? " chunk" : " chunks") +
      " (quotas.uid_max_chunks is " + std::to_string(cap) + "), and " + FormatSize(bytes) +
      " need " + std::to_string(more_chunks) + (more_chunks == 1 ? " chunk" : " chunks") +
      " more than the free space of its own chunks: release groups or delete regions of its "
      "jobs (chunks are not shared between tenants), or raise the limit");
}

QuotaDecision QuotaPolicy::Check(const QuotaUsage& u, uint64_t bytes) const {
  const uint64_t session_limit = SessionLimit(u.session_asked_bytes);
  const uint64_t job_limit = JobLimit(u.job_asked_bytes);
  // Larger than a whole limit: no release can make room.
  if (session_limit != 0 && bytes > session_limit) {
    return Refuse(QuotaVerdict::kNever, RejectReason::kSessionLimit,
                  "session limit: " + FormatSize(bytes) + " is more than the whole of its " +
                      FormatSize(session_limit) + " limit (by " +
                      FormatSize(bytes - session_limit) + "); it can never fit in session " +
                      std::to_string(u.session_id));
  }
  if (job_limit != 0 && bytes > job_limit) {
    return Refuse(QuotaVerdict::kNever, RejectReason::kJobLimit,
                  "job limit: " + FormatSize(bytes) + " is more than the whole " +
                      FormatSize(job_limit) + " limit of job '" + std::string(u.job_id) + "' (by " +
                      FormatSize(bytes - job_limit) + "); it can never fit");
  }
  const bool state = u.kind == SessionKind::kState;
  const uint64_t share = state ? StateShareBytes(u.job_asked_bytes, u.usable_bytes) : 0;
  auto share_of = [&] { return ShareOf(policy_.state_share, job_limit, u.usable_bytes); };
  if (state && bytes > share) {
    return Refuse(QuotaVerdict::kNever, RejectReason::kStateShare,
                  "state share: " + FormatSize(bytes) + " is more than the whole " +
                      FormatSize(share) + " share of placed state of job '" +
                      std::string(u.job_id) + "' (" + share_of() + ", by " +
                      FormatSize(bytes - share) + "); it can never fit (the job's state holds " +
                      FormatSize(u.job_state_held_bytes) + ")");
  }
  const uint64_t uid_limit = policy_.uid_max_bytes;
  if (uid_limit != 0 && bytes > uid_limit) {
    return Refuse(QuotaVerdict::kNever, RejectReason::kUidLimit,
                  "uid limit: " + FormatSize(bytes) + " is more than the whole " +
                      FormatSize(uid_limit) + " limit of uid " + std::to_string(u.uid) +
                      " (quotas.uid_max_bytes, by " + FormatSize(bytes - uid_limit) +
                      "); it can never fit");
  }
  // Held by what the session, its job and its uid hold now.
  if (u.session_groups >= policy_.max_groups_per_session) {
    return Refuse(QuotaVerdict::kHeld, RejectReason::kGroupLimit,
                  "group limit: session " + std::to_string(u.session_id) + " holds " +
                      std::to_string(u.session_groups) +
                      " groups, the limit quotas.max_groups_per_session is " +
                      std::to_string(policy_.max_groups_per_session) +
                      "; Release groups before reserving more");
  }
  if (session_limit != 0 && u.session_held_bytes + bytes > session_limit) {
    return Refuse(QuotaVerdict::kHeld, RejectReason::kSessionLimit,
                  "session limit: session " + std::to_string(u.session_id) + " holds " +
                      FormatSize(u.session_held_bytes) + " of its " + FormatSize(session_limit) +
                      " limit; " + FormatSize(bytes) + " more would exceed it by " +
                      FormatSize(u.session_held_bytes + bytes - session_limit));
  }
  if (job_limit != 0 && u.job_held_bytes + bytes > job_limit) {
    return Refuse(QuotaVerdict::kHeld, RejectReason::kJobLimit,
                  "job limit: job '" + std::string(u.job_id) + "' holds " +
                      FormatSize(u.job_held_bytes) + " of its " + FormatSize(job_limit) +
                      " limit; " + FormatSize(bytes) + " more would exceed it by " +
                      FormatSize(u.job_held_bytes + bytes - job_limit) + " (uid " +
                      std::to_string(u.uid) + ")");
  }
  if (state && u.job_state_held_bytes + bytes > share) {
    return Refuse(
        QuotaVerdict::kHeld, RejectReason::kStateShare,
        "state share: the placed state of job '" + std::string(u.job_id) + "' holds " +
            FormatSize(u.job_state_held_bytes) + " of its " + FormatSize(share) + " share (" +
            share_of() + "); " + FormatSize(bytes) + " more would exceed it by " +
            FormatSize(u.job_state_held_bytes + bytes - share) + " (uid " + std::to_string(u.uid) +
            "; its activations and checkpoints keep the rest of the job's limit)");
  }
  if (uid_limit != 0 && u.uid_held_bytes + bytes > uid_limit) {
    return Refuse(QuotaVerdict::kHeld, RejectReason::kUidLimit,
                  "uid limit: the sessions of uid " + std::to_string(u.uid) + " hold " +
                      FormatSize(u.uid_held_bytes) + " of its " + FormatSize(uid_limit) +
                      " limit (quotas.uid_max_bytes, over all its jobs); " + FormatSize(bytes) +
                      " more would exceed it by " +
                      FormatSize(u.uid_held_bytes + bytes - uid_limit));
  }
  return QuotaDecision{};
}

Status QuotaPolicy::CheckRegionsEnabled() const {
  if (policy_.region_max_bytes != 0) return Status::Ok();
  return FailedPrecondition("checkpoint regions are disabled on this node (regions.max_bytes = 0)");
}

Status QuotaPolicy::CheckRegionCount(const RegionUsage& u) const {
  if (u.job_regions >= policy_.max_regions_per_job) {
    return ResourceExhausted("job " + std::string(u.job_id) + " holds " + Regions(u.job_regions) +
                             ", the limit (regions.max_per_job); delete old ones");
  }
  MEMOFFLOAD_RETURN_IF_ERROR(CheckUidRegionCount(u.uid, u.uid_regions));
  if (u.node_regions >= policy_.max_regions) {
    return ResourceExhausted("the node holds " + Regions(u.node_regions) +
                             ", the limit (regions.max_count); delete old checkpoints");
  }
  return Status::Ok();
}

Status QuotaPolicy::CheckRegionBytes(const RegionUsage& u, const std::string& name,
                                     uint64_t bytes) const {
  const uint64_t job_limit = policy_.region_job_max_bytes;
  if (job_limit != 0 && u.job_held_bytes + bytes > job_limit) {
    return ResourceExhausted("region " + name + " (" + FormatSize(bytes) + ") over job " +
                             std::string(u.job_id) + "'s region limit: it holds " +
                             FormatSize(u.job_held_bytes) + " of " + FormatSize(job_limit) +
                             " (regions.job_max_bytes)" + RegionLimitHint(bytes, job_limit));
  }
  MEMOFFLOAD_RETURN_IF_ERROR(CheckUidRegionBytes(u.uid, u.uid_held_bytes, name, bytes));
  if (u.node_held_bytes + bytes > policy_.region_max_bytes) {
    return ResourceExhausted("region " + name + " (" + FormatSize(bytes) +
                             ") over the node's region limit: regions hold " +
                             FormatSize(u.node_held_bytes) + " of " +
                             FormatSize(policy_.region_max_bytes) + " (regions.max_bytes)");
  }
  return Status::Ok();
}

Status QuotaPolicy::CheckRegionChunks(const std::string& name, const std::string& tenant, uid_t uid,
                                      uint64_t pinned_chunk_bytes, uint64_t uid_chunk_bytes,
                                      uint64_t more_chunk_bytes,
                                      uint64_t first_region_chunk_bytes) const {
  if (more_chunk_bytes == 0) return Status::Ok();
  if (pinned_chunk_bytes + more_chunk_bytes > policy_.region_max_bytes) {
    return ResourceExhausted(
        "region " + name + " would pin " + FormatSize(more_chunk_bytes) +
        " more of the arena's chunks to tenant " + tenant + ": regions would keep " +
        FormatSize(pinned_chunk_bytes + more_chunk_bytes) + " of chunks from other tenants, over " +
        FormatSize(policy_.region_max_bytes) +
        " (regions.max_bytes; a chunk holding a region stays its tenant's)");
  }
  const uint64_t uid_limit = policy_.region_uid_max_bytes;
  const uint64_t allowed =
      uid_chunk_bytes == 0 ? std::max(uid_limit, first_region_chunk_bytes) : uid_limit;
  if (uid_limit != 0 && uid_chunk_bytes + more_chunk_bytes > allowed) {
    return ResourceExhausted(
        "region " + name + " would pin " + FormatSize(more_chunk_bytes) +
        " more of the arena's chunks to tenant " + tenant + ": uid " + std::to_string(uid) +
        "'s regions would keep " + FormatSize(uid_chunk_bytes + more_chunk_bytes) +
        " of chunks from other tenants, over its " + FormatSize(uid_limit) +
        " (regions.uid_max_bytes, counted in whole chunks with tenants; by default half of "
        "regions.max_bytes). Delete old checkpoints of this uid, or put small "
        "regions of one uid in one job (tenant = uid shares chunks between its jobs)");
  }
  return Status::Ok();
}

Status QuotaPolicy::CheckUidRegionCount(uid_t uid, uint64_t held_count) const {
  const uint64_t limit = policy_.max_regions_per_uid;
  if (limit == 0 || held_count < limit) return Status::Ok();
  return ResourceExhausted(
      "uid " + std::to_string(uid) + " holds " + std::to_string(held_count) +
      " regions over all its jobs, its limit (regions.max_per_uid = " + std::to_string(limit) +
      "; by default an eighth of regions.max_count); delete old ones (a deleted or expired "
      "region still open by a reader counts until it is closed), or raise regions.max_per_uid "
      "(0: no per-uid limit)");
}

Status QuotaPolicy::CheckUidRegionBytes(uid_t uid, uint64_t held_bytes, const std::string& name,
                                        uint64_t bytes) const {
  const uint64_t limit = policy_.region_uid_max_bytes;
  if (limit == 0 || held_bytes + bytes <= limit) return Status::Ok();
  return ResourceExhausted(
      "region " + name + " (" + FormatSize(bytes) + ") over uid " + std::to_string(uid) +
      "'s region limit: its jobs hold " + FormatSize(held_bytes) + " of " + FormatSize(limit) +
      " (regions.uid_max_bytes; by default half of regions.max_bytes); " +
      (bytes > limit ? "it is larger than the whole limit and can never fit"
                     : "delete old checkpoints (a deleted or expired region still open by a "
                       "reader counts until it is closed)") +
      ", or raise regions.uid_max_bytes (0: only regions.max_bytes)");
}

ArenaRoom QuotaPolicy::Room(uint64_t capacity_bytes, uint64_t used_bytes, uint64_t bytes,
                            uint64_t keep_free_bytes) const {
  ArenaRoom room;
  room.usable_bytes = UsableBytes(capacity_bytes);
  room.available_bytes = room.usable_bytes > used_bytes ? room.usable_bytes - used_bytes : 0;
  room.fits = bytes <= room.available_bytes;
  room.leaves_kept_free = room.fits && keep_free_bytes <= room.available_bytes - bytes;
  return room;
}

Status QuotaPolicy::ArenaFull(const ArenaRoom& room, uint64_t used_bytes, uint64_t bytes,
                              uint64_t keep_free_bytes) const {
  const uint64_t needed = bytes + keep_free_bytes;
  return ResourceExhausted(
      "arena full: " + FormatSize(bytes) + " requested, " + FormatSize(room.available_bytes) +
      " available (" + FormatSize(used_bytes) + " in use of " + FormatSize(room.usable_bytes) +
      " usable; node reserve " + FormatSize(policy_.node_reserve_bytes) +
      (keep_free_bytes == 0 ? std::string()
                            : "; " + FormatSize(keep_free_bytes) +
                                  " kept free for an older waiting reserve of another tenant "
                                  "(quotas.reserve_aging)") +
      "), short by " +
      FormatSize(needed > room.available_bytes ? needed - room.available_bytes : 0));
}

}  // namespace memoffload::daemon
