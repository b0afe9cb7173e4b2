#include "core/session_table.h"

#include <gtest/gtest.h>

#include <set>

#include "memoffload/common/units.h"
#include "session_table_fixture.h"
#include "test_arena.h"

namespace memoffload::daemon {
namespace {

TEST_F(SessionTableTest, FullGroupLifecycle) {
  SessionGrant s = Open();
  auto r = table_->Reserve(s.session_id, s.token, 7, 100000, false);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->reserved_bytes, 102400u);  // page-rounded
  EXPECT_EQ(table_->Snapshot().reserved_bytes, 102400u);

  auto c = table_->Commit(s.session_id, s.token, 7, 5000);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->committed_bytes, 8192u);
  EXPECT_EQ(c->returned_bytes, 102400u - 8192u);
  EXPECT_EQ(table_->Snapshot().committed_bytes, 8192u);
  EXPECT_TRUE(table_->CheckInvariants().ok());

  auto p = table_->Prefetch(s.session_id, s.token, 7);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->used_bytes, 5000u);
  EXPECT_EQ(table_->Snapshot().read_bytes, 8192u);
  // Prefetch twice (retain_graph: a second backward reads again) is fine.
  ASSERT_TRUE(table_->Prefetch(s.session_id, s.token, 7).ok());

  auto rel = table_->Release(s.session_id, s.token, 7);
  ASSERT_TRUE(rel.ok());
  EXPECT_EQ(rel->released_bytes, 8192u);
  EXPECT_EQ(table_->Snapshot().free_bytes, 4 * kMiB);
}

TEST_F(SessionTableTest, ListSessionsInTheOrderTheyOpened) {
  std::vector<uint64_t> opened;
  for (int i = 0; i < 40; ++i) opened.push_back(Open(0, "job" + std::to_string(i % 3)).session_id);
  // Some go, so the map's own order is not the opening order either way.
  for (size_t i = 0; i < opened.size(); i += 7)
    ASSERT_TRUE(table_->Close(opened[i], CloseReason::kProcessExited).ok());
  std::vector<uint64_t> listed;
  for (const SessionSnapshot& s : table_->ListSessions()) listed.push_back(s.session_id);
  std::vector<uint64_t> open;
  for (size_t i = 0; i < opened.size(); ++i) {
    if (i % 7 != 0) open.push_back(opened[i]);
  }
  EXPECT_TRUE(std::is_sorted(opened.begin(), opened.end()));
  EXPECT_EQ(listed, open);
}

TEST_F(SessionTableTest, TokensAreRandomAndChecked) {
  SessionGrant a = Open();
  SessionGrant b = Open();
  EXPECT_NE(a.token, b.token);
  EXPECT_EQ(a.token.size(), 32u);  // 128 bits in hex
  std::string wrong = a.token;
  wrong[31] = wrong[31] == '0' ? '1' : '0';
  EXPECT_EQ(table_->Reserve(a.session_id, wrong, 1, 4096, false).status().code(),
            StatusCode::kUnauthenticated);
  EXPECT_EQ(table_->Reserve(a.session_id, b.token, 1, 4096, false).status().code(),
            StatusCode::kUnauthenticated);
  EXPECT_EQ(table_->Reserve(999, a.token, 1, 4096, false).status().code(), StatusCode::kNotFound);
}

TEST_F(SessionTableTest, SessionsCannotSeeEachOthersGroups) {
  SessionGrant a = Open();
  SessionGrant b = Open();
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 4096, false).ok());
  ASSERT_TRUE(table_->Commit(a.session_id, a.token, 1, 4096).ok());
  EXPECT_EQ(table_->Prefetch(b.session_id, b.token, 1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(table_->Release(b.session_id, b.token, 1).status().code(), StatusCode::kNotFound);
  // b may use the same group id for its own group.
  EXPECT_TRUE(table_->Reserve(b.session_id, b.token, 1, 4096, false).ok());
}

TEST_F(SessionTableTest, StateMachineErrors) {
  SessionGrant s = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 4096, false).ok());
  EXPECT_EQ(table_->Reserve(s.session_id, s.token, 1, 4096, false).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_->Prefetch(s.session_id, s.token, 1).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_->Commit(s.session_id, s.token, 1, 8192).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(table_->Commit(s.session_id, s.token, 1, 4096).ok());
  EXPECT_EQ(table_->Commit(s.session_id, s.token, 1, 4096).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_->Commit(s.session_id, s.token, 2, 1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(table_->Reserve(s.session_id, s.token, 3, 0, false).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(SessionTableTest, CapacityAndSessionLimitMessagesNameSizes) {
  SessionGrant s = Open();
  auto big = table_->Reserve(s.session_id, s.token, 1, 5 * kMiB, false);
  ASSERT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("larger than the whole usable arena"), std::string::npos);
  EXPECT_NE(big.status().message().find("5.00 MiB"), std::string::npos);

  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 2, 3 * kMiB, false).ok());
  auto full = table_->Reserve(s.session_id, s.token, 3, 2 * kMiB, false);
  ASSERT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("arena full"), std::string::npos)
      << full.status().message();

  SessionGrant limited = Open(kMiB);
  EXPECT_EQ(limited.limit_bytes, kMiB);
  auto over = table_->Reserve(limited.session_id, limited.token, 1, kMiB + 1, false);
  ASSERT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("session limit"), std::string::npos)
      << over.status().message();
}

TEST_F(SessionTableTest, CloseReclaimsEverythingInEveryState) {
  SessionGrant s = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, kMiB, false).ok());
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 2, kMiB, false).ok());
  ASSERT_TRUE(table_->Commit(s.session_id, s.token, 2, kMiB).ok());
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 3, kMiB, false).ok());
  ASSERT_TRUE(table_->Commit(s.session_id, s.token, 3, kMiB).ok());
  ASSERT_TRUE(table_->Prefetch(s.session_id, s.token, 3).ok());
  auto reclaimed = table_->Close(s.session_id, CloseReason::kLifelineClosed);
  ASSERT_TRUE(reclaimed.ok());
  EXPECT_EQ(reclaimed->group_bytes, 3 * kMiB);
  EXPECT_EQ(reclaimed->regions, 0u);
  ArenaSnapshot snap = table_->Snapshot();
  EXPECT_EQ(snap.free_bytes, 4 * kMiB);
  EXPECT_EQ(snap.sessions, 0u);
  EXPECT_EQ(snap.groups, 0u);
  EXPECT_EQ(table_->Close(s.session_id, CloseReason::kLifelineClosed).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(table_->Reserve(s.session_id, s.token, 1, 1, false).status().code(),
            StatusCode::kNotFound);
}

TEST_F(SessionTableTest, GroupsSpanChunksWhenNeeded) {
  SessionGrant s = Open();
  auto r = table_->Reserve(s.session_id, s.token, 1, 3 * kMiB + 4096, false);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::set<uint32_t> chunks;
  for (const Extent& e : r->extents) chunks.insert(e.chunk);
  EXPECT_GE(chunks.size(), 4u);
  EXPECT_EQ(table_->Reserve(s.session_id, s.token, 2, 2 * kMiB, true).status().code(),
            StatusCode::kResourceExhausted);
}

TEST_F(SessionTableTest, JobLimitSpansSessionsAndTheSmallestAskWins) {
  Policy policy;
  policy.job_max_bytes = 3 * kMiB;
  table_->SetPolicy(policy);
  SessionGrant a = Open(0, "train");
  SessionGrant b = Open(0, "train", 2 * kMiB);  // the job asks for less
  SessionGrant other = Open(0, "eval");
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, kMiB, false).ok());
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, kMiB, false).ok());
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(a.session_id, a.token, 2, 4096, false, std::nullopt, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kJobLimit);
  EXPECT_NE(r.status().message().find("job limit: job 'train' holds 2.00 MiB of its 2.00 MiB"),
            std::string::npos)
      << r.status().message();
  // Another job is not affected.
  EXPECT_TRUE(table_->Reserve(other.session_id, other.token, 1, kMiB, false).ok());
  // Releasing frees job budget.
  ASSERT_TRUE(table_->Release(b.session_id, b.token, 1).ok());
  EXPECT_TRUE(table_->Reserve(a.session_id, a.token, 2, 4096, false).ok());
}

// A uid names as many job ids as it likes: quotas.uid_max_bytes bounds all
// its sessions together. A waiter it holds back waits without blocking
// others and is served when the uid's other session gives bytes back.
TEST_F(SessionTableTest, UidLimitSpansEveryJobOfTheUidAndAWaiterItHoldsIsServedOnRelease) {
  Policy policy;
  policy.uid_max_bytes = 2 * kMiB;
  table_->SetPolicy(policy);
  SessionGrant a = Open(0, "a");
  SessionGrant b = Open(0, "b");
  SessionGrant other = Open(0, "a", 0, 1001);
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, kMiB, false).ok());
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, kMiB, false).ok());
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(b.session_id, b.token, 2, 4096, false, std::nullopt, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kUidLimit);
  EXPECT_NE(r.status().message().find("uid 1000 hold 2.00 MiB of its 2.00 MiB"), std::string::npos)
      << r.status().message();
  // Another uid is not held back.
  EXPECT_TRUE(table_->Reserve(other.session_id, other.token, 1, kMiB, false).ok());
  // A commit's unused tail comes back to the uid.
  ASSERT_TRUE(table_->Commit(a.session_id, a.token, 1, 4096).ok());
  EXPECT_TRUE(table_->Reserve(b.session_id, b.token, 2, 4096, false).ok());
  // A waiter held by the uid's limit (1 MiB + 8 KiB held) is answered when
  // the other job releases its 4 KiB.
  std::optional<Result<ReserveResult>> answer;
  table_->ReserveAsync(
      b.session_id, b.token, 3, kMiB - 4096, false,
      std::chrono::steady_clock::now() + std::chrono::seconds(60),
      [&](Result<ReserveResult>&& result, RejectReason) { answer.emplace(std::move(result)); });
  EXPECT_FALSE(answer.has_value());
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 1u);
  ASSERT_TRUE(table_->Release(a.session_id, a.token, 1).ok());
  ASSERT_TRUE(answer.has_value());
  EXPECT_TRUE(answer->ok()) << answer->status().ToString();
  // A closed session gives its bytes back too.
  ASSERT_TRUE(table_->Close(b.session_id, CloseReason::kProcessExited).ok());
  EXPECT_TRUE(table_->Reserve(a.session_id, a.token, 4, 2 * kMiB, false).ok());
}

TEST_F(SessionTableTest, NodeReserveIsNeverHandedOut) {
  Policy policy;
  policy.node_reserve_bytes = kMiB;
  table_->SetPolicy(policy);
  SessionGrant s = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 3 * kMiB, false).ok());
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(s.session_id, s.token, 2, 4096, false, std::nullopt, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kArenaFull);
  EXPECT_NE(r.status().message().find("node reserve 1.00 MiB"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(table_->Snapshot().free_bytes, kMiB);
  auto too_large =
      table_->Reserve(s.session_id, s.token, 3, 4 * kMiB, false, std::nullopt, &reason);
  EXPECT_EQ(reason, RejectReason::kTooLarge);
}

TEST_F(SessionTableTest, DrainRefusesNewWorkButLetsGroupsFinish) {
  SessionGrant s = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, kMiB, false).ok());
  EXPECT_TRUE(table_->SetDraining(true).ok());
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(s.session_id, s.token, 2, 4096, false, std::nullopt, &reason);
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(reason, RejectReason::kDraining);
  Hello hello;
  EXPECT_EQ(table_->Open(hello, {}).status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(table_->Commit(s.session_id, s.token, 1, kMiB).ok());
  EXPECT_TRUE(table_->Prefetch(s.session_id, s.token, 1).ok());
  EXPECT_TRUE(table_->Release(s.session_id, s.token, 1).ok());
  EXPECT_TRUE(table_->SetDraining(false).ok());
  EXPECT_TRUE(table_->Reserve(s.session_id, s.token, 2, 4096, false).ok());
}

TEST_F(SessionTableTest, NodeReserveAboveTheArenaLeavesNothingInsteadOfWrapping) {
  // A reserve larger than the running arena (a reload validated against
  // another arena size) must not wrap capacity - reserve around.
  Policy policy;
  policy.node_reserve_bytes = 8 * kMiB;
  table_->SetPolicy(policy);
  SessionGrant s = Open();
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(s.session_id, s.token, 1, 4096, false, std::nullopt, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  EXPECT_EQ(reason, RejectReason::kTooLarge);
  EXPECT_NE(r.status().message().find("usable arena (0 B of 4.00 MiB; node reserve 8.00 MiB)"),
            std::string::npos)
      << r.status().message();
  EXPECT_EQ(table_->Snapshot().free_bytes, 4 * kMiB);
}

TEST_F(SessionTableTest, RequestsThatCanNeverFitFailAtOnceEvenWhenWaiting) {
  Policy policy;
  policy.job_max_bytes = 2 * kMiB;
  table_->SetPolicy(policy);
  SessionGrant s = Open(kMiB);
  SessionGrant t = Open();
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::seconds(5);
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(s.session_id, s.token, 1, 2 * kMiB, false, deadline, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kSessionLimit);
  EXPECT_NE(
      r.status().message().find(
          "session limit: 2.00 MiB is more than the whole of its 1.00 MiB limit (by 1.00 MiB)"),
      std::string::npos)
      << r.status().message();
  r = table_->Reserve(t.session_id, t.token, 1, 3 * kMiB, false, deadline, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kJobLimit);
  EXPECT_NE(
      r.status().message().find(
          "job limit: 3.00 MiB is more than the whole 2.00 MiB limit of job 'job' (by 1.00 MiB)"),
      std::string::npos)
      << r.status().message();
  // One extent never spans the arena's 1 MiB chunks (it said "arena full").
  r = table_->Reserve(t.session_id, t.token, 1, kMiB + 1, true, deadline, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kTooLarge);
  EXPECT_NE(r.status().message().find("single-extent group of 1.00 MiB is larger than a chunk"),
            std::string::npos)
      << r.status().message();
  EXPECT_TRUE(table_->Reserve(t.session_id, t.token, 1, kMiB, true).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 0u);
}

TEST_F(SessionTableTest, ShutdownDrainRefusesUndrainAndSaysShuttingDown) {
  SessionGrant s = Open();
  table_->BeginShutdown();
  Status undrain = table_->SetDraining(false);
  EXPECT_EQ(undrain.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(undrain.message().find("shutting down"), std::string::npos) << undrain.message();
  EXPECT_TRUE(table_->draining());
  EXPECT_TRUE(table_->Snapshot().shutting_down);
  Hello hello;
  Status open = table_->Open(hello, {}).status();
  EXPECT_EQ(open.code(), StatusCode::kUnavailable);
  EXPECT_NE(open.message().find("shutting down"), std::string::npos) << open.message();
  EXPECT_EQ(open.message().find("undrain"), std::string::npos) << open.message();
  Status reserve = table_->Reserve(s.session_id, s.token, 1, 4096, false).status();
  EXPECT_EQ(reserve.code(), StatusCode::kUnavailable);
  EXPECT_NE(reserve.message().find("shutting down"), std::string::npos) << reserve.message();
  EXPECT_EQ(reserve.message().find("undrain"), std::string::npos) << reserve.message();
}

TEST_F(SessionTableTest, JobsOfDifferentUidsWithTheSameIdAreSeparate) {
  Policy policy;
  policy.job_max_bytes = 2 * kMiB;
  table_->SetPolicy(policy);
  SessionGrant mine = Open(0, "train", 0, 1000);
  // Another user names the same job id and asks for a tiny job limit.
  SessionGrant theirs = Open(0, "train", 4096, 2000);
  EXPECT_TRUE(table_->Reserve(mine.session_id, mine.token, 1, 2 * kMiB, false).ok());
  // Their 4 KiB ask does not lower my job's limit, and my bytes do not use
  // their job's quota.
  EXPECT_TRUE(table_->Reserve(theirs.session_id, theirs.token, 1, 4096, false).ok());
  auto over = table_->Reserve(theirs.session_id, theirs.token, 2, 4096, false);
  ASSERT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("job limit: job 'train' holds 4.00 KiB of its 4.00 KiB"),
            std::string::npos)
      << over.status().message();
  EXPECT_NE(over.status().message().find("(uid 2000)"), std::string::npos)
      << over.status().message();
  ASSERT_TRUE(table_->Release(mine.session_id, mine.token, 1).ok());
  EXPECT_TRUE(table_->Reserve(mine.session_id, mine.token, 1, 2 * kMiB, false).ok());
}

TEST_F(SessionTableTest, JobTenantsIncludeTheUid) {
  table_ = std::make_unique<SessionTable>(arena_.get(), Policy{}, TenantMode::kJob);
  SessionGrant mine = Open(0, "train", 0, 1000);
  SessionGrant mate = Open(0, "train", 0, 1000);
  SessionGrant theirs = Open(0, "train", 0, 2000);
  auto r = table_->Reserve(mine.session_id, mine.token, 1, 4096, false);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const uint32_t chunk = r->extents[0].chunk;
  // Same uid, same job: shares the chunk.
  EXPECT_TRUE(table_->GrantChunks(mate.session_id, {chunk}).ok());
  // Another uid naming the same job id does not get its fd.
  auto attach = table_->AttachChunks(theirs.session_id);
  ASSERT_TRUE(attach.ok());
  EXPECT_EQ(std::count_if(attach->begin(), attach->end(),
                          [&](const ChunkGrant& g) { return g.index == chunk; }),
            0);
  EXPECT_EQ(table_->GrantChunks(theirs.session_id, {chunk}).status().code(),
            StatusCode::kPermissionDenied);
  auto other = table_->Reserve(theirs.session_id, theirs.token, 1, 4096, false);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->extents[0].chunk, chunk);
}

TEST(ConstantTimeEquals, Basics) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  // Tokens are compared eight bytes at a time, then the tail: a difference
  // anywhere counts.
  const std::string token = "0123456789abcdef0123456789abcdef1";
  EXPECT_TRUE(ConstantTimeEquals(token, token));
  for (size_t i = 0; i < token.size(); ++i) {
    std::string other = token;
    other[i] ^= 1;
    EXPECT_FALSE(ConstantTimeEquals(token, other)) << "byte " << i;
  }
}

// Placed state (SessionKind::kState) of a job holds at most
// quotas.state_share of the job's limit, here half the 4 MiB arena; the
// job's activations are not counted against it, and its blocks are not
// counted as groups.
TEST_F(SessionTableTest, AJobsStateHoldsItsShareAndItsBlocksAreNotGroups) {
  auto open = [&](SessionKind kind) {
    Hello hello;
    hello.job_id = "train";
    hello.kind = kind;
    auto g = table_->Open(hello, PeerCredentials{1234, 1000, 1000});
    EXPECT_TRUE(g.ok());
    return *g;
  };
  const SessionGrant state = open(SessionKind::kState);
  const SessionGrant more_state = open(SessionKind::kState);
  const SessionGrant act = open(SessionKind::kActivations);
  ASSERT_TRUE(table_->Reserve(state.session_id, state.token, 1, kMiB, true).ok());
  ASSERT_TRUE(table_->Commit(state.session_id, state.token, 1, kMiB).ok());
  ASSERT_TRUE(table_->Reserve(more_state.session_id, more_state.token, 1, kMiB, true).ok());
  RejectReason reject = RejectReason::kNone;
  auto r = table_->Reserve(state.session_id, state.token, 2, 4096, true, std::nullopt, &reject);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reject, RejectReason::kStateShare);
  EXPECT_NE(r.status().message().find("holds 2.00 MiB of its 2.00 MiB share (quotas.state_share"),
            std::string::npos)
      << r.status().message();
  // What is left of the arena is the activations'.
  ASSERT_TRUE(table_->Reserve(act.session_id, act.token, 1, 2 * kMiB, false).ok());

  const ArenaSnapshot snap = table_->Snapshot();
  EXPECT_EQ(snap.groups, 1u);
  EXPECT_EQ(snap.state_blocks, 2u);
  EXPECT_EQ(snap.state_bytes, 2 * kMiB);
  EXPECT_EQ(snap.sessions_by_kind[static_cast<size_t>(SessionKind::kState)], 2u);
  EXPECT_EQ(snap.sessions_by_kind[static_cast<size_t>(SessionKind::kActivations)], 1u);
  EXPECT_EQ(snap.held_by_kind[static_cast<size_t>(SessionKind::kActivations)], 2 * kMiB);
  const auto sessions = table_->ListSessions();
  ASSERT_EQ(sessions.size(), 3u);
  EXPECT_EQ(sessions[0].kind, SessionKind::kState);
  EXPECT_EQ(sessions[0].blocks, 1u);
  EXPECT_EQ(sessions[0].groups, 0u);
  EXPECT_EQ(sessions[2].kind, SessionKind::kActivations);
  EXPECT_EQ(sessions[2].groups, 1u);
  EXPECT_EQ(sessions[2].blocks, 0u);

  // A released block makes room in the share again; a larger share (SIGHUP)
  // lets state take what the activations left.
  ASSERT_TRUE(table_->Release(act.session_id, act.token, 1).ok());
  EXPECT_EQ(table_->Reserve(state.session_id, state.token, 2, kMiB, true).status().code(),
            StatusCode::kResourceExhausted);
  Policy all;
  all.state_share = 1;
  table_->SetPolicy(all);
  EXPECT_TRUE(table_->Reserve(state.session_id, state.token, 2, kMiB, true).ok());
  ASSERT_TRUE(table_->Close(more_state.session_id, CloseReason::kLifelineClosed).ok());
  EXPECT_EQ(table_->Snapshot().state_bytes, 2 * kMiB);
  EXPECT_EQ(table_->Snapshot().sessions_by_kind[static_cast<size_t>(SessionKind::kState)], 1u);
}

}  // namespace
}  // namespace memoffload::daemon
