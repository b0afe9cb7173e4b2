// QuotaPolicy (daemon/core/quota_policy.cc): the quota and capacity rules of a
// Reserve, asked directly: no table, no thread, no clock.
#include "core/quota_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

Policy Limits(uint64_t session_max, uint64_t job_max, uint64_t max_groups = 16) {
  Policy p;
  p.session_max_bytes = session_max;
  p.job_max_bytes = job_max;
  p.max_groups_per_session = max_groups;
  return p;
}

QuotaUsage Usage(uint64_t session_held, uint64_t groups, uint64_t job_held) {
  QuotaUsage u;
  u.session_id = 7;
  u.session_held_bytes = session_held;
  u.session_groups = groups;
  u.job_id = "train";
  u.uid = 1000;
  u.job_held_bytes = job_held;
  return u;
}

TEST(QuotaPolicyTest, UsableArenaIsCapacityLessTheNodeReserveAndNeverWraps) {
  Policy p;
  p.node_reserve_bytes = kMiB;
  QuotaPolicy quota(p);
  EXPECT_EQ(quota.UsableBytes(4 * kMiB), 3 * kMiB);
  EXPECT_EQ(quota.UsableBytes(kMiB), 0u);
  EXPECT_EQ(quota.UsableBytes(kMiB / 2), 0u);
  RejectReason reject = RejectReason::kNone;
  EXPECT_TRUE(quota.CheckFitsArena(3 * kMiB, 4 * kMiB, &reject).ok());
  EXPECT_EQ(reject, RejectReason::kNone);
  const Status st = quota.CheckFitsArena(3 * kMiB + 1, 4 * kMiB, &reject);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reject, RejectReason::kTooLarge);
}

TEST(QuotaPolicyTest, TheTighterOfTheConfiguredAndTheAskedLimitHolds) {
  QuotaPolicy none(Limits(0, 0));
  EXPECT_EQ(none.SessionLimit(0), 0u);  // no limit at all
  EXPECT_EQ(none.SessionLimit(kMiB), kMiB);
  QuotaPolicy quota(Limits(4 * kMiB, 8 * kMiB));
  EXPECT_EQ(quota.SessionLimit(0), 4 * kMiB);
  EXPECT_EQ(quota.SessionLimit(2 * kMiB), 2 * kMiB);
  EXPECT_EQ(quota.SessionLimit(6 * kMiB), 4 * kMiB);  // asking more gets no more
  EXPECT_EQ(quota.JobLimit(0), 8 * kMiB);
  EXPECT_EQ(quota.JobLimit(3 * kMiB), 3 * kMiB);
}

TEST(QuotaPolicyTest, RequestsOverAWholeLimitCanNeverFitWhateverIsHeld) {
  QuotaPolicy quota(Limits(4 * kMiB, 6 * kMiB, 2));
  // At the group limit too: the limit it can never meet is what it is told.
  QuotaDecision d = quota.Check(Usage(0, 2, 0), 5 * kMiB);
  EXPECT_EQ(d.verdict, QuotaVerdict::kNever);
  EXPECT_EQ(d.reason, RejectReason::kSessionLimit);
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted);
  QuotaUsage asked = Usage(0, 0, 0);
  asked.session_asked_bytes = 8 * kMiB;  // above the configured 4 MiB: no effect
  asked.job_asked_bytes = 3 * kMiB;
  d = quota.Check(asked, 4 * kMiB);
  EXPECT_EQ(d.verdict, QuotaVerdict::kNever);
  EXPECT_EQ(d.reason, RejectReason::kJobLimit);
}

TEST(QuotaPolicyTest, HeldByGroupsThenSessionBytesThenJobBytesAndAllowedUpToTheLimit) {
  QuotaPolicy quota(Limits(4 * kMiB, 6 * kMiB, 2));
  QuotaDecision d = quota.Check(Usage(4 * kMiB, 2, 6 * kMiB), kMiB);
  EXPECT_EQ(d.verdict, QuotaVerdict::kHeld);
  EXPECT_EQ(d.reason, RejectReason::kGroupLimit);
  d = quota.Check(Usage(3 * kMiB + 1, 1, 6 * kMiB), kMiB);
  EXPECT_EQ(d.verdict, QuotaVerdict::kHeld);
  EXPECT_EQ(d.reason, RejectReason::kSessionLimit);
  d = quota.Check(Usage(kMiB, 1, 5 * kMiB + 1), kMiB);
  EXPECT_EQ(d.verdict, QuotaVerdict::kHeld);
  EXPECT_EQ(d.reason, RejectReason::kJobLimit);
  // Exactly at both limits is still within them.
  d = quota.Check(Usage(3 * kMiB, 1, 5 * kMiB), kMiB);
  EXPECT_TRUE(d.allowed());
  EXPECT_EQ(d.reason, RejectReason::kNone);
  EXPECT_TRUE(d.status.ok());
}

// quotas.state_share: a job's state sessions together hold at most that
// fraction of the job's limit (the usable arena without one); other kinds
// of the job are not counted against it.
TEST(QuotaPolicyTest, AJobsPlacedStateIsHeldAtItsShareAndOtherKindsAreNot) {
  Policy p = Limits(0, 64 * kMiB);
  p.state_share = 0.25;
  QuotaPolicy quota(p);
  EXPECT_EQ(quota.StateShareBytes(0, 256 * kMiB), 16 * kMiB);
  EXPECT_EQ(quota.StateShareBytes(32 * kMiB, 256 * kMiB), 8 * kMiB);  // the job asked less
  EXPECT_EQ(quota.StateShareBytes(0, 40 * kMiB), 10 * kMiB);          // the arena is smaller
  QuotaUsage u = Usage(0, 0, 20 * kMiB);
  u.kind = SessionKind::kState;
  u.usable_bytes = 256 * kMiB;
  u.job_state_held_bytes = 12 * kMiB;
  QuotaDecision d = quota.Check(u, 4 * kMiB);
  EXPECT_TRUE(d.allowed()) << d.status.message();  // exactly at the share
  d = quota.Check(u, 4 * kMiB + 4096);
  EXPECT_EQ(d.verdict, QuotaVerdict::kHeld);
  EXPECT_EQ(d.reason, RejectReason::kStateShare);
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(d.status.message().find("the placed state of job 'train' holds 12.00 MiB of its "
                                    "16.00 MiB share (quotas.state_share 0.25 of the job's "
                                    "64.00 MiB limit)"),
            std::string::npos)
      << d.status.message();
  d = quota.Check(u, 17 * kMiB);
  EXPECT_EQ(d.verdict, QuotaVerdict::kNever);
  EXPECT_EQ(d.reason, RejectReason::kStateShare);
  EXPECT_NE(d.status.message().find("quotas.state_share"), std::string::npos);
  // Activations of the same job: only the job's limit holds them.
  u.kind = SessionKind::kActivations;
  EXPECT_TRUE(quota.Check(u, 40 * kMiB).allowed());
  EXPECT_EQ(quota.Check(u, 44 * kMiB + 4096).reason, RejectReason::kJobLimit);
  // No job limit: a share of the usable arena, and the message says so.
  QuotaPolicy unlimited(Limits(0, 0));
  u.kind = SessionKind::kState;
  u.usable_bytes = 64 * kMiB;
  u.job_state_held_bytes = 32 * kMiB;
  d = unlimited.Check(u, 4096);
  EXPECT_EQ(d.reason, RejectReason::kStateShare);
  EXPECT_NE(d.status.message().find("quotas.state_share 0.5 of the 64.00 MiB usable arena, the "
                                    "job having no limit"),
            std::string::npos)
      << d.status.message();
  // A share of 1: all of the job's limit.
  p.state_share = 1;
  EXPECT_EQ(QuotaPolicy(p).StateShareBytes(0, 256 * kMiB), 64 * kMiB);
}

TEST(QuotaPolicyTest, AUidsSessionsTogetherAreHeldByItsLimitAndNamedInTheRefusal) {
  Policy p = Limits(0, 0);
  p.uid_max_bytes = 4 * kMiB;
  QuotaPolicy quota(p);
  QuotaUsage u = Usage(0, 0, 0);
  u.uid_held_bytes = 3 * kMiB;
  EXPECT_TRUE(quota.Check(u, kMiB).allowed());  // exactly at the limit
  QuotaDecision d = quota.Check(u, kMiB + 1);
  EXPECT_EQ(d.verdict, QuotaVerdict::kHeld);
  EXPECT_EQ(d.reason, RejectReason::kUidLimit);
  EXPECT_NE(d.status.message().find("uid 1000"), std::string::npos) << d.status.message();
  EXPECT_NE(d.status.message().find("quotas.uid_max_bytes"), std::string::npos);
  d = quota.Check(Usage(0, 0, 0), 4 * kMiB + 1);
  EXPECT_EQ(d.verdict, QuotaVerdict::kNever);
  EXPECT_EQ(d.reason, RejectReason::kUidLimit);
  EXPECT_STREQ(RejectReasonName(RejectReason::kUidLimit), "uid_limit");
}

TEST(QuotaPolicyTest, AUidsChunkLimitHoldsAtItsCountAndRefusesMoreThanItsChunksForever) {
  Policy p;
  QuotaPolicy none(p);
  RejectReason reason = RejectReason::kNone;
  // 0: no limit, whatever the uid owns.
  EXPECT_TRUE(none.MayTakeChunks(1000, 1000, 1, kMiB, &reason).ok());
  EXPECT_TRUE(none.CheckFitsUidChunks(1000, 1ull << 40, kMiB, &reason).ok());
  EXPECT_EQ(reason, RejectReason::kNone);
  p.uid_max_chunks = 2;
  QuotaPolicy quota(p);
  EXPECT_TRUE(quota.MayTakeChunks(1000, 1, 1, kMiB, &reason).ok());
  Status st = quota.MayTakeChunks(1000, 2, 1, kMiB, &reason);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kUidChunks);
  EXPECT_NE(st.message().find("the tenants of uid 1000 own 2 chunks"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("(quotas.uid_max_chunks is 2)"), std::string::npos);
  // Several chunks at once: refused when they would pass the limit, and
  // moving chunks between its own tenants (0 more) is always allowed.
  st = quota.MayTakeChunks(1000, 1, 2, 2 * kMiB, &reason);
  EXPECT_NE(st.message().find("own 1 chunk (quotas.uid_max_chunks is 2), and 2.00 MiB need 2 "
                              "chunks more"),
            std::string::npos)
      << st.message();
  EXPECT_TRUE(quota.MayTakeChunks(1000, 5, 0, kMiB, &reason).ok());
  // Over it (a SIGHUP lowered it): the count and the limit, as they are.
  st = quota.MayTakeChunks(1000, 5, 1, kMiB, &reason);
  EXPECT_NE(st.message().find("own 5 chunks (quotas.uid_max_chunks is 2)"), std::string::npos)
      << st.message();
  reason = RejectReason::kNone;
  EXPECT_TRUE(quota.CheckFitsUidChunks(1000, 2 * kMiB, kMiB, &reason).ok());
  st = quota.CheckFitsUidChunks(1000, 2 * kMiB + 1, kMiB, &reason);
  EXPECT_EQ(reason, RejectReason::kUidChunks);
  EXPECT_NE(st.message().find("2097153 bytes is more than the 2 chunks of 1.00 MiB (2097152 "
                              "bytes)"),
            std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("it can never fit"), std::string::npos) << st.message();
  EXPECT_STREQ(RejectReasonName(RejectReason::kUidChunks), "uid_chunks");
}

TEST(QuotaPolicyTest, RoomIsTheUsableArenaLessWhatIsUsedWithAndWithoutKeptBytes) {
  Policy p;
  p.node_reserve_bytes = kMiB;
  QuotaPolicy quota(p);
  // 8 MiB arena, 7 usable, 5 used: 2 available.
  ArenaRoom room = quota.Room(8 * kMiB, 5 * kMiB, 2 * kMiB, 0);
  EXPECT_TRUE(room.fits);
  EXPECT_TRUE(room.leaves_kept_free);
  EXPECT_EQ(room.available_bytes, 2 * kMiB);
  room = quota.Room(8 * kMiB, 5 * kMiB, kMiB, kMiB);
  EXPECT_TRUE(room.fits);
  EXPECT_TRUE(room.leaves_kept_free);  // exactly the kept bytes are left
  room = quota.Room(8 * kMiB, 5 * kMiB, kMiB, kMiB + 1);
  EXPECT_TRUE(room.fits);
  EXPECT_FALSE(room.leaves_kept_free);
  room = quota.Room(8 * kMiB, 5 * kMiB, 2 * kMiB + 1, 0);
  EXPECT_FALSE(room.fits);
  EXPECT_FALSE(room.leaves_kept_free);
  // A SIGHUP raised the reserve above what is in use: nothing is available.
  room = quota.Room(8 * kMiB, 7 * kMiB + 1, 1, 0);
  EXPECT_FALSE(room.fits);
  EXPECT_EQ(room.available_bytes, 0u);
  const Status full = quota.ArenaFull(room, 7 * kMiB + 1, 1, 0);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
}

Policy RegionLimits() {
  Policy p;
  p.region_max_bytes = 64 * kMiB;
  p.region_job_max_bytes = 16 * kMiB;
  p.region_uid_max_bytes = 32 * kMiB;
  p.max_regions_per_job = 4;
  p.max_regions_per_uid = 8;
  p.max_regions = 16;
  return p;
}

RegionUsage Held(uint64_t job_regions, uint64_t job_bytes, uint64_t uid_regions, uint64_t uid_bytes,
                 uint64_t node_regions, uint64_t node_bytes) {
  RegionUsage u;
  u.job_id = "train";
  u.uid = 1000;
  u.job_regions = job_regions;
  u.job_held_bytes = job_bytes;
  u.uid_regions = uid_regions;
  u.uid_held_bytes = uid_bytes;
  u.node_regions = node_regions;
  u.node_held_bytes = node_bytes;
  return u;
}

bool Names(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string::npos;
}

TEST(QuotaPolicyTest, RegionsAreDisabledWithoutANodeRegionLimit) {
  EXPECT_EQ(QuotaPolicy(Policy{}).CheckRegionsEnabled().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Names(QuotaPolicy(Policy{}).CheckRegionsEnabled(), "regions.max_bytes = 0"));
  EXPECT_TRUE(QuotaPolicy(RegionLimits()).CheckRegionsEnabled().ok());
}

TEST(QuotaPolicyTest, RegionCountsRefuseTheJobThenTheUidThenTheNodeAtTheirLimit) {
  const QuotaPolicy quota(RegionLimits());
  EXPECT_TRUE(quota.CheckRegionCount(Held(3, 0, 7, 0, 15, 0)).ok());
  Status st = quota.CheckRegionCount(Held(4, 0, 8, 0, 16, 0));  // every one full: the job's named
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Names(st, "job train holds 4 regions, the limit (regions.max_per_job)"))
      << st.message();
  st = quota.CheckRegionCount(Held(3, 0, 8, 0, 16, 0));
  EXPECT_TRUE(Names(st, "uid 1000 holds 8 regions over all its jobs")) << st.message();
  st = quota.CheckRegionCount(Held(3, 0, 7, 0, 16, 0));
  EXPECT_TRUE(Names(st, "the node holds 16 regions, the limit (regions.max_count)"))
      << st.message();
  Policy no_uid_limit = RegionLimits();
  no_uid_limit.max_regions_per_uid = 0;  // 0: no per-uid limit
  EXPECT_TRUE(QuotaPolicy(no_uid_limit).CheckRegionCount(Held(3, 0, 1000, 0, 15, 0)).ok());
}

TEST(QuotaPolicyTest, RegionBytesRefuseTheJobThenTheUidThenTheNodeUpToTheLimit) {
  const QuotaPolicy quota(RegionLimits());
  // Exactly at each limit fits.
  EXPECT_TRUE(
      quota.CheckRegionBytes(Held(0, 12 * kMiB, 0, 28 * kMiB, 0, 60 * kMiB), "r", 4 * kMiB).ok());
  Status st =
      quota.CheckRegionBytes(Held(0, 12 * kMiB + 1, 0, 32 * kMiB, 0, 64 * kMiB), "r", 4 * kMiB);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Names(st, "over job train's region limit")) << st.message();
  EXPECT_TRUE(Names(st, "(regions.job_max_bytes); delete old checkpoints")) << st.message();
  st = quota.CheckRegionBytes(Held(0, 0, 0, 0, 0, 0), "r", 16 * kMiB + 1);
  EXPECT_TRUE(Names(st, "larger than the whole limit and can never fit")) << st.message();
  st = quota.CheckRegionBytes(Held(0, 0, 0, 28 * kMiB + 1, 0, 64 * kMiB), "r", 4 * kMiB);
  EXPECT_TRUE(Names(st, "over uid 1000's region limit")) << st.message();
  st = quota.CheckRegionBytes(Held(0, 0, 0, 0, 0, 60 * kMiB + 1), "r", 4 * kMiB);
  EXPECT_TRUE(Names(st, "r (4.00 MiB) over the node's region limit")) << st.message();
  EXPECT_TRUE(Names(st, "(regions.max_bytes)")) << st.message();
  Policy only_node = RegionLimits();
  only_node.region_job_max_bytes = 0;  // 0: only the node cap (and the uid's)
  EXPECT_TRUE(QuotaPolicy(only_node)
                  .CheckRegionBytes(Held(0, 30 * kMiB, 0, 0, 0, 30 * kMiB), "r", 2 * kMiB)
                  .ok());
}

TEST(QuotaPolicyTest, ChunksRegionsPinAreBoundedByTheNodeRegionLimit) {
  const QuotaPolicy quota(RegionLimits());
  EXPECT_TRUE(quota.CheckRegionChunks("r", "uid:1000", 1000, 64 * kMiB, 0, 0, 0).ok());  // no more
  EXPECT_TRUE(
      quota.CheckRegionChunks("r", "uid:1000", 1000, 60 * kMiB, 0, 4 * kMiB, 8 * kMiB).ok());
  const Status st =
      quota.CheckRegionChunks("r", "uid:1000", 1000, 60 * kMiB, 0, 4 * kMiB + 1, 8 * kMiB);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Names(st, "more of the arena's chunks to tenant uid:1000")) << st.message();
  EXPECT_TRUE(Names(st, "(regions.max_bytes;")) << st.message();
}

// Issue 38: one uid's tiny regions, each in a chunk of its own, pinned the
// node's whole region-chunk budget. regions.uid_max_bytes bounds the chunks a
// uid's regions pin too, once it pins any (its first region always may).
TEST(QuotaPolicyTest, ChunksOneUidsRegionsPinAreBoundedByItsShare) {
  const QuotaPolicy quota(RegionLimits());  // uid: 32 MiB of the node's 64
  EXPECT_TRUE(
      quota.CheckRegionChunks("r", "uid:1000", 1000, 28 * kMiB, 28 * kMiB, 4 * kMiB, 8 * kMiB)
          .ok());
  Status st =
      quota.CheckRegionChunks("r", "job:1000:b", 1000, 28 * kMiB, 28 * kMiB, 8 * kMiB, 8 * kMiB);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Names(st, "uid 1000's regions would keep 36.00 MiB")) << st.message();
  EXPECT_TRUE(Names(st, "(regions.uid_max_bytes,")) << st.message();
  // Another uid's first region, larger than a uid's share, may pin the
  // chunks it needs at best (here 36 MiB of 40)...
  EXPECT_TRUE(
      quota.CheckRegionChunks("r", "uid:2000", 2000, 28 * kMiB, 0, 36 * kMiB, 40 * kMiB).ok());
  // ... but a small first region scattered over many chunks may not pin
  // more than the share (issue 38's review: 16 KiB pinned every chunk).
  st = quota.CheckRegionChunks("r", "uid:2000", 2000, 0, 0, 36 * kMiB, 8 * kMiB);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Names(st, "(regions.uid_max_bytes,")) << st.message();
  // The node's cap is named first when both are crossed.
  st = quota.CheckRegionChunks("r", "uid:1000", 1000, 60 * kMiB, 32 * kMiB, 8 * kMiB, 8 * kMiB);
  EXPECT_TRUE(Names(st, "(regions.max_bytes;")) << st.message();
  // 0: only the node's cap.
  Policy no_uid = RegionLimits();
  no_uid.region_uid_max_bytes = 0;
  EXPECT_TRUE(
      QuotaPolicy(no_uid)
          .CheckRegionChunks("r", "uid:1000", 1000, 56 * kMiB, 56 * kMiB, 8 * kMiB, 8 * kMiB)
          .ok());
}

// Check against a model written from the rules in quota_policy.h, over
// random limits and holdings around the boundaries.
TEST(QuotaPolicyTest, CheckAgreesWithTheRulesOnRandomRequests) {
  std::mt19937_64 rng(14);
  auto around = [&](uint64_t v) {
    return std::uniform_int_distribution<uint64_t>(v > 3 ? v - 3 : 0, v + 3)(rng);
  };
  auto pick = [&] { return std::uniform_int_distribution<uint64_t>(0, 12)(rng); };
  for (int i = 0; i < 200000; ++i) {
    const uint64_t session_max = pick(), job_max = pick(), groups_max = pick();
    const uint64_t uid_max = pick();
    Policy limits = Limits(session_max, job_max, groups_max);
    limits.uid_max_bytes = uid_max;
    limits.state_share = static_cast<double>(1 + rng() % 4) / 4;
    QuotaPolicy quota(limits);
    QuotaUsage u = Usage(pick(), around(groups_max), pick());
    u.uid_held_bytes = pick();
    u.session_asked_bytes = pick();
    u.job_asked_bytes = pick();
    u.kind = static_cast<SessionKind>(rng() % kSessionKindCount);
    u.job_state_held_bytes = pick();
    u.usable_bytes = 1 + pick();
    const uint64_t bytes = 1 + pick();
    auto tighter = [](uint64_t configured, uint64_t asked) {
      if (configured == 0) return asked;
      if (asked == 0) return configured;
      return std::min(configured, asked);
    };
    const uint64_t sl = tighter(session_max, u.session_asked_bytes);
    const uint64_t jl = tighter(job_max, u.job_asked_bytes);
    const bool state = u.kind == SessionKind::kState;
    const uint64_t share = static_cast<uint64_t>(
        static_cast<double>(jl == 0 ? u.usable_bytes : std::min(jl, u.usable_bytes)) *
        limits.state_share);  // quarters of small integers: exact
    QuotaVerdict want = QuotaVerdict::kAllowed;
    RejectReason why = RejectReason::kNone;
    if (sl != 0 && bytes > sl) {
      want = QuotaVerdict::kNever;
      why = RejectReason::kSessionLimit;
    } else if (jl != 0 && bytes > jl) {
      want = QuotaVerdict::kNever;
      why = RejectReason::kJobLimit;
    } else if (state && bytes > share) {
      want = QuotaVerdict::kNever;
      why = RejectReason::kStateShare;
    } else if (uid_max != 0 && bytes > uid_max) {
      want = QuotaVerdict::kNever;
      why = RejectReason::kUidLimit;
    } else if (u.session_groups >= groups_max) {
      want = QuotaVerdict::kHeld;
      why = RejectReason::kGroupLimit;
    } else if (sl != 0 && u.session_held_bytes + bytes > sl) {
      want = QuotaVerdict::kHeld;
      why = RejectReason::kSessionLimit;
    } else if (jl != 0 && u.job_held_bytes + bytes > jl) {
      want = QuotaVerdict::kHeld;
      why = RejectReason::kJobLimit;
    } else if (state && u.job_state_held_bytes + bytes > share) {
      want = QuotaVerdict::kHeld;
      why = RejectReason::kStateShare;
    } else if (uid_max != 0 && u.uid_held_bytes + bytes > uid_max) {
      want = QuotaVerdict::kHeld;
      why = RejectReason::kUidLimit;
    }
    const QuotaDecision d = quota.Check(u, bytes);
    ASSERT_EQ(d.verdict, want) << "case " << i;
    ASSERT_EQ(d.reason, why) << "case " << i;
    ASSERT_EQ(d.status.ok(), want == QuotaVerdict::kAllowed) << "case " << i;
  }
}

}  // namespace
}  // namespace memoffload::daemon
