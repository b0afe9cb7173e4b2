// Tenant chunk ownership through SessionTable (daemon/core/session_table_tenants.cc,
// the rules in TenantChunks, tenant_chunks_test.cc):
// which chunks a session may map, when a chunk changes tenant (empty, and no
// live session of its old tenant has it mapped) and that it gets a new memfd
// (fresh backing, a new generation) then, and only then, while whoever kept
// the old one sees only the old bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>

#include "core/session_table.h"
#include "memoffload/common/units.h"
#include "test_arena.h"

namespace memoffload::daemon {
namespace {

class TenantChunks : public ::testing::Test {
 protected:
  // A 4 MiB arena of four 1 MiB chunks.
  void Make(TenantMode mode) {
    arena_ = MakeTestArena();
    ASSERT_NE(arena_, nullptr);
    table_ = std::make_unique<SessionTable>(arena_.get(), Policy{}, mode);
  }
  void TearDown() override {
    if (table_) {
      EXPECT_TRUE(table_->CheckInvariants().ok());
    }
  }

  SessionGrant Open(uid_t uid, const std::string& job = "job") { return OpenAs(*table_, uid, job); }

  // Reserves `bytes` as `group`, maps its chunks (as the client does) and
  // fills them with `fill`. Returns the chunks it landed in.
  std::set<uint32_t> Fill(const SessionGrant& s, uint64_t group, uint64_t bytes, uint8_t fill) {
    auto r = table_->Reserve(s.session_id, s.token, group, bytes, false);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return {};
    std::set<uint32_t> chunks;
    for (const Extent& e : r->extents) {
      chunks.insert(e.chunk);
      std::memset(arena_->chunk(e.chunk).data() + e.offset, fill, e.length);
    }
    EXPECT_TRUE(table_->GrantChunks(s.session_id, {chunks.begin(), chunks.end()}).ok());
    return chunks;
  }

  static bool BackingIs(const Chunk& c, uint8_t value) {
    return std::all_of(c.data(), c.data() + c.size_bytes(),
                       [value](uint8_t b) { return b == value; });
  }
  bool ChunkIs(uint32_t chunk, uint8_t value) const {
    return BackingIs(arena_->chunk(chunk), value);
  }
  static std::set<uint32_t> Indexes(const std::vector<ChunkGrant>& grants) {
    std::set<uint32_t> out;
    for (const ChunkGrant& g : grants) out.insert(g.index);
    return out;
  }

  std::unique_ptr<Arena> arena_;
  std::unique_ptr<SessionTable> table_;
};

TEST_F(TenantChunks, UidModeHandsOutOnlyTheTenantsOwnChunks) {
  Make(TenantMode::kUid);
  SessionGrant a = Open(1000);
  // A fresh tenant owns nothing, so it is handed no fd at attach.
  auto at_attach = table_->AttachChunks(a.session_id);
  ASSERT_TRUE(at_attach.ok());
  EXPECT_TRUE(at_attach->empty());
  const std::set<uint32_t> a_chunks = Fill(a, 1, 2 * kMiB, 0xAA);
  ASSERT_EQ(a_chunks.size(), 2u);
  EXPECT_EQ(table_->Snapshot().owned_chunks, 2u);

  // Another session of the same uid gets A's chunks at attach.
  SessionGrant a2 = Open(1000, "other-job");
  auto same = table_->AttachChunks(a2.session_id);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(Indexes(*same), a_chunks);

  // Another uid gets none of them, and asking is PERMISSION_DENIED, naming
  // the chunk; a request mixing allowed and refused chunks grants nothing.
  SessionGrant b = Open(2000);
  auto other = table_->AttachChunks(b.session_id);
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(other->empty());
  const uint32_t a_chunk = *a_chunks.begin();
  Status denied = table_->GrantChunks(b.session_id, {a_chunk}).status();
  EXPECT_EQ(denied.code(), StatusCode::kPermissionDenied) << denied.ToString();
  EXPECT_NE(denied.message().find("chunk " + std::to_string(a_chunk)), std::string::npos);
  const std::set<uint32_t> b_chunks = Fill(b, 1, kMiB, 0xBB);
  ASSERT_EQ(b_chunks.size(), 1u);
  EXPECT_EQ(a_chunks.count(*b_chunks.begin()), 0u);
  EXPECT_EQ(table_->GrantChunks(b.session_id, {*b_chunks.begin(), a_chunk}).status().code(),
            StatusCode::kPermissionDenied);
  // Out of range is INVALID_ARGUMENT, not a crash.
  EXPECT_EQ(table_->GrantChunks(b.session_id, {4}).status().code(), StatusCode::kInvalidArgument);
  // Nothing was zeroed: every chunk went to its first tenant.
  EXPECT_EQ(table_->Snapshot().replaced_backings, 0u);
}

TEST_F(TenantChunks, JobModeSeparatesJobsOfOneUid) {
  Make(TenantMode::kJob);
  SessionGrant a = Open(1000, "job-a");
  SessionGrant b = Open(1000, "job-b");
  const std::set<uint32_t> a_chunks = Fill(a, 1, kMiB, 0xAA);
  ASSERT_EQ(a_chunks.size(), 1u);
  EXPECT_EQ(table_->GrantChunks(b.session_id, {*a_chunks.begin()}).status().code(),
            StatusCode::kPermissionDenied);
  // The tenant is job:<uid>:<job_id>: the same job id from another uid is
  // another tenant, the same job from the same uid shares the chunks.
  SessionGrant other_uid = Open(2000, "job-a");
  EXPECT_EQ(table_->GrantChunks(other_uid.session_id, {*a_chunks.begin()}).status().code(),
            StatusCode::kPermissionDenied);
  SessionGrant a2 = Open(1000, "job-a");
  EXPECT_TRUE(table_->GrantChunks(a2.session_id, {*a_chunks.begin()}).ok());
}

// quotas.uid_max_chunks: the chunks the tenants of one uid own, over every
// job id it names. Without it, each job id's tenant takes a chunk of its own
// with a few KiB, and a uid keeps as many chunks from other uids as it
// names jobs.
TEST_F(TenantChunks, AUidsChunkLimitSpansItsJobIdsAndLeavesOtherUidsTheirChunks) {
  Make(TenantMode::kJob);
  Policy policy;
  policy.uid_max_chunks = 2;
  table_->SetPolicy(policy);
  SessionGrant a = Open(1000, "a");
  SessionGrant b = Open(1000, "b");
  SessionGrant c = Open(1000, "c");
  SessionGrant other = Open(2000, "a");
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 4096, false).ok());
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, 4096, false).ok());
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(c.session_id, c.token, 1, 4096, false, std::nullopt, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kUidChunks);
  EXPECT_NE(r.status().message().find("the tenants of uid 1000 own 2 chunks "
                                      "(quotas.uid_max_chunks is 2)"),
            std::string::npos)
      << r.status().message();
  // Another uid takes a chunk of its own; a job of the capped uid still
  // places in the chunk it owns.
  EXPECT_TRUE(table_->Reserve(other.session_id, other.token, 1, 4096, false).ok());
  EXPECT_TRUE(table_->Reserve(a.session_id, a.token, 2, 512 * kKiB, false).ok());
  // More than two whole chunks can never fit, and says so at once.
  r = table_->Reserve(a.session_id, a.token, 3, 2 * kMiB + 4096, false,
                      std::chrono::steady_clock::now() + std::chrono::seconds(60), &reason);
  EXPECT_EQ(reason, RejectReason::kUidChunks);
  EXPECT_NE(r.status().message().find("it can never fit"), std::string::npos)
      << r.status().message();
  // A chunk another job of the uid left empty moves to c: the uid's count
  // stays 2.
  ASSERT_TRUE(table_->Release(b.session_id, b.token, 1).ok());
  EXPECT_TRUE(table_->Reserve(c.session_id, c.token, 1, 4096, false).ok());
  EXPECT_EQ(table_->Snapshot().owned_chunks, 3u);
}

// A waiter its uid's chunk limit holds back neither ages into keeping bytes
// free from other uids nor waits forever: it is served when its own chunks
// have room.
TEST_F(TenantChunks, AWaiterHeldByItsUidsChunkLimitDoesNotHoldBackOtherUids) {
  Make(TenantMode::kUid);
  Policy policy;
  policy.uid_max_chunks = 1;
  policy.reserve_aging_ms = 0;       // every waiter is aged at once
  policy.node_reserve_bytes = kMiB;  // 3 MiB usable
  table_->SetPolicy(policy);
  SessionGrant capped = Open(1000);
  SessionGrant second = Open(2000);
  SessionGrant third = Open(3000);
  ASSERT_TRUE(table_->Reserve(capped.session_id, capped.token, 1, 4096, false).ok());
  ASSERT_TRUE(table_->Reserve(capped.session_id, capped.token, 2, 512 * kKiB, false).ok());
  // 768 KiB do not fit in the 508 KiB its one chunk has left: it waits.
  std::optional<Result<ReserveResult>> answer;
  RejectReason answer_reason = RejectReason::kNone;
  table_->ReserveAsync(capped.session_id, capped.token, 3, 768 * kKiB, false,
                       std::chrono::steady_clock::now() + std::chrono::seconds(60),
                       [&](Result<ReserveResult>&& result, RejectReason why) {
                         answer.emplace(std::move(result));
                         answer_reason = why;
                       });
  ASSERT_FALSE(answer.has_value());
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 1u);
  // Aged at once, yet its limit, not the arena, holds it: other uids take
  // over empty chunks as if it were not there. Keeping its 768 KiB free
  // would refuse the third uid's chunk (516 KiB + 2 MiB + 768 KiB > 3 MiB).
  EXPECT_TRUE(table_->Reserve(second.session_id, second.token, 1, kMiB, false).ok());
  auto r = table_->Reserve(third.session_id, third.token, 1, kMiB, false);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_FALSE(answer.has_value());
  // Its own chunk gets room back: it is served there.
  ASSERT_TRUE(table_->Release(capped.session_id, capped.token, 2).ok());
  ASSERT_TRUE(answer.has_value());
  ASSERT_TRUE(answer->ok()) << answer->status().ToString();
  EXPECT_EQ(answer_reason, RejectReason::kNone);
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 0u);
}

// With tenant = job each job id has a line of the waiting queue; the lines
// of one uid share quotas.max_waiting_reserves_per_tenant, so a uid cannot
// fill the queue (and make other uids' waits fail) by naming job ids.
TEST_F(TenantChunks, TheJobIdsOfAUidShareOneShareOfTheWaitingQueue) {
  Make(TenantMode::kJob);
  Policy policy;
  policy.uid_max_bytes = 4096;  // every further Reserve of a uid waits
  policy.max_waiting_reserves = 6;
  policy.max_waiting_reserves_per_tenant = 2;
  table_->SetPolicy(policy);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int answered = 0;
  auto wait = [&](const SessionGrant& s, uint64_t group) {
    table_->ReserveAsync(s.session_id, s.token, group, 4096, false, deadline,
                         [&](Result<ReserveResult>&&, RejectReason) { ++answered; });
  };
  SessionGrant a = Open(1000, "a");
  SessionGrant b = Open(1000, "b");
  SessionGrant other = Open(2000, "a");
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 4096, false).ok());
  ASSERT_TRUE(table_->Reserve(other.session_id, other.token, 1, 4096, false).ok());
  wait(a, 2);
  wait(a, 3);
  EXPECT_EQ(answered, 0);
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(b.session_id, b.token, 2, 4096, false, deadline, &reason);
  EXPECT_EQ(reason, RejectReason::kTooManyWaiters);
  EXPECT_NE(r.status().message().find("too many waiting reserves of uid 1000"), std::string::npos)
      << r.status().message();
  // Another uid still queues.
  wait(other, 2);
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 3u);
  table_->BeginShutdown();  // answers the waiters
  EXPECT_EQ(answered, 3);
}

// With tenant = uid, single-extent reserves larger than any hole of its own
// chunks made a uid take over chunk after chunk; the limit stops that too.
TEST_F(TenantChunks, SingleExtentReservesTakeNoMoreChunksThanTheUidLimit) {
  Make(TenantMode::kUid);
  Policy policy;
  policy.uid_max_chunks = 2;
  table_->SetPolicy(policy);
  SessionGrant s = Open(1000);
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 768 * kKiB, true).ok());
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 2, 768 * kKiB, true).ok());
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(s.session_id, s.token, 3, 768 * kKiB, true, std::nullopt, &reason);
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kUidChunks);
  // Split over its own chunks' holes it fits.
  EXPECT_TRUE(table_->Reserve(s.session_id, s.token, 3, 384 * kKiB, false).ok());
  EXPECT_EQ(table_->Snapshot().owned_chunks, 2u);
}

// A Reserve that needs more chunks than its uid may still take is refused
// before it takes any (it took one, kept it empty, and counted it).
TEST_F(TenantChunks, AReserveTheChunkLimitCannotCoverTakesNoChunk) {
  Make(TenantMode::kUid);
  Policy policy;
  policy.uid_max_chunks = 2;
  table_->SetPolicy(policy);
  SessionGrant s = Open(1000);
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 4096, false).ok());
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(s.session_id, s.token, 2, 2 * kMiB, false, std::nullopt, &reason);
  EXPECT_EQ(reason, RejectReason::kUidChunks);
  EXPECT_NE(r.status().message().find("own 1 chunk (quotas.uid_max_chunks is 2), and 2.00 MiB "
                                      "need 2 chunks more"),
            std::string::npos)
      << r.status().message();
  EXPECT_EQ(table_->Snapshot().owned_chunks, 1u);
  // One chunk more is within the limit.
  EXPECT_TRUE(table_->Reserve(s.session_id, s.token, 2, kMiB, false).ok());
  EXPECT_EQ(table_->Snapshot().owned_chunks, 2u);
}

// A waiter that needs more chunks than its uid may still take is held by
// its own limit too: aged at once, it keeps nothing free from other uids.
TEST_F(TenantChunks, AWaiterNeedingMoreChunksThanItsUidMayTakeHoldsNobodyBack) {
  Make(TenantMode::kUid);
  Policy policy;
  policy.uid_max_chunks = 2;
  policy.reserve_aging_ms = 0;
  policy.node_reserve_bytes = kMiB;  // 3 MiB usable
  table_->SetPolicy(policy);
  SessionGrant capped = Open(1000);
  SessionGrant other = Open(2000);
  ASSERT_TRUE(table_->Reserve(capped.session_id, capped.token, 1, 4096, false).ok());
  // 2 MiB need two chunks beyond its first one's 1020 KiB; it may take one.
  std::optional<Result<ReserveResult>> answer;
  table_->ReserveAsync(
      capped.session_id, capped.token, 2, 2 * kMiB, false,
      std::chrono::steady_clock::now() + std::chrono::seconds(60),
      [&](Result<ReserveResult>&& result, RejectReason) { answer.emplace(std::move(result)); });
  ASSERT_FALSE(answer.has_value());
  // Keeping its 2 MiB free would refuse this (4 KiB + 1 MiB + 2 MiB > 3 MiB).
  auto r = table_->Reserve(other.session_id, other.token, 1, kMiB, false);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_FALSE(answer.has_value());
  // Its first chunk empties: one chunk more covers it now, and it is served.
  ASSERT_TRUE(table_->Release(capped.session_id, capped.token, 1).ok());
  ASSERT_TRUE(answer.has_value());
  EXPECT_TRUE(answer->ok()) << answer->status().ToString();
}

// A Reserve that the empty chunks it may take over cannot cover either is
// refused before it takes any: it took them, failed anyway, and kept them
// empty from the other tenants (whose next claim then needed a new memfd).
TEST_F(TenantChunks, AReserveTheClaimableChunksCannotCoverTakesNoChunk) {
  Make(TenantMode::kUid);
  SessionGrant a = Open(1000);
  SessionGrant b = Open(2000);
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 4096, false).ok());  // chunk 0
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, 4096, false).ok());  // chunk 1
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 2, kMiB, false).ok());  // and 2
  // A's 1020 KiB and the one empty chunk (1 MiB) cannot hold 2 MiB, though
  // the arena has 3 MiB - 8 KiB free.
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(a.session_id, a.token, 2, 2 * kMiB, false, std::nullopt, &reason);
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kArenaFull);
  EXPECT_NE(r.status().message().find("1020.00 KiB free in its 1 chunk, and 1 empty chunk it "
                                      "may take over; none was taken"),
            std::string::npos)
      << r.status().message();
  auto uids = table_->ListUids();
  ASSERT_EQ(uids.size(), 2u);
  for (const UidSnapshot& u : uids) EXPECT_EQ(u.owned_chunks, u.uid == 1000 ? 1u : 2u);
  // The empty chunk is still never used: B takes it without a new memfd.
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 3, kMiB, true).ok());
  EXPECT_EQ(table_->Snapshot().replaced_backings, 0u);
  // What the claimable chunks do cover is still placed.
  ASSERT_TRUE(table_->Release(b.session_id, b.token, 3).ok());
  EXPECT_TRUE(table_->Reserve(a.session_id, a.token, 2, 2 * kMiB - 8 * kKiB, false).ok());
}

TEST_F(TenantChunks, NoneModeSharesEveryChunkAndNeverReplacesBacking) {
  Make(TenantMode::kNone);
  SessionGrant a = Open(1000);
  SessionGrant b = Open(2000);
  auto chunks = table_->AttachChunks(b.session_id);
  ASSERT_TRUE(chunks.ok());
  EXPECT_EQ(chunks->size(), 4u);
  const std::set<uint32_t> a_chunks = Fill(a, 1, 4 * kMiB, 0xAA);
  EXPECT_TRUE(table_->GrantChunks(b.session_id, {a_chunks.begin(), a_chunks.end()}).ok());
  ASSERT_TRUE(table_->Release(a.session_id, a.token, 1).ok());
  ASSERT_TRUE(table_->Close(a.session_id, CloseReason::kLifelineClosed).ok());
  auto r = table_->Reserve(b.session_id, b.token, 1, 4 * kMiB, false);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(table_->Snapshot().replaced_backings, 0u);
  EXPECT_TRUE(ChunkIs(0, 0xAA));  // one trusted tenant: same backing
}

// The holder rule (docs/security.md, "Tenant isolation"): an empty chunk
// does not return to the common pool while a live session of its tenant has
// it mapped (its fd cannot be revoked); it does once those sessions end.
TEST_F(TenantChunks, TenantsComingAndGoingReusePoolNumbers) {
  // 300 jobs one after the other, each its own tenant, each taking over a
  // chunk: the allocator's pools stay at one per tenant alive (the four
  // chunk owners) plus pool 0, not one per tenant ever seen.
  Make(TenantMode::kJob);
  for (int i = 0; i < 300; ++i) {
    const SessionGrant s = Open(1000, "job-" + std::to_string(i));
    ASSERT_EQ(Fill(s, 1, 4 * kKiB, static_cast<uint8_t>(i)).size(), 1u) << "job " << i;
    ASSERT_TRUE(table_->Release(s.session_id, s.token, 1).ok());
    ASSERT_TRUE(table_->Close(s.session_id, CloseReason::kLifelineClosed).ok());
    ASSERT_TRUE(table_->CheckInvariants().ok())
        << "job " << i << ": " << table_->CheckInvariants().ToString();
  }
  EXPECT_LE(arena_->allocator().pool_count(), 1u + arena_->chunk_count() + 1u);
}

TEST_F(TenantChunks, ANewTableOverTheSameArenaStartsWithEveryChunkInPoolZero) {
  // The fuzzers build a table per input over one arena: the allocator keeps
  // the pools the last table's tenants had; the new table owns no chunk.
  Make(TenantMode::kUid);
  const SessionGrant a = Open(1000), b = Open(1001);
  Fill(a, 1, 4 * kKiB, 1);
  Fill(b, 1, 4 * kKiB, 2);
  ASSERT_TRUE(table_->Close(a.session_id, CloseReason::kLifelineClosed).ok());
  ASSERT_TRUE(table_->Close(b.session_id, CloseReason::kLifelineClosed).ok());
  table_ = std::make_unique<SessionTable>(arena_.get(), Policy{}, TenantMode::kUid);
  ASSERT_TRUE(table_->CheckInvariants().ok()) << table_->CheckInvariants().ToString();
  for (uint32_t c = 0; c < arena_->chunk_count(); ++c) {
    EXPECT_EQ(arena_->allocator().chunk_pool(c), 0u) << "chunk " << c;
  }
  const SessionGrant c = Open(1002);
  EXPECT_EQ(Fill(c, 1, 4 * kKiB, 3).size(), 1u);
}

TEST_F(TenantChunks, EmptyChunkChangesTenantOnlyAfterItsHoldersClose) {
  Make(TenantMode::kUid);
  SessionGrant a = Open(1000);
  SessionGrant a2 = Open(1000);  // a second holder of the same tenant
  const std::set<uint32_t> a_chunks = Fill(a, 1, 4 * kMiB, 0xAA);
  ASSERT_EQ(a_chunks.size(), 4u);
  ASSERT_TRUE(table_->GrantChunks(a2.session_id, {0, 1, 2, 3}).ok());
  ASSERT_TRUE(table_->Release(a.session_id, a.token, 1).ok());
  EXPECT_EQ(table_->Snapshot().free_bytes, 4 * kMiB);

  SessionGrant b = Open(2000);
  // Empty, but both of A's sessions still map every chunk.
  RejectReason why = RejectReason::kNone;
  auto refused = table_->Reserve(b.session_id, b.token, 1, kMiB, false, std::nullopt, &why);
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status().ToString();
  EXPECT_EQ(why, RejectReason::kArenaFull);
  EXPECT_NE(refused.status().message().find("chunks of other tenants"), std::string::npos)
      << refused.status().message();
  ASSERT_TRUE(table_->Close(a.session_id, CloseReason::kLifelineClosed).ok());
  // One holder left is enough to keep them.
  EXPECT_EQ(table_->Reserve(b.session_id, b.token, 1, kMiB, false).status().code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(table_->Snapshot().replaced_backings, 0u);
  for (uint32_t c = 0; c < 4; ++c) EXPECT_TRUE(ChunkIs(c, 0xAA)) << "chunk " << c;

  // What A's processes keep (here: references to the backings they mapped).
  std::vector<std::shared_ptr<const Chunk>> kept;
  for (uint32_t i = 0; i < 4; ++i) kept.push_back(arena_->backing(i));
  ASSERT_TRUE(table_->Close(a2.session_id, CloseReason::kLifelineClosed).ok());
  auto taken = table_->Reserve(b.session_id, b.token, 1, kMiB, false);
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  ASSERT_EQ(taken->extents.size(), 1u);
  const uint32_t c = taken->extents[0].chunk;
  EXPECT_TRUE(ChunkIs(c, 0)) << "chunk " << c << " changed tenant with old bytes in it";
  EXPECT_NE(arena_->backing(c), kept[c]) << "chunk " << c << " changed tenant on the same memfd";
  EXPECT_EQ(arena_->generation(c), 2u);
  // B's bytes never reach what A kept, and A's old bytes stay A's.
  std::memset(arena_->chunk(c).data(), 0xBB, arena_->chunk(c).size_bytes());
  EXPECT_TRUE(BackingIs(*kept[c], 0xAA));
  auto granted = table_->GrantChunks(b.session_id, {c});
  ASSERT_TRUE(granted.ok());
  EXPECT_EQ((*granted)[0].generation, 2u);
  EXPECT_EQ((*granted)[0].backing, arena_->backing(c));
  EXPECT_EQ(table_->Snapshot().replaced_backings, 1u);  // only the chunk B took
  for (uint32_t other = 0; other < 4; ++other) {
    if (other != c) {
      EXPECT_TRUE(ChunkIs(other, 0xAA)) << "chunk " << other;
    }
  }
}

TEST_F(TenantChunks, ChunkHeldByANonHolderOfItsTenantIsClaimable) {
  // A reserved and released but never mapped the chunk (never asked for its
  // fd): no live session can see it, so another tenant may have it at once.
  Make(TenantMode::kUid);
  SessionGrant a = Open(1000);
  auto r = table_->Reserve(a.session_id, a.token, 1, 4 * kMiB, false);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(table_->Release(a.session_id, a.token, 1).ok());
  SessionGrant b = Open(2000);
  EXPECT_TRUE(table_->Reserve(b.session_id, b.token, 1, kMiB, false).ok());
  EXPECT_EQ(table_->Snapshot().replaced_backings, 1u);
}

TEST_F(TenantChunks, FreshBackingOnlyOnAChangeOfTenant) {
  Make(TenantMode::kUid);
  SessionGrant a = Open(1000);
  ASSERT_EQ(Fill(a, 1, 4 * kMiB, 0xAA).size(), 4u);
  ASSERT_TRUE(table_->Release(a.session_id, a.token, 1).ok());
  ASSERT_TRUE(table_->Close(a.session_id, CloseReason::kLifelineClosed).ok());

  // The same tenant again (a new session of uid 1000): its chunks, same backing.
  SessionGrant a2 = Open(1000);
  auto again = table_->AttachChunks(a2.session_id);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->size(), 4u);
  auto r = table_->Reserve(a2.session_id, a2.token, 1, 4 * kMiB, false);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(table_->Snapshot().replaced_backings, 0u);
  EXPECT_TRUE(ChunkIs(0, 0xAA));
  ASSERT_TRUE(table_->Release(a2.session_id, a2.token, 1).ok());
  ASSERT_TRUE(table_->Close(a2.session_id, CloseReason::kLifelineClosed).ok());

  // Another tenant: each chunk it takes gets a new backing once, and taking
  // it back to the first tenant gives it another one.
  SessionGrant b = Open(2000);
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, 2 * kMiB, false).ok());
  EXPECT_EQ(table_->Snapshot().replaced_backings, 2u);
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 2, 2 * kMiB, false).ok());
  EXPECT_EQ(table_->Snapshot().replaced_backings, 4u);
  for (uint32_t c = 0; c < 4; ++c) EXPECT_TRUE(ChunkIs(c, 0)) << "chunk " << c;
  ASSERT_TRUE(table_->Release(b.session_id, b.token, 1).ok());
  ASSERT_TRUE(table_->Release(b.session_id, b.token, 2).ok());
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 3, 4 * kMiB, false).ok());
  EXPECT_EQ(table_->Snapshot().replaced_backings, 4u);  // still B's: same backing
  ASSERT_TRUE(table_->Release(b.session_id, b.token, 3).ok());
  ASSERT_TRUE(table_->Close(b.session_id, CloseReason::kLifelineClosed).ok());
  SessionGrant a3 = Open(1000);
  ASSERT_TRUE(table_->Reserve(a3.session_id, a3.token, 1, kMiB, false).ok());
  EXPECT_EQ(table_->Snapshot().replaced_backings, 5u);
}

}  // namespace
}  // namespace memoffload::daemon
