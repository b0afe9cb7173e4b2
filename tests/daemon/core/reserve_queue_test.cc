// ReserveQueue's rules, without threads or sleeps: time is passed in, and a
// small model of the arena (a free byte count) stands for SessionTable.
#include "core/reserve_queue.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

namespace memoffload::daemon {
namespace {

using Clock = ReserveQueue::Clock;
using Try = ReserveQueue::Try;
using std::chrono::milliseconds;
using std::chrono::seconds;

const Clock::time_point kT0 = Clock::time_point() + seconds(1000);
const Clock::time_point kFar = kT0 + seconds(3600);

bool NeverHeld(const ReserveQueue::Waiter&) { return false; }

// A free byte count: a waiter is placed when it fits with keep_free left.
struct ModelArena {
  uint64_t free_bytes = 0;
  std::vector<std::string> placed;  // "<tenant>:<bytes>" in order
  std::set<uint64_t> quota_held;    // tickets held by their own quota
  std::vector<uint64_t> keep_free_seen;

  Try Place(const ReserveQueue::Waiter& w, uint64_t keep_free) {
    keep_free_seen.push_back(keep_free);
    if (quota_held.count(w.ticket) != 0) return Try::kQuotaHeld;
    if (w.bytes + keep_free > free_bytes) return Try::kNoRoom;
    free_bytes -= w.bytes;
    placed.push_back(w.tenant + ":" + std::to_string(w.bytes));
    return Try::kPlaced;
  }
  std::vector<uint64_t> Dispatch(ReserveQueue* queue, Clock::time_point now) {
    return queue->Dispatch(
        now, [this](const ReserveQueue::Waiter& w) { return quota_held.count(w.ticket) != 0; },
        [this](const ReserveQueue::Waiter& w, uint64_t keep_free) { return Place(w, keep_free); });
  }
};

uint64_t MustAdd(ReserveQueue* q, const std::string& tenant, uint64_t bytes,
                 Clock::time_point now = kT0, Clock::time_point deadline = kFar) {
  Result<uint64_t> t = q->Add(tenant, bytes, now, deadline);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? *t : 0;
}

TEST(ReserveQueue, WithinATenantArrivalOrderHolds) {
  ReserveQueue q;
  MustAdd(&q, "a", 3);
  MustAdd(&q, "a", 1);
  ModelArena arena;
  arena.free_bytes = 2;  // the second fits, the first does not
  EXPECT_TRUE(arena.Dispatch(&q, kT0).empty());
  EXPECT_TRUE(arena.placed.empty());
  EXPECT_EQ(q.size(), 2u);
  // Nor may a new request of the same tenant go first.
  const ReserveQueue::Before before = q.Ahead("a", kT0, NeverHeld);
  EXPECT_EQ(before.same_tenant_count, 2u);
  EXPECT_EQ(before.same_tenant_bytes, 4u);
  arena.free_bytes = 4;
  EXPECT_EQ(arena.Dispatch(&q, kT0).size(), 2u);
  EXPECT_EQ(arena.placed, (std::vector<std::string>{"a:3", "a:1"}));
}

TEST(ReserveQueue, AnotherTenantsWaiterThatFitsIsPlaced) {
  ReserveQueue q;
  MustAdd(&q, "a", 3);
  const uint64_t b = MustAdd(&q, "b", 1);
  ModelArena arena;
  arena.free_bytes = 2;
  EXPECT_EQ(arena.Dispatch(&q, kT0), std::vector<uint64_t>{b});
  EXPECT_EQ(arena.placed, std::vector<std::string>{"b:1"});
  EXPECT_EQ(q.size(), 1u);
}

TEST(ReserveQueue, AnotherTenantsWaiterDoesNotStandBeforeANewRequest) {
  ReserveQueue q;
  MustAdd(&q, "a", 1000);
  const ReserveQueue::Before before = q.Ahead("b", kT0 + milliseconds(10), NeverHeld);
  EXPECT_EQ(before.same_tenant_count, 0u);
  EXPECT_EQ(before.aged, nullptr);
  EXPECT_EQ(before.keep_free_bytes, 0u);
}

TEST(ReserveQueue, AWaiterHeldByItsOwnQuotaBlocksNobody) {
  ReserveQueue q;
  const uint64_t held = MustAdd(&q, "a", 1);
  MustAdd(&q, "a", 1);
  ModelArena arena;
  arena.quota_held.insert(held);
  arena.free_bytes = 10;
  EXPECT_EQ(
      q.Ahead("a", kT0,
              [&](const ReserveQueue::Waiter& w) { return arena.quota_held.count(w.ticket) != 0; })
          .same_tenant_count,
      1u);
  EXPECT_EQ(arena.Dispatch(&q, kT0).size(), 1u);
  EXPECT_EQ(q.size(), 1u);
  EXPECT_NE(q.Find(held), nullptr);
}

TEST(ReserveQueue, TenantsAreServedRoundRobin) {
  ReserveQueue q;
  for (int i = 0; i < 3; ++i) {
    MustAdd(&q, "a", 1);
    MustAdd(&q, "b", 1);
    MustAdd(&q, "c", 1);
  }
  MustAdd(&q, "a", 1);  // a has one more
  ModelArena arena;
  arena.free_bytes = 5;
  arena.Dispatch(&q, kT0);
  EXPECT_EQ(arena.placed, (std::vector<std::string>{"a:1", "b:1", "c:1", "a:1", "b:1"}));
  // The next round starts after the tenant served last.
  arena.free_bytes = 2;
  arena.Dispatch(&q, kT0);
  EXPECT_EQ(arena.placed.size(), 7u);
  EXPECT_EQ(arena.placed[5], "c:1");
  EXPECT_EQ(arena.placed[6], "a:1");
}

TEST(ReserveQueue, AnAgedWaiterIsTriedFirstAndOthersLeaveItsBytesFree) {
  ReserveQueue::Limits limits;
  limits.aging = seconds(2);
  ReserveQueue q(limits);
  const uint64_t big = MustAdd(&q, "a", 3, kT0);
  MustAdd(&q, "b", 1, kT0 + seconds(1));
  ModelArena arena;
  arena.free_bytes = 2;
  // Not aged yet: b's waiter fits and goes.
  EXPECT_EQ(q.Ahead("b", kT0 + seconds(1), NeverHeld).keep_free_bytes, 0u);
  // Aged: a is tried first with nothing kept, b must leave a's 3 bytes free.
  const auto later = kT0 + seconds(2);
  const ReserveQueue::Before before = q.Ahead("b", later, NeverHeld);
  ASSERT_NE(before.aged, nullptr);
  EXPECT_EQ(before.aged->ticket, big);
  EXPECT_EQ(before.keep_free_bytes, 3u);
  EXPECT_EQ(q.Ahead("a", later, NeverHeld).keep_free_bytes, 0u);  // its own waiter
  EXPECT_TRUE(arena.Dispatch(&q, later).empty());
  EXPECT_EQ(arena.keep_free_seen, (std::vector<uint64_t>{0, 3}));
  arena.free_bytes = 3;
  EXPECT_EQ(arena.Dispatch(&q, later), std::vector<uint64_t>{big});
  EXPECT_EQ(arena.placed.front(), "a:3");
}

// The aging rule as a property: another tenant churning small requests (give
// one back, take one) overtakes a large waiter until it ages, never after.
TEST(ReserveQueue, ChurnOfAnotherTenantCannotStarveAnAgedWaiter) {
  ReserveQueue::Limits limits;
  limits.aging = seconds(2);
  ReserveQueue q(limits);
  ModelArena arena;
  arena.free_bytes = 0;  // b holds everything, in units of 1
  const uint64_t big = MustAdd(&q, "a", 3, kT0);
  bool served = false;
  int b_refused = 0;
  for (int step = 0; step < 100 && !served; ++step) {
    const auto now = kT0 + milliseconds(100) * step;
    arena.free_bytes += 1;  // b releases one
    for (uint64_t t : arena.Dispatch(&q, now)) served = served || t == big;
    // b asks again at once, outside the queue.
    const ReserveQueue::Before before = q.Ahead("b", now, NeverHeld);
    if (!served) {
      if (1 + before.keep_free_bytes <= arena.free_bytes) {
        arena.free_bytes -= 1;
      } else {
        ++b_refused;
      }
    }
    if (now < kT0 + seconds(2)) {
      EXPECT_FALSE(served) << "step " << step;  // b wins while a is young
      EXPECT_EQ(b_refused, 0);
    }
  }
  EXPECT_TRUE(served);
  EXPECT_EQ(b_refused, 2);  // two releases accumulate, the third serves a
}

TEST(ReserveQueue, BoundsAreNamedAndNothingIsQueuedOverThem) {
  ReserveQueue::Limits limits;
  limits.max_waiters = 3;
  limits.max_waiters_per_tenant = 2;
  ReserveQueue q(limits);
  MustAdd(&q, "a", 1);
  MustAdd(&q, "a", 1);
  Result<uint64_t> over_tenant = q.Add("a", 1, kT0, kFar);
  ASSERT_FALSE(over_tenant.ok());
  EXPECT_EQ(over_tenant.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over_tenant.status().message().find("quotas.max_waiting_reserves_per_tenant is 2"),
            std::string::npos)
      << over_tenant.status().message();
  MustAdd(&q, "b", 1);
  Result<uint64_t> over_all = q.Add("c", 1, kT0, kFar);
  ASSERT_FALSE(over_all.ok());
  EXPECT_NE(over_all.status().message().find("quotas.max_waiting_reserves is 3"), std::string::npos)
      << over_all.status().message();
  EXPECT_EQ(q.size(), 3u);
}

// With tenant = job a uid's job ids are tenants of their own: they share one
// per-tenant bound, so naming more job ids takes no more of the queue.
TEST(ReserveQueue, TheTenantsOfOneOwnerShareThePerTenantBound) {
  ReserveQueue::Limits limits;
  limits.max_waiters = 100;
  limits.max_waiters_per_tenant = 2;
  ReserveQueue q(limits);
  auto add = [&](const std::string& tenant, uint64_t owner) {
    return q.Add(tenant, 1, kT0, kFar, owner);
  };
  ASSERT_TRUE(add("job:7:a", 7).ok());
  Result<uint64_t> second = add("job:7:b", 7);
  ASSERT_TRUE(second.ok());
  Result<uint64_t> third = add("job:7:c", 7);
  ASSERT_FALSE(third.ok());
  EXPECT_NE(third.status().message().find("too many waiting reserves of uid 7: 2 wait already "
                                          "over its job ids"),
            std::string::npos)
      << third.status().message();
  // Another owner has its own bound; a leaving waiter gives the owner room.
  EXPECT_TRUE(add("job:8:a", 8).ok());
  EXPECT_TRUE(add("job:8:b", 8).ok());
  ASSERT_TRUE(q.Remove(*second));
  EXPECT_TRUE(add("job:7:c", 7).ok());
  EXPECT_FALSE(add("job:7:d", 7).ok());
  // Expired and taken waiters count no more either.
  EXPECT_EQ(q.TakeExpired(kFar + std::chrono::seconds(1)).size(), 4u);
  EXPECT_TRUE(add("job:7:a", 7).ok());
  EXPECT_EQ(q.TakeAll().size(), 1u);
  EXPECT_TRUE(add("job:7:a", 7).ok());
  EXPECT_TRUE(add("job:7:b", 7).ok());
}

TEST(ReserveQueue, DeadlinesExpireInTimeAndRemoveOnlyThoseDue) {
  ReserveQueue q;
  EXPECT_FALSE(q.NextDeadline().has_value());
  const uint64_t early = MustAdd(&q, "a", 1, kT0, kT0 + seconds(1));
  MustAdd(&q, "b", 1, kT0, kT0 + seconds(5));
  ASSERT_TRUE(q.NextDeadline().has_value());
  EXPECT_EQ(*q.NextDeadline(), kT0 + seconds(1));
  EXPECT_TRUE(q.TakeExpired(kT0 + milliseconds(999)).empty());
  std::vector<ReserveQueue::Waiter> expired = q.TakeExpired(kT0 + seconds(1));
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].ticket, early);
  EXPECT_EQ(*q.NextDeadline(), kT0 + seconds(5));
  EXPECT_EQ(q.TakeAll().size(), 1u);
  EXPECT_EQ(q.size(), 0u);
}

TEST(ReserveQueue, RemoveAndALeavingWaiterLetTheLineGoOn) {
  ReserveQueue q;
  const uint64_t first = MustAdd(&q, "a", 5);
  MustAdd(&q, "a", 1);
  EXPECT_TRUE(q.Remove(first));
  EXPECT_FALSE(q.Remove(first));
  const uint64_t gone = MustAdd(&q, "b", 1);
  MustAdd(&q, "b", 1);
  ModelArena arena;
  arena.free_bytes = 2;
  std::vector<uint64_t> answered =
      q.Dispatch(kT0, NeverHeld, [&](const ReserveQueue::Waiter& w, uint64_t keep_free) {
        if (w.ticket == gone) return Try::kLeft;  // e.g. its session ended
        return arena.Place(w, keep_free);
      });
  EXPECT_EQ(answered.size(), 3u);
  EXPECT_EQ(q.size(), 0u);
}

}  // namespace
}  // namespace memoffload::daemon
