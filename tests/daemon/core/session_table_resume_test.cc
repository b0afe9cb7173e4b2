// Sessions across a take-over, on the table's side: what the serving table
// hands on, placed back exactly in a new table, each session bound to its
// process until it resumes (uid and pid, then the token), closed when it
// does not come back in time, and refused when its record could not be ours.
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <thread>

#include "core/session_table.h"
#include "memoffload/common/units.h"
#include "test_arena.h"

namespace memoffload::daemon {
namespace {

using std::chrono::milliseconds;

PeerCredentials Peer(uid_t uid, pid_t pid) {
  PeerCredentials p;
  p.uid = uid;
  p.gid = uid;
  p.pid = pid;
  return p;
}

struct Handed {
  std::vector<RegionRecord> regions;
  std::vector<SessionRecord> sessions;
  std::vector<SessionTable::ChunkOwner> owners;
  SessionGrant alice;  // uid 1000, pid 1234: a committed, a read and a reserved group
  std::vector<Extent> committed;
  std::vector<Extent> gone;  // a deleted region it still reads
};

// A serving table with a session holding groups in every state, a region
// it writes and one it has open, frozen and handed on.
Handed Serve(Arena* arena) {
  Handed h;
  Policy policy;
  policy.region_max_bytes = 2 * kMiB;
  SessionTable table(arena, policy, TenantMode::kUid);
  h.alice = OpenAs(table, 1000, "job-a");
  const SessionGrant& a = h.alice;
  auto g1 = table.Reserve(a.session_id, a.token, 1, 256 * kKiB, false);
  EXPECT_TRUE(g1.ok());
  h.committed.assign(g1->extents.begin(), g1->extents.end());
  EXPECT_TRUE(table.Commit(a.session_id, a.token, 1, 200 * kKiB, {}).ok());
  EXPECT_TRUE(table.Reserve(a.session_id, a.token, 2, 64 * kKiB, true).ok());
  EXPECT_TRUE(table.Commit(a.session_id, a.token, 2, 64 * kKiB, {}).ok());
  EXPECT_TRUE(table.Prefetch(a.session_id, a.token, 2).ok());
  EXPECT_TRUE(table.Reserve(a.session_id, a.token, 3, 8 * kKiB, false).ok());
  EXPECT_TRUE(table.CreateRegion(a.session_id, a.token, "done", 4 * kKiB, milliseconds(0)).ok());
  EXPECT_TRUE(table.CommitRegion(a.session_id, a.token, "done", 4 * kKiB, {}).ok());
  EXPECT_TRUE(table.OpenRegion(a.session_id, a.token, "done").ok());
  EXPECT_TRUE(table.CreateRegion(a.session_id, a.token, "half", 8 * kKiB, milliseconds(0)).ok());
  // A region it reads that is deleted meanwhile: hidden, kept for it.
  EXPECT_TRUE(table.CreateRegion(a.session_id, a.token, "gone", 4 * kKiB, milliseconds(0)).ok());
  EXPECT_TRUE(table.CommitRegion(a.session_id, a.token, "gone", 4 * kKiB, {}).ok());
  auto gone = table.OpenRegion(a.session_id, a.token, "gone");
  EXPECT_TRUE(gone.ok());
  h.gone.assign(gone->extents.begin(), gone->extents.end());
  EXPECT_EQ(*table.DeleteRegion(a.session_id, a.token, "gone"), 0u);
  // A chunk of its tenant left empty (no group, no region): still its.
  EXPECT_TRUE(table.Reserve(a.session_id, a.token, 4, 900 * kKiB, true).ok());
  EXPECT_TRUE(table.Release(a.session_id, a.token, 4).ok());
  table.SetFrozen(true);
  // Frozen: every call is the take-over's pause, and changes nothing.
  Status st = table.Commit(a.session_id, a.token, 3, 8 * kKiB, {}).status();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find(kTakeoverPause), std::string::npos) << st.message();
  EXPECT_EQ(table.Release(a.session_id + 99, a.token, 3).status().code(),
            StatusCode::kUnavailable);  // not NOT_FOUND: its successor may hold it
  h.regions = table.CommittedRegions();
  h.sessions = table.SessionRecords();
  h.owners = table.ChunkOwners();
  EXPECT_TRUE(table.CheckInvariants().ok());
  return h;
}

// The new daemon's side: a table over an arena of the same layout (the old
// table's allocator keeps its extents) with the handed regions and chunk
// owners taken back, before the sessions.
struct NewDaemon {
  explicit NewDaemon(const Handed& h)
      : arena(MakeTestArena()), table(arena.get(), Policy{}, TenantMode::kUid) {
    regions = table.Recover(h.regions, &dropped).regions;
    table.AdoptChunkOwners(h.owners);
  }
  std::unique_ptr<Arena> arena;
  SessionTable table;
  uint32_t regions = 0;
  std::vector<std::string> dropped;  // by Recover
};

TEST(ResumeTest, AHandedSessionComesBackWholeAndOnlyItsProcessResumesIt) {
  auto arena = MakeTestArena();
  ASSERT_NE(arena, nullptr);
  Handed h = Serve(arena.get());
  ASSERT_EQ(h.sessions.size(), 1u);
  EXPECT_EQ(h.sessions[0].groups.size(), 3u);
  EXPECT_EQ(h.sessions[0].writing.size(), 1u);
  EXPECT_EQ(h.sessions[0].opened, std::vector<std::string>{"done"});
  ASSERT_EQ(h.sessions[0].deleted_open.size(), 1u);
  EXPECT_EQ(h.sessions[0].deleted_open[0].name, "gone");

  NewDaemon next(h);
  SessionTable& table = next.table;
  std::vector<std::string> dropped = next.dropped;
  EXPECT_EQ(next.regions, 1u);
  SessionTable::Adopted got = table.AdoptSessions(h.sessions, std::chrono::seconds(30), &dropped);
  EXPECT_TRUE(dropped.empty()) << dropped.front();
  EXPECT_EQ(got.sessions, 1u);
  EXPECT_EQ(got.groups, 3u);
  ASSERT_TRUE(table.CheckInvariants().ok()) << table.CheckInvariants().ToString();
  EXPECT_EQ(table.Snapshot().handed_waiting, 1u);
  const SessionGrant& a = h.alice;
  // Before its resume, another tenant takes none of its chunks (it maps
  // them), not even an empty one, and nothing lands on the deleted region
  // it reads.
  SessionGrant bob = OpenAs(table, 1001, "job-b");
  std::set<uint32_t> alices;
  for (const SessionTable::ChunkOwner& o : h.owners) alices.insert(o.chunk);
  EXPECT_GE(alices.size(), 2u);
  for (uint64_t g = 1; g < 64; ++g) {
    auto r = table.Reserve(bob.session_id, bob.token, g, 128 * kKiB, false);
    if (!r.ok()) break;
    for (const Extent& e : r->extents) EXPECT_EQ(alices.count(e.chunk), 0u) << e.chunk;
  }
  // Before its resume, the token alone does nothing.
  Status st = table.Prefetch(a.session_id, a.token, 1).status();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("resume"), std::string::npos) << st.message();
  Hello hello;
  milliseconds waited{0};
  // Another process of the uid, another uid, a wrong token: refused.
  EXPECT_EQ(table.Resume(a.session_id, a.token, Peer(1000, 999), &hello, &waited).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(table.Resume(a.session_id, a.token, Peer(1001, 1234), &hello, &waited).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(table.Resume(a.session_id, "nope", Peer(1000, 1234), &hello, &waited).status().code(),
            StatusCode::kUnauthenticated);
  EXPECT_EQ(
      table.Resume(a.session_id + 1, a.token, Peer(1000, 1234), &hello, &waited).status().code(),
      StatusCode::kNotFound);
  auto resumed = table.Resume(a.session_id, a.token, Peer(1000, 1234), &hello, &waited);
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_EQ(resumed->session_id, a.session_id);
  EXPECT_EQ(hello.job_id, "job-a");
  EXPECT_EQ(table.Snapshot().handed_waiting, 0u);
  EXPECT_EQ(table.Snapshot().handed_resumed, 1u);
  // Once.
  EXPECT_EQ(table.Resume(a.session_id, a.token, Peer(1000, 1234), &hello, &waited).status().code(),
            StatusCode::kNotFound);
  // Its groups as they were, in every state; its regions too.
  auto p = table.Prefetch(a.session_id, a.token, 1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->used_bytes, 200 * kKiB);
  ASSERT_EQ(p->extents.size(), h.committed.size());
  EXPECT_EQ(p->extents[0].offset, h.committed[0].offset);
  EXPECT_TRUE(table.Release(a.session_id, a.token, 2).ok());
  EXPECT_TRUE(table.Commit(a.session_id, a.token, 3, 8 * kKiB, {}).ok());
  EXPECT_TRUE(table.CommitRegion(a.session_id, a.token, "half", 8 * kKiB, {}).ok());
  EXPECT_TRUE(table.CloseRegion(a.session_id, a.token, "done").ok());
  // The deleted one it read: freed once it closes it.
  EXPECT_EQ(table.OpenRegion(a.session_id, a.token, "gone").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(table.Snapshot().regions, 3u);  // done, half, and gone (hidden)
  EXPECT_TRUE(table.CloseRegion(a.session_id, a.token, "gone").ok());
  EXPECT_EQ(table.Snapshot().regions, 2u);
  // New ids never collide with the handed one.
  SessionGrant b = OpenAs(table, 1000, "job-a");
  EXPECT_GT(b.session_id, a.session_id);
  ASSERT_TRUE(table.CheckInvariants().ok()) << table.CheckInvariants().ToString();
  ASSERT_TRUE(table.Close(a.session_id, CloseReason::kLifelineClosed).ok());
  ASSERT_TRUE(table.CheckInvariants().ok());
}

TEST(ResumeTest, ASessionNotResumedInTimeIsClosedAndItsSpaceFreed) {
  auto arena = MakeTestArena();
  ASSERT_NE(arena, nullptr);
  Handed h = Serve(arena.get());
  NewDaemon next(h);
  SessionTable& table = next.table;
  std::vector<std::string> dropped;
  ASSERT_EQ(table.AdoptSessions(h.sessions, milliseconds(20), &dropped).sessions, 1u);
  const uint64_t free_before = table.Snapshot().free_bytes;
  EXPECT_TRUE(table.CloseUnresumed(std::chrono::steady_clock::now()).empty());
  std::this_thread::sleep_for(milliseconds(30));
  Hello hello;
  milliseconds waited{0};
  // Past its time: no resume (it is being closed).
  EXPECT_EQ(table.Resume(h.alice.session_id, h.alice.token, Peer(1000, 1234), &hello, &waited)
                .status()
                .code(),
            StatusCode::kNotFound);
  std::vector<std::string> closed = table.CloseUnresumed(std::chrono::steady_clock::now());
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_NE(closed[0].find("was not resumed in time"), std::string::npos) << closed[0];
  EXPECT_GT(table.Snapshot().free_bytes, free_before);
  EXPECT_EQ(table.ListSessions().size(), 0u);
  EXPECT_EQ(table.Snapshot().handed_not_resumed, 1u);
  EXPECT_EQ(table.Snapshot().handed_waiting, 0u);
  EXPECT_EQ(table.CommittedRegions().size(), 1u);  // the committed region stays
  ASSERT_TRUE(table.CheckInvariants().ok()) << table.CheckInvariants().ToString();
}

TEST(ResumeTest, ARecordThatCannotBeOursIsDroppedWithWhy) {
  auto arena = MakeTestArena();
  ASSERT_NE(arena, nullptr);
  Handed h = Serve(arena.get());
  NewDaemon next(h);
  SessionTable& table = next.table;
  std::vector<std::string> dropped;
  SessionRecord overlap = h.sessions[0];  // its group over the committed region
  overlap.id = 50;
  overlap.writing.clear();
  overlap.deleted_open.clear();
  overlap.groups = {GroupRecord{1, 1, 4096, h.regions[0].extents, {}}};
  SessionRecord other_uid = h.sessions[0];  // in uid 1000's chunks
  other_uid.id = 51;
  other_uid.uid = 1001;
  other_uid.writing.clear();
  other_uid.deleted_open.clear();
  SessionRecord past = h.sessions[0];
  past.id = 52;
  past.writing.clear();
  past.deleted_open.clear();
  past.groups = {GroupRecord{1, 1, 4096, {Extent{99, 0, 4096}}, {}}};
  SessionRecord bad_state = past;
  bad_state.id = 53;
  bad_state.groups = {GroupRecord{1, 9, 0, {Extent{0, 0, 4096}}, {}}};
  SessionTable::Adopted got = table.AdoptSessions(
      {overlap, other_uid, past, bad_state, h.sessions[0]}, std::chrono::seconds(30), &dropped);
  EXPECT_EQ(got.sessions, 1u);
  EXPECT_EQ(table.Snapshot().handed_dropped, 4u);
  ASSERT_EQ(dropped.size(), 4u);
  EXPECT_NE(dropped[0].find("session 50"), std::string::npos) << dropped[0];
  EXPECT_NE(dropped[1].find("not its tenant's"), std::string::npos) << dropped[1];
  EXPECT_NE(dropped[2].find("past the arena"), std::string::npos) << dropped[2];
  EXPECT_NE(dropped[3].find("state is unknown"), std::string::npos) << dropped[3];
  ASSERT_TRUE(table.CheckInvariants().ok()) << table.CheckInvariants().ToString();
}

}  // namespace
}  // namespace memoffload::daemon
