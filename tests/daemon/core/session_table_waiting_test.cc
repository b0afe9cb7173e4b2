// SessionTable's waiting reserves (session_table_reserve.cc, the queue's
// rules in reserve_queue_test.cc): served when space comes back, in arrival
// order, never ahead of an earlier waiter; answered at their deadline, on
// cancel and on drain with a message that says why.
#include <gtest/gtest.h>

#include <thread>

#include "core/session_table.h"
#include "memoffload/common/units.h"
#include "session_table_fixture.h"

namespace memoffload::daemon {
namespace {

TEST_F(SessionTableTest, WaitingReserveIsServedWhenSpaceIsReleased) {
  SessionGrant a = Open();
  SessionGrant b = Open();
  ASSERT_TRUE(table_->Reserve(a.session_id, a.token, 1, 3 * kMiB, false).ok());
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(table_->Snapshot().waiting_reserves, 1u);
    ASSERT_TRUE(table_->Release(a.session_id, a.token, 1).ok());
  });
  const auto start = std::chrono::steady_clock::now();
  auto r =
      table_->Reserve(b.session_id, b.token, 1, 2 * kMiB, false, start + std::chrono::seconds(10));
  releaser.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(90));
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 0u);
}

TEST_F(SessionTableTest, WaitingReserveTimesOutAtItsDeadline) {
  SessionGrant s = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 4 * kMiB, false).ok());
  const auto start = std::chrono::steady_clock::now();
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(s.session_id, s.token, 2, kMiB, false,
                           start + std::chrono::milliseconds(150), &reason);
  const auto waited = std::chrono::steady_clock::now() - start;
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kWaitTimeout);
  EXPECT_NE(r.status().message().find("until the deadline"), std::string::npos);
  EXPECT_GE(waited, std::chrono::milliseconds(150));
  EXPECT_LT(waited, std::chrono::seconds(2));
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 0u);
}

TEST_F(SessionTableTest, WaitersAreServedInArrivalOrder) {
  SessionGrant s = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, kMiB, false).ok());
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 2, 3 * kMiB, false).ok());
  auto deadline = [] { return std::chrono::steady_clock::now() + std::chrono::seconds(10); };
  // The first waiter needs 2 MiB, the second only 1 MiB.
  std::thread first([&] {
    EXPECT_TRUE(table_->Reserve(s.session_id, s.token, 10, 2 * kMiB, false, deadline()).ok());
  });
  while (table_->Snapshot().waiting_reserves < 1) std::this_thread::yield();
  std::thread second([&] {
    EXPECT_TRUE(table_->Reserve(s.session_id, s.token, 11, kMiB, false, deadline()).ok());
  });
  while (table_->Snapshot().waiting_reserves < 2) std::this_thread::yield();
  // 1 MiB frees up: enough for the second, but it may not overtake the first.
  ASSERT_TRUE(table_->Release(s.session_id, s.token, 1).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 2u);
  EXPECT_EQ(table_->Snapshot().free_bytes, kMiB);
  // 3 MiB more: both are served.
  ASSERT_TRUE(table_->Release(s.session_id, s.token, 2).ok());
  first.join();
  second.join();
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 0u);
  EXPECT_EQ(table_->Snapshot().free_bytes, kMiB);
}

TEST_F(SessionTableTest, DrainWakesWaitersWithUnavailable) {
  SessionGrant s = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 4 * kMiB, false).ok());
  std::thread drainer([&] {
    while (table_->Snapshot().waiting_reserves < 1) std::this_thread::yield();
    EXPECT_TRUE(table_->SetDraining(true).ok());
  });
  auto r = table_->Reserve(s.session_id, s.token, 2, kMiB, false,
                           std::chrono::steady_clock::now() + std::chrono::seconds(10));
  drainer.join();
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
}

TEST_F(SessionTableTest, WaiterHeldByItsOwnQuotaDoesNotBlockOthers) {
  SessionGrant limited = Open(kMiB);
  SessionGrant other = Open();
  ASSERT_TRUE(table_->Reserve(limited.session_id, limited.token, 1, kMiB, false).ok());
  // `limited` waits for its own quota (1 MiB more than its 1 MiB limit allows).
  std::thread waiter([&] {
    RejectReason reason = RejectReason::kNone;
    auto r =
        table_->Reserve(limited.session_id, limited.token, 2, kMiB, false,
                        std::chrono::steady_clock::now() + std::chrono::milliseconds(600), &reason);
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(reason, RejectReason::kWaitTimeout);
    // The timeout names the limit hit and by how much.
    EXPECT_NE(r.status().message().find("session limit"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("exceed it by 1.00 MiB"), std::string::npos)
        << r.status().message();
  });
  while (table_->Snapshot().waiting_reserves < 1) std::this_thread::yield();
  // Plenty of arena is free: neither a waiting nor a plain reserve of
  // another session queues behind it.
  const auto start = std::chrono::steady_clock::now();
  auto r = table_->Reserve(other.session_id, other.token, 1, kMiB, false,
                           start + std::chrono::seconds(5));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(table_->Reserve(other.session_id, other.token, 2, kMiB, false).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(300));
  waiter.join();
}

TEST_F(SessionTableTest, PlainReserveDoesNotJumpAheadOfCapacityWaiters) {
  SessionGrant s = Open();
  SessionGrant t = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 3 * kMiB, false).ok());
  std::thread waiter([&] {
    EXPECT_TRUE(table_
                    ->Reserve(s.session_id, s.token, 2, 2 * kMiB, false,
                              std::chrono::steady_clock::now() + std::chrono::seconds(10))
                    .ok());
  });
  while (table_->Snapshot().waiting_reserves < 1) std::this_thread::yield();
  // 1 MiB is free, but the 2 MiB waiter came first.
  RejectReason reason = RejectReason::kNone;
  auto r = table_->Reserve(t.session_id, t.token, 1, kMiB, false, std::nullopt, &reason);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kArenaFull);
  EXPECT_NE(r.status().message().find(
                "behind 1 earlier waiting reserve of the same tenant (uid:1000) needing 2.00 MiB"),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("short by 2.00 MiB"), std::string::npos)
      << r.status().message();
  ASSERT_TRUE(table_->Release(s.session_id, s.token, 1).ok());
  waiter.join();
  EXPECT_TRUE(table_->Reserve(t.session_id, t.token, 1, kMiB, false).ok());
}

TEST_F(SessionTableTest, QueuedWaiterTimeoutNamesTheArenaAndTheShortfall) {
  SessionGrant s = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 4 * kMiB, false).ok());
  std::thread first([&] {
    (void)table_->Reserve(s.session_id, s.token, 2, 2 * kMiB, false,
                          std::chrono::steady_clock::now() + std::chrono::seconds(1));
  });
  while (table_->Snapshot().waiting_reserves < 1) std::this_thread::yield();
  RejectReason reason = RejectReason::kNone;
  auto r =
      table_->Reserve(s.session_id, s.token, 3, kMiB, false,
                      std::chrono::steady_clock::now() + std::chrono::milliseconds(150), &reason);
  first.join();
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(reason, RejectReason::kWaitTimeout);
  const std::string& m = r.status().message();
  EXPECT_EQ(m.find("queued behind earlier waiting reserves"), std::string::npos) << m;
  EXPECT_NE(m.find("until the deadline; last refusal: arena full: 1.00 MiB requested behind 1 "
                   "earlier waiting reserve of the same tenant (uid:1000) needing 2.00 MiB"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("0 B available (4.00 MiB in use of 4.00 MiB usable; node reserve 0 B), short "
                   "by 3.00 MiB"),
            std::string::npos)
      << m;
}

TEST_F(SessionTableTest, CancelledWaiterLeavesAndIsNeverGranted) {
  SessionGrant s = Open();
  SessionGrant t = Open();
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 4 * kMiB, false).ok());
  std::optional<Result<ReserveResult>> answer;
  RejectReason reason = RejectReason::kNone;
  const uint64_t ticket =
      table_->ReserveAsync(t.session_id, t.token, 1, kMiB, false,
                           std::chrono::steady_clock::now() + std::chrono::seconds(10),
                           [&](Result<ReserveResult> r, RejectReason why) {
                             answer = std::move(r);
                             reason = why;
                           });
  ASSERT_NE(ticket, 0u);
  EXPECT_FALSE(answer.has_value());
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 1u);
  table_->CancelReserve(ticket);  // answered on this thread
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->status().code(), StatusCode::kCancelled) << answer->status().ToString();
  EXPECT_EQ(reason, RejectReason::kCancelled);
  EXPECT_EQ(table_->Snapshot().waiting_reserves, 0u);
  table_->CancelReserve(ticket);  // a second cancel does nothing
  // Space frees up later: nothing lands in the cancelled caller's session.
  ASSERT_TRUE(table_->Release(s.session_id, s.token, 1).ok());
  EXPECT_EQ(table_->Snapshot().groups, 0u);
  EXPECT_EQ(table_->Snapshot().free_bytes, 4 * kMiB);
  EXPECT_EQ(table_->Release(t.session_id, t.token, 1).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace memoffload::daemon
