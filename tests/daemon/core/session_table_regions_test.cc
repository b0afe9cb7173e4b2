// Checkpoint regions in the session table: ownership by (uid, job id),
// atomic commit, quotas, TTL and deferred deletes, without threads or sleeps
// (the TTL is driven by ExpireRegions' clock argument).
#include <gtest/gtest.h>

#include <chrono>

#include "core/session_table.h"
#include "memoffload/common/units.h"
#include "test_arena.h"

namespace memoffload::daemon {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

class RegionsTest : public ::testing::Test {
 protected:
  void Make(Policy policy = DefaultPolicy()) {
    arena_ = MakeTestArena();  // 4 chunks of 1 MiB
    ASSERT_NE(arena_, nullptr);
    table_ = std::make_unique<SessionTable>(arena_.get(), policy);
  }
  static Policy DefaultPolicy() {
    Policy p;
    p.region_max_bytes = 2 * kMiB;
    return p;
  }
  void SetUp() override { Make(); }
  void TearDown() override {
    Status st = table_->CheckInvariants();
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  // Creates, then commits `used` bytes of, region `name` in session s.
  void Save(const SessionGrant& s, const std::string& name, uint64_t size, uint64_t used,
            milliseconds ttl = milliseconds(0)) {
    auto c = table_->CreateRegion(s.session_id, s.token, name, size, ttl);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    auto k = table_->CommitRegion(s.session_id, s.token, name, used, {});
    ASSERT_TRUE(k.ok()) << k.status().ToString();
  }
  StatusCode OpenCode(const SessionGrant& s, const std::string& name) {
    return table_->OpenRegion(s.session_id, s.token, name).status().code();
  }

  std::unique_ptr<Arena> arena_;
  std::unique_ptr<SessionTable> table_;
};

TEST_F(RegionsTest, ACommittedRegionOutlivesItsWriterAndIsReadByTheNextSessionOfItsJob) {
  SessionGrant writer = OpenAs(*table_, 1000, "train");
  auto c = table_->CreateRegion(writer.session_id, writer.token, "dcp/1/__0_0.distcp", 100000,
                                milliseconds(0));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->reserved_bytes, 102400u);
  // Not visible while being written, to anyone.
  SessionGrant peer = OpenAs(*table_, 1000, "train");
  EXPECT_EQ(OpenCode(peer, "dcp/1/__0_0.distcp"), StatusCode::kNotFound);
  EXPECT_TRUE(table_->ListRegions(peer.session_id, peer.token, "")->empty());
  auto k =
      table_->CommitRegion(writer.session_id, writer.token, "dcp/1/__0_0.distcp", 5000, {0x1234u});
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(k->committed_bytes, 8192u);
  EXPECT_EQ(k->returned_bytes, 102400u - 8192u);
  ASSERT_TRUE(table_->Close(writer.session_id, CloseReason::kProcessExited).ok());
  ASSERT_TRUE(table_->Close(peer.session_id, CloseReason::kProcessExited).ok());
  EXPECT_EQ(table_->Snapshot().committed_region_bytes, 8192u);

  SessionGrant next = OpenAs(*table_, 1000, "train");
  auto o = table_->OpenRegion(next.session_id, next.token, "dcp/1/__0_0.distcp");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->used_bytes, 5000u);
  EXPECT_EQ(o->extent_crc32c, std::vector<uint32_t>{0x1234u});
  EXPECT_EQ(o->extents.size(), 1u);
  auto list = table_->ListRegions(next.session_id, next.token, "dcp/");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].readers, 1u);
  EXPECT_TRUE((*list)[0].checksummed);
  EXPECT_GT((*list)[0].committed_unix, 1.7e9);
  EXPECT_TRUE(table_->CloseRegion(next.session_id, next.token, "dcp/1/__0_0.distcp").ok());
  EXPECT_EQ(table_->CloseRegion(next.session_id, next.token, "dcp/1/__0_0.distcp").code(),
            StatusCode::kFailedPrecondition);
}

// Found by fuzz_regions: a region committed with 0 bytes, deleted while its
// last reader had it open, is dropped when that reader's session closes, and
// the close counts it though it frees no byte (it said "0 regions").
TEST_F(RegionsTest, AnEmptyDeletedRegionIsCountedWhenItsLastReaderCloses) {
  SessionGrant s = OpenAs(*table_, 1000, "train");
  ASSERT_TRUE(table_->CreateRegion(s.session_id, s.token, "empty", 4096, milliseconds(0)).ok());
  auto k = table_->CommitRegion(s.session_id, s.token, "empty", 0, {});
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(k->committed_bytes, 0u);
  ASSERT_TRUE(table_->OpenRegion(s.session_id, s.token, "empty").ok());
  auto deleted = table_->DeleteRegion(s.session_id, s.token, "empty");
  ASSERT_TRUE(deleted.ok()) << deleted.status().ToString();
  EXPECT_EQ(table_->Snapshot().regions, 1u);  // still read
  auto closed = table_->Close(s.session_id, CloseReason::kProcessExited);
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(closed->regions, 1u);
  EXPECT_EQ(closed->region_bytes, 0u);
  EXPECT_EQ(table_->Snapshot().regions, 0u);
}

TEST_F(RegionsTest, ARegionItsWriterNeverCommittedVanishesWithTheWriter) {
  SessionGrant writer = OpenAs(*table_, 1000, "train");
  ASSERT_TRUE(
      table_->CreateRegion(writer.session_id, writer.token, "ckpt", kMiB, milliseconds(0)).ok());
  EXPECT_EQ(table_->Snapshot().region_bytes, kMiB);
  auto closed = table_->Close(writer.session_id, CloseReason::kProcessExited);
  ASSERT_TRUE(closed.ok());
  // What the daemon logs for the session: the region is counted as freed.
  EXPECT_EQ(closed->group_bytes, 0u);
  EXPECT_EQ(closed->regions, 1u);
  EXPECT_EQ(closed->region_bytes, kMiB);
  EXPECT_EQ(table_->Snapshot().region_bytes, 0u);
  EXPECT_EQ(table_->Snapshot().regions, 0u);
  SessionGrant next = OpenAs(*table_, 1000, "train");
  EXPECT_EQ(OpenCode(next, "ckpt"), StatusCode::kNotFound);
  // The name is free again.
  Save(next, "ckpt", 4096, 4096);
}

TEST_F(RegionsTest, OnlyTheSameUidAndJobReachARegion) {
  SessionGrant owner = OpenAs(*table_, 1000, "train");
  Save(owner, "ckpt", 4096, 4096);
  SessionGrant other_job = OpenAs(*table_, 1000, "eval");
  SessionGrant other_uid = OpenAs(*table_, 2000, "train");
  for (const SessionGrant* s : {&other_job, &other_uid}) {
    EXPECT_EQ(OpenCode(*s, "ckpt"), StatusCode::kNotFound);
    EXPECT_EQ(table_->DeleteRegion(s->session_id, s->token, "ckpt").status().code(),
              StatusCode::kNotFound);
    EXPECT_TRUE(table_->ListRegions(s->session_id, s->token, "")->empty());
    // Its own region of that name is another region.
    Save(*s, "ckpt", 4096, 100);
  }
  EXPECT_EQ(table_->ListAllRegions("").size(), 3u);
  auto o = table_->OpenRegion(owner.session_id, owner.token, "ckpt");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->used_bytes, 4096u);
  ASSERT_TRUE(table_->CloseRegion(owner.session_id, owner.token, "ckpt").ok());
  // A bad token is refused before anything is looked up.
  EXPECT_EQ(table_->OpenRegion(owner.session_id, other_uid.token, "ckpt").status().code(),
            StatusCode::kUnauthenticated);
}

TEST_F(RegionsTest, RegionsNeedAnExplicitJobIdAndAValidName) {
  SessionGrant anonymous = OpenAs(*table_, 1000, "");
  auto c = table_->CreateRegion(anonymous.session_id, anonymous.token, "x", 4096, milliseconds(0));
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("explicit job id"), std::string::npos);
  SessionGrant s = OpenAs(*table_, 1000, "train");
  for (const std::string& bad : {std::string(), std::string(256, 'a'), std::string("a b"),
                                 std::string("a\nb"), std::string("\x01")}) {
    EXPECT_EQ(
        table_->CreateRegion(s.session_id, s.token, bad, 4096, milliseconds(0)).status().code(),
        StatusCode::kInvalidArgument);
    EXPECT_EQ(OpenCode(s, bad), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(table_->CreateRegion(s.session_id, s.token, "x", 0, milliseconds(0)).status().code(),
            StatusCode::kInvalidArgument);
  Save(s, "x", 4096, 1);
  EXPECT_EQ(table_->CreateRegion(s.session_id, s.token, "x", 4096, milliseconds(0)).status().code(),
            StatusCode::kAlreadyExists);
  // Commit only by the writer, once, within its size, with one checksum per
  // extent touched.
  ASSERT_TRUE(table_->CreateRegion(s.session_id, s.token, "y", 8192, milliseconds(0)).ok());
  SessionGrant peer = OpenAs(*table_, 1000, "train");
  EXPECT_EQ(table_->CommitRegion(peer.session_id, peer.token, "y", 1, {}).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_->DeleteRegion(peer.session_id, peer.token, "y").status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_->CommitRegion(s.session_id, s.token, "y", 8193, {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(table_->CommitRegion(s.session_id, s.token, "y", 10, {1, 2}).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(table_->CommitRegion(s.session_id, s.token, "y", 10, {1}).ok());
  EXPECT_EQ(table_->CommitRegion(s.session_id, s.token, "y", 10, {1}).status().code(),
            StatusCode::kFailedPrecondition);
}

TEST_F(RegionsTest, JobAndNodeLimitsAndTheCountLimitRefuseAtOnceNamingTheSetting) {
  Policy p = DefaultPolicy();
  p.region_job_max_bytes = kMiB;
  p.max_regions_per_job = 3;
  Make(p);
  SessionGrant a = OpenAs(*table_, 1000, "a");
  SessionGrant b = OpenAs(*table_, 1000, "b");
  SessionGrant c = OpenAs(*table_, 1000, "c");
  Save(a, "one", kMiB, kMiB);
  auto over_job = table_->CreateRegion(a.session_id, a.token, "two", 4096, milliseconds(0));
  EXPECT_EQ(over_job.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over_job.status().message().find("regions.job_max_bytes"), std::string::npos);
  Save(b, "one", kMiB, kMiB);
  auto over_node = table_->CreateRegion(c.session_id, c.token, "one", 4096, milliseconds(0));
  EXPECT_EQ(over_node.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over_node.status().message().find("regions.max_bytes"), std::string::npos);
  // Activations still have the rest of the arena.
  ASSERT_TRUE(table_->Reserve(c.session_id, c.token, 1, 2 * kMiB, false).ok());
  ASSERT_TRUE(table_->DeleteRegion(b.session_id, b.token, "one").ok());
  for (int i = 0; i < 3; ++i) Save(c, "r" + std::to_string(i), 4096, 1);
  auto over_count = table_->CreateRegion(c.session_id, c.token, "r3", 4096, milliseconds(0));
  EXPECT_EQ(over_count.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over_count.status().message().find("regions.max_per_job"), std::string::npos);

  // The node-wide count: c's own limit is not reached, the node's is.
  p.max_regions = 4;  // a holds one, c three
  p.max_regions_per_job = 1024;
  table_->SetPolicy(p);
  auto over_node_count = table_->CreateRegion(c.session_id, c.token, "r4", 4096, milliseconds(0));
  EXPECT_EQ(over_node_count.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over_node_count.status().message().find("regions.max_count"), std::string::npos);

  p.region_max_bytes = 0;
  table_->SetPolicy(p);
  EXPECT_EQ(table_->CreateRegion(b.session_id, b.token, "z", 4096, milliseconds(0)).status().code(),
            StatusCode::kFailedPrecondition);
}

// A uid names as many job ids as it likes: its regions over all of them are
// bounded by regions.uid_max_bytes and regions.max_per_uid, and another uid
// keeps its room.
TEST_F(RegionsTest, AUidsRegionsOverAllItsJobIdsAreBoundedAndAnotherUidKeepsItsRoom) {
  Policy p = DefaultPolicy();
  p.region_uid_max_bytes = 512 * kKiB;
  p.max_regions_per_uid = 3;
  Make(p);
  SessionGrant a = OpenAs(*table_, 1000, "a");
  SessionGrant b = OpenAs(*table_, 1000, "b");
  SessionGrant c = OpenAs(*table_, 1000, "c");
  SessionGrant other = OpenAs(*table_, 1001, "a");
  Save(a, "one", 256 * kKiB, 256 * kKiB);
  Save(b, "one", 256 * kKiB, 256 * kKiB);
  auto over_bytes = table_->CreateRegion(c.session_id, c.token, "one", 4096, milliseconds(0));
  EXPECT_EQ(over_bytes.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over_bytes.status().message().find("regions.uid_max_bytes"), std::string::npos)
      << over_bytes.status().message();
  EXPECT_NE(over_bytes.status().message().find("uid 1000"), std::string::npos);
  EXPECT_NE(over_bytes.status().message().find("delete old checkpoints"), std::string::npos);
  // Larger than the whole limit: no delete helps, and the message says so.
  auto never =
      table_->CreateRegion(other.session_id, other.token, "big", 768 * kKiB, milliseconds(0));
  EXPECT_EQ(never.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(never.status().message().find("larger than the whole limit and can never fit"),
            std::string::npos)
      << never.status().message();
  // The other uid, with the same job id, is not held back.
  Save(other, "one", 256 * kKiB, 256 * kKiB);

  // A deleted region and a commit's unused tail give the room back.
  ASSERT_TRUE(table_->DeleteRegion(b.session_id, b.token, "one").ok());
  Save(c, "two", 256 * kKiB, 4096);
  Save(c, "three", 4096, 4096);  // 256 + 4 + 4 KiB in three regions
  auto over_count = table_->CreateRegion(b.session_id, b.token, "four", 4096, milliseconds(0));
  EXPECT_EQ(over_count.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over_count.status().message().find("regions.max_per_uid"), std::string::npos)
      << over_count.status().message();
  EXPECT_TRUE(
      table_->CreateRegion(other.session_id, other.token, "two", 4096, milliseconds(0)).ok());

  // A region its writer never committed leaves nothing on the uid's tally
  // when the writer goes; then the uid has room for one more.
  ASSERT_TRUE(table_->Close(other.session_id, CloseReason::kProcessExited).ok());
  ASSERT_TRUE(table_->DeleteRegion(a.session_id, a.token, "one").ok());
  auto fits = table_->CreateRegion(b.session_id, b.token, "four", 4096, milliseconds(0));
  EXPECT_TRUE(fits.ok()) << fits.status().ToString();
  EXPECT_TRUE(table_->CheckInvariants().ok());
}

TEST_F(RegionsTest, TheTtlDeletesACommittedRegionAndARequestMayOnlyShortenIt) {
  Policy p = DefaultPolicy();
  p.region_ttl_ms = 60000;
  Make(p);
  SessionGrant s = OpenAs(*table_, 1000, "train");
  Save(s, "short", 4096, 1, milliseconds(1000));
  Save(s, "long", 4096, 1, milliseconds(3600 * 1000));  // capped to 60 s
  auto list = table_->ListRegions(s.session_id, s.token, "");
  ASSERT_EQ(list->size(), 2u);
  EXPECT_DOUBLE_EQ((*list)[0].ttl_seconds, 60.0);  // "long"
  EXPECT_DOUBLE_EQ((*list)[1].ttl_seconds, 1.0);
  const auto now = Clock::now();
  EXPECT_EQ(table_->ExpireRegions(now), 0u);
  EXPECT_EQ(table_->ExpireRegions(now + milliseconds(2000)), 1u);
  EXPECT_EQ(OpenCode(s, "short"), StatusCode::kNotFound);
  EXPECT_EQ(OpenCode(s, "long"), StatusCode::kOk);
  // Being read does not stop the clock, but the reader keeps its bytes.
  EXPECT_EQ(table_->ExpireRegions(now + milliseconds(61000)), 1u);
  EXPECT_EQ(table_->Snapshot().region_bytes, 4096u);
  EXPECT_EQ(table_->Snapshot().regions_expired, 2u);
  ASSERT_TRUE(table_->CloseRegion(s.session_id, s.token, "long").ok());
  EXPECT_EQ(table_->Snapshot().region_bytes, 0u);
}

TEST_F(RegionsTest, ADeleteWhileReadHidesTheRegionAndFreesItWhenTheLastReaderGoes) {
  SessionGrant w = OpenAs(*table_, 1000, "train");
  Save(w, "ckpt", kMiB, kMiB);
  SessionGrant r1 = OpenAs(*table_, 1000, "train");
  SessionGrant r2 = OpenAs(*table_, 1000, "train");
  ASSERT_TRUE(table_->OpenRegion(r1.session_id, r1.token, "ckpt").ok());
  ASSERT_TRUE(table_->OpenRegion(r2.session_id, r2.token, "ckpt").ok());
  auto deleted = table_->DeleteRegion(w.session_id, w.token, "ckpt");
  ASSERT_TRUE(deleted.ok());
  EXPECT_EQ(*deleted, 0u);  // readers still have it
  EXPECT_EQ(OpenCode(w, "ckpt"), StatusCode::kNotFound);
  EXPECT_TRUE(table_->ListRegions(w.session_id, w.token, "")->empty());
  EXPECT_EQ(
      table_->CreateRegion(w.session_id, w.token, "ckpt", 4096, milliseconds(0)).status().code(),
      StatusCode::kAlreadyExists);
  EXPECT_EQ(table_->Snapshot().region_bytes, kMiB);
  EXPECT_EQ(table_->Snapshot().committed_region_bytes, 0u);
  ASSERT_TRUE(table_->CloseRegion(r1.session_id, r1.token, "ckpt").ok());
  EXPECT_EQ(table_->Snapshot().region_bytes, kMiB);
  // The last reader's session ends without closing it: freed then, and
  // counted as its session's.
  auto closed = table_->Close(r2.session_id, CloseReason::kLifelineClosed);
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(closed->regions, 1u);
  EXPECT_EQ(closed->region_bytes, kMiB);
  EXPECT_EQ(table_->Snapshot().region_bytes, 0u);
  EXPECT_EQ(table_->Snapshot().free_bytes, 4 * kMiB);
}

TEST_F(RegionsTest, OneSessionOpensARegionAtMost64TimesAtOnce) {
  SessionGrant s = OpenAs(*table_, 1000, "train");
  Save(s, "ckpt", 4096, 1);
  for (int i = 0; i < 64; ++i) ASSERT_EQ(OpenCode(s, "ckpt"), StatusCode::kOk) << i;
  EXPECT_EQ(OpenCode(s, "ckpt"), StatusCode::kResourceExhausted);
  SessionGrant other = OpenAs(*table_, 1000, "train");
  EXPECT_EQ(OpenCode(other, "ckpt"), StatusCode::kOk);
  ASSERT_TRUE(table_->CloseRegion(s.session_id, s.token, "ckpt").ok());
  EXPECT_EQ(OpenCode(s, "ckpt"), StatusCode::kOk);
  ASSERT_TRUE(table_->Close(s.session_id, CloseReason::kLifelineClosed).ok());
  auto list = table_->ListRegions(other.session_id, other.token, "");
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].readers, 1u);
}

TEST_F(RegionsTest, TinyRegionsPinNoMoreChunksThanTheNodeCapAllows) {
  // Another uid's one-byte regions, each in a chunk of its own (the rest of
  // each chunk held by its activations), pin whole chunks: the cap (2 of the
  // 4 chunks) counts those, so half the arena stays for everyone else.
  SessionGrant hostile = OpenAs(*table_, 2000, "x");
  Save(hostile, "r0", 1, 1);
  ASSERT_TRUE(table_->Reserve(hostile.session_id, hostile.token, 1, kMiB - 4096, false).ok());
  Save(hostile, "r1", 1, 1);  // a second chunk
  ASSERT_TRUE(table_->Reserve(hostile.session_id, hostile.token, 2, kMiB - 4096, false).ok());
  auto third = table_->CreateRegion(hostile.session_id, hostile.token, "r2", 1, milliseconds(0));
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("regions.max_bytes"), std::string::npos)
      << third.status().ToString();
  EXPECT_EQ(table_->Snapshot().region_bytes, 8192u);
  ASSERT_TRUE(table_->Close(hostile.session_id, CloseReason::kProcessExited).ok());
  SessionGrant victim = OpenAs(*table_, 1000, "train");
  EXPECT_TRUE(table_->Reserve(victim.session_id, victim.token, 1, 2 * kMiB, false).ok());
}

TEST_F(RegionsTest, AnOperatorDeletesAnyCommittedRegionButNotOneBeingWritten) {
  SessionGrant s = OpenAs(*table_, 1000, "train");
  Save(s, "done", 4096, 1);
  ASSERT_TRUE(table_->CreateRegion(s.session_id, s.token, "half", 4096, milliseconds(0)).ok());
  EXPECT_EQ(table_->DeleteRegionOf(1000, "train", "half").status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_->DeleteRegionOf(1001, "train", "done").status().code(), StatusCode::kNotFound);
  auto freed = table_->DeleteRegionOf(1000, "train", "done");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 4096u);
  auto all = table_->ListAllRegions("");
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].state, RegionState::kWriting);
}

TEST_F(RegionsTest, ARegionKeepsItsChunksWithItsTenantAfterEverySessionEnded) {
  SessionGrant s = OpenAs(*table_, 1000, "train");
  Save(s, "ckpt", kMiB, kMiB);  // a whole chunk
  ASSERT_TRUE(table_->Close(s.session_id, CloseReason::kProcessExited).ok());
  // Another uid takes every other chunk but never the region's.
  SessionGrant other = OpenAs(*table_, 2000, "x");
  EXPECT_TRUE(table_->Reserve(other.session_id, other.token, 1, 3 * kMiB, false).ok());
  EXPECT_EQ(table_->Reserve(other.session_id, other.token, 2, 4096, false).status().code(),
            StatusCode::kResourceExhausted);
  SessionGrant back = OpenAs(*table_, 1000, "train");
  auto chunks = table_->AttachChunks(back.session_id);
  ASSERT_TRUE(chunks.ok());
  auto o = table_->OpenRegion(back.session_id, back.token, "ckpt");
  ASSERT_TRUE(o.ok());
  bool handed = false;
  for (const ChunkGrant& g : *chunks) handed |= g.index == o->extents[0].chunk;
  EXPECT_TRUE(handed) << "the region's chunk is not handed to its tenant's new session";
}

TEST_F(RegionsTest, DrainingRefusesNewRegionsButServesCommittedOnes) {
  SessionGrant s = OpenAs(*table_, 1000, "train");
  Save(s, "ckpt", 4096, 1);
  ASSERT_TRUE(table_->SetDraining(true).ok());
  EXPECT_EQ(
      table_->CreateRegion(s.session_id, s.token, "new", 4096, milliseconds(0)).status().code(),
      StatusCode::kUnavailable);
  EXPECT_EQ(OpenCode(s, "ckpt"), StatusCode::kOk);
}

}  // namespace
}  // namespace memoffload::daemon
