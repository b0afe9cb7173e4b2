// SessionTable's Reserve path across tenants, and the limits on one Reserve
// (extents) and one session (groups). The queue's ordering rules themselves
// are in reserve_queue_test.cc.
#include <gtest/gtest.h>

#include <optional>
#include <thread>

#include "core/session_table.h"
#include "memoffload/common/units.h"
#include "test_arena.h"

namespace memoffload::daemon {
namespace {

using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

class ReserveFairness : public ::testing::Test {
 protected:
  // A 4 MiB arena of four 1 MiB chunks.
  void Make(const Policy& policy, TenantMode mode = TenantMode::kUid) {
    arena_ = MakeTestArena();
    ASSERT_NE(arena_, nullptr);
    table_ = std::make_unique<SessionTable>(arena_.get(), policy, mode);
  }
  void TearDown() override {
    if (table_) {
      EXPECT_TRUE(table_->CheckInvariants().ok());
    }
  }
  SessionGrant Open(uid_t uid, const std::string& job = "job") { return OpenAs(*table_, uid, job); }

  // Queues a waiting reserve that answers into *answer.
  uint64_t Wait(const SessionGrant& s, uint64_t group, uint64_t bytes,
                std::optional<Result<ReserveResult>>* answer, RejectReason* reason = nullptr) {
    return table_->ReserveAsync(s.session_id, s.token, group, bytes, false,
                                Clock::now() + seconds(60),
                                [answer, reason](Result<ReserveResult> r, RejectReason why) {
                                  *answer = std::move(r);
                                  if (reason != nullptr) *reason = why;
                                });
  }

  // Answers of waiters, declared before table_ so that they outlive it (the
  // table answers its remaining waiters when it is destroyed).
  std::optional<Result<ReserveResult>> answer_;
  std::optional<Result<ReserveResult>> other_answer_;
  RejectReason reason_ = RejectReason::kNone;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<SessionTable> table_;
};

// Issue 13 item 4: one tenant's waiter that cannot fit made every other
// tenant's plain Reserve fail ("behind 1 earlier waiting reserve"). Written
// with the blocking API and a thread, so that it runs on the old code too.
TEST_F(ReserveFairness, AnotherTenantsWaiterDoesNotRefuseAPlainReserveThatFits) {
  Make(Policy{});
  SessionGrant a = Open(1000);
  SessionGrant b = Open(1001);
  // b owns one chunk, a the other three (chunks are not shared by tenants).
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 9, 4096, false).ok());
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 3 * kMiB, false).ok());
  std::thread waiter([&] {
    // 2 MiB cannot fit until a releases: it waits until its session closes.
    auto r = table_->Reserve(a.session_id, a.token, 2, 2 * kMiB, false, Clock::now() + seconds(30));
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
  });
  while (table_->Snapshot().waiting_reserves < 1) std::this_thread::yield();
  RejectReason reason = RejectReason::kNone;
  auto fits = table_->Reserve(b.session_id, b.token, 1, 512 * kKiB, false, std::nullopt, &reason);
  EXPECT_TRUE(fits.ok()) << fits.status().ToString();
  EXPECT_EQ(reason, RejectReason::kNone);
  // A waiting reserve of b that fits is placed at once too.
  auto waits = table_->Reserve(b.session_id, b.token, 2, 256 * kKiB, false,
                               Clock::now() + seconds(30), &reason);
  EXPECT_TRUE(waits.ok()) << waits.status().ToString();
  ASSERT_TRUE(table_->Close(a.session_id, CloseReason::kLifelineClosed).ok());
  waiter.join();
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 0u);
}

TEST_F(ReserveFairness, AnotherTenantsFittingWaiterIsServedBeforeALargeOne) {
  Policy policy;
  Make(policy, TenantMode::kNone);
  SessionGrant a = Open(1000);
  SessionGrant b = Open(1001);
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 2 * kMiB, false).ok());
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, 2 * kMiB, false).ok());
  std::optional<Result<ReserveResult>> big, small;
  ASSERT_NE(Wait(a, 2, 3 * kMiB, &big), 0u);
  ASSERT_NE(Wait(b, 2, kMiB, &small), 0u);
  // 2 MiB come back: b's 1 MiB fits, a's 3 MiB does not yet.
  ASSERT_TRUE(table_->Release(b.session_id, b.token, 1).ok());
  ASSERT_TRUE(small.has_value());
  EXPECT_TRUE(small->ok()) << small->status().ToString();
  EXPECT_FALSE(big.has_value());
  ASSERT_TRUE(table_->Release(a.session_id, a.token, 1).ok());
  ASSERT_TRUE(big.has_value());
  EXPECT_TRUE(big->ok()) << big->status().ToString();
}

TEST_F(ReserveFairness, AnAgedWaitersBytesAreKeptFreeFromOtherTenants) {
  Policy policy;
  policy.reserve_aging_ms = 0;  // every waiter is aged at once
  Make(policy, TenantMode::kNone);
  SessionGrant a = Open(1000);
  SessionGrant b = Open(1001);
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, 2 * kMiB, false).ok());
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, kMiB, false).ok());
  std::optional<Result<ReserveResult>> big;
  ASSERT_NE(Wait(a, 2, 2 * kMiB, &big), 0u);
  // 1 MiB is free, but it is kept for a's aged 2 MiB waiter.
  RejectReason reason = RejectReason::kNone;
  auto refused = table_->Reserve(b.session_id, b.token, 2, kMiB, false, std::nullopt, &reason);
  ASSERT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kArenaFull);
  EXPECT_NE(refused.status().message().find("2.00 MiB kept free for an older waiting reserve of "
                                            "another tenant"),
            std::string::npos)
      << refused.status().message();
  EXPECT_NE(refused.status().message().find("short by 2.00 MiB"), std::string::npos)
      << refused.status().message();
  ASSERT_TRUE(table_->Release(b.session_id, b.token, 1).ok());
  ASSERT_TRUE(big.has_value());
  EXPECT_TRUE(big->ok()) << big->status().ToString();
}

// With tenant chunks, bytes in a tenant's own chunk are no use to another
// tenant: an aged waiter does not hold them back.
TEST_F(ReserveFairness, AnAgedWaiterDoesNotHoldBackAnotherTenantsOwnChunk) {
  Policy policy;
  policy.reserve_aging_ms = 0;
  Make(policy, TenantMode::kUid);
  SessionGrant a = Open(1000);
  SessionGrant b = Open(1001);
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, 4096, false).ok());
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 2 * kMiB, false).ok());
  std::optional<Result<ReserveResult>> big;
  ASSERT_NE(Wait(a, 2, 2 * kMiB, &big), 0u);
  auto fits = table_->Reserve(b.session_id, b.token, 2, 512 * kKiB, false);
  EXPECT_TRUE(fits.ok()) << fits.status().ToString();
  ASSERT_TRUE(table_->Close(a.session_id, CloseReason::kLifelineClosed).ok());
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(big->status().code(), StatusCode::kNotFound);
}

TEST_F(ReserveFairness, WaitersAreBoundedAndTheRefusalNamesTheBound) {
  Policy policy;
  policy.max_waiting_reserves = 3;
  policy.max_waiting_reserves_per_tenant = 2;
  Make(policy, TenantMode::kNone);
  SessionGrant a = Open(1000);
  SessionGrant b = Open(1001);
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 4 * kMiB, false).ok());
  std::optional<Result<ReserveResult>> answers[5];
  RejectReason reason = RejectReason::kNone;
  ASSERT_NE(Wait(a, 10, kMiB, &answers[0]), 0u);
  ASSERT_NE(Wait(a, 11, kMiB, &answers[1]), 0u);
  EXPECT_EQ(Wait(a, 12, kMiB, &answers[2], &reason), 0u);
  ASSERT_TRUE(answers[2].has_value());
  EXPECT_EQ(answers[2]->status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kTooManyWaiters);
  EXPECT_NE(answers[2]->status().message().find("quotas.max_waiting_reserves_per_tenant is 2"),
            std::string::npos)
      << answers[2]->status().message();
  ASSERT_NE(Wait(b, 10, kMiB, &answers[3]), 0u);
  EXPECT_EQ(Wait(b, 11, kMiB, &answers[4]), 0u);
  ASSERT_TRUE(answers[4].has_value());
  EXPECT_NE(answers[4]->status().message().find("quotas.max_waiting_reserves is 3"),
            std::string::npos)
      << answers[4]->status().message();
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 3u);
  ASSERT_TRUE(table_->SetDraining(true).ok());  // answers every waiter
  for (int i : {0, 1, 3}) {
    ASSERT_TRUE(answers[i].has_value());
    EXPECT_EQ(answers[i]->status().code(), StatusCode::kUnavailable);
  }
}

// The gRPC edge passes ServerContext::IsCancelled as the probe.
TEST_F(ReserveFairness, AWaiterWhoseCallerWentAwayIsNeverGrantedAndFreesItsSlot) {
  Policy policy;
  policy.max_waiting_reserves = 1;
  Make(policy, TenantMode::kNone);
  SessionGrant a = Open(1000);
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 4 * kMiB, false).ok());
  bool gone = false;
  std::optional<Result<ReserveResult>> first, second;
  RejectReason reason = RejectReason::kNone;
  auto remember = [](std::optional<Result<ReserveResult>>* answer, RejectReason* why) {
    return [answer, why](Result<ReserveResult> r, RejectReason w) {
      *answer = std::move(r);
      if (why != nullptr) *why = w;
    };
  };
  ASSERT_NE(table_->ReserveAsync(a.session_id, a.token, 2, kMiB, false, Clock::now() + seconds(60),
                                 remember(&first, &reason), [&gone] { return gone; }),
            0u);
  gone = true;
  // The queue is full, but the one waiter's caller is gone: it makes room.
  ASSERT_NE(table_->ReserveAsync(a.session_id, a.token, 3, kMiB, false, Clock::now() + seconds(60),
                                 remember(&second, nullptr)),
            0u);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->status().code(), StatusCode::kCancelled);
  EXPECT_EQ(reason, RejectReason::kCancelled);
  ASSERT_TRUE(table_->Release(a.session_id, a.token, 1).ok());
  ASSERT_TRUE(second.has_value());
  EXPECT_TRUE(second->ok()) << second->status().ToString();
  EXPECT_EQ(table_->Release(a.session_id, a.token, 2).status().code(), StatusCode::kNotFound);
}

TEST_F(ReserveFairness, AWaiterIsAnsweredAtItsDeadlineWithTheShortfall) {
  Make(Policy{}, TenantMode::kNone);
  SessionGrant a = Open(1000);
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 3 * kMiB, false).ok());
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(a.session_id, a.token, 2, 2 * kMiB, false,
                           Clock::now() + std::chrono::milliseconds(100), &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kWaitTimeout);
  EXPECT_NE(r.status().message().find("until the deadline"), std::string::npos);
  EXPECT_NE(r.status().message().find("short by 1.00 MiB"), std::string::npos)
      << r.status().message();
}

// Issue 13 item 5: a fragmented arena returned 31,672 extents in one reply.
TEST_F(ReserveFairness, AReserveOverTheExtentLimitFailsAndReservesNothing) {
  Policy policy;
  policy.max_extents_per_reserve = 2;
  Make(policy, TenantMode::kNone);
  SessionGrant a = Open(1000);
  for (uint64_t g = 1; g <= 8; ++g) {
    ASSERT_TRUE(table_->Reserve(a.session_id, a.token, g, 512 * kKiB, false).ok());
  }
  for (uint64_t g = 1; g <= 8; g += 2) ASSERT_TRUE(table_->Release(a.session_id, a.token, g).ok());
  // Four separate 512 KiB holes.
  const ArenaSnapshot before = table_->Snapshot();
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(a.session_id, a.token, 20, 2 * kMiB, false, std::nullopt, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kTooFragmented);
  EXPECT_NE(r.status().message().find("would take 4 extents, more than "
                                      "quotas.max_extents_per_reserve (2)"),
            std::string::npos)
      << r.status().message();
  const ArenaSnapshot after = table_->Snapshot();
  EXPECT_EQ(after.free_bytes, before.free_bytes);
  EXPECT_EQ(after.groups, before.groups);
  EXPECT_EQ(table_->Release(a.session_id, a.token, 20).status().code(), StatusCode::kNotFound);
  auto two = table_->Reserve(a.session_id, a.token, 21, kMiB, false);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ(two->extents.size(), 2u);
}

TEST_F(ReserveFairness, GroupsPerSessionAreBounded) {
  Policy policy;
  policy.max_groups_per_session = 2;
  Make(policy, TenantMode::kNone);
  SessionGrant a = Open(1000);
  SessionGrant other = Open(1000);
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 4096, false).ok());
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 2, 4096, false).ok());
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(a.session_id, a.token, 3, 4096, false, std::nullopt, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kGroupLimit);
  EXPECT_NE(r.status().message().find("quotas.max_groups_per_session is 2"), std::string::npos)
      << r.status().message();
  EXPECT_TRUE(table_->Reserve(other.session_id, other.token, 1, 4096, false).ok());
  // A waiter held by the group limit is placed once a group is released.
  std::optional<Result<ReserveResult>> third;
  ASSERT_NE(Wait(a, 3, 4096, &third), 0u);
  ASSERT_TRUE(table_->Release(a.session_id, a.token, 1).ok());
  ASSERT_TRUE(third.has_value());
  EXPECT_TRUE(third->ok()) << third->status().ToString();
}

// A waiter that a limit lowered while it waited can never fit any more: it is
// answered at once, naming the limit, not at its deadline (60 s here). No
// thread and no sleep: each answer is given inside the call that changed the
// limit.
TEST_F(ReserveFairness, AWaiterALoweredSessionLimitCanNeverFitIsAnsweredAtOnce) {
  Policy policy;
  Make(policy, TenantMode::kNone);
  SessionGrant a = Open(1000);
  SessionGrant b = Open(1001);
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, 3 * kMiB, false).ok());
  ASSERT_NE(Wait(a, 1, 2 * kMiB, &answer_, &reason_), 0u);  // waits: 1 MiB free
  ASSERT_FALSE(answer_.has_value());
  policy.session_max_bytes = kMiB;  // SIGHUP: a session may hold 1 MiB at most
  table_->SetPolicy(policy);
  ASSERT_TRUE(answer_.has_value()) << "still waiting for 2 MiB under a 1 MiB session limit";
  EXPECT_EQ(answer_->status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(answer_->status().message().find("limit"), std::string::npos)
      << answer_->status().ToString();
  EXPECT_EQ(reason_, RejectReason::kSessionLimit);
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 0u);
}

TEST_F(ReserveFairness, AWaiterASmallerJobLimitCanNeverFitIsAnsweredWhenTheSessionOpens) {
  Make(Policy{}, TenantMode::kNone);
  SessionGrant a = Open(1000, "train");
  SessionGrant b = Open(1001);
  ASSERT_TRUE(table_->Reserve(b.session_id, b.token, 1, 3 * kMiB, false).ok());
  ASSERT_NE(Wait(a, 1, 2 * kMiB, &answer_, &reason_), 0u);
  // Another rank of the same job asks for a 1 MiB job limit.
  Hello hello;
  hello.job_id = "train";
  hello.job_max_bytes = kMiB;
  ASSERT_TRUE(table_->Open(hello, PeerCredentials{1235, 1000, 1000}).ok());
  ASSERT_TRUE(answer_.has_value()) << "still waiting for 2 MiB under a 1 MiB job limit";
  EXPECT_EQ(answer_->status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason_, RejectReason::kJobLimit);
  // A reserve within the new limit is placed (1 MiB of the arena is free).
  EXPECT_EQ(Wait(a, 2, 512 * kKiB, &other_answer_), 0u);  // 0: answered at once
  EXPECT_TRUE(other_answer_.has_value() && other_answer_->ok());
}

}  // namespace
}  // namespace memoffload::daemon
