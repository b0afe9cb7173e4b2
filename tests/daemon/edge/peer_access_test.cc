// ConnectionLimits against a reference count, AccessDenied's rules, and the
// log rate limiter's burst.
#include "edge/peer_access.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <random>

#include "base/log.h"

namespace memoffload::daemon {
namespace {

TEST(ConnectionLimits, RandomAdmitsAndReleasesMatchAReferenceCount) {
  constexpr size_t kTotal = 50;
  constexpr size_t kPerUid = 8;
  ConnectionLimits limits(kTotal, kPerUid);
  std::map<uid_t, size_t> model;
  size_t total = 0;
  std::mt19937 rng(13);
  for (int i = 0; i < 200000; ++i) {
    const uid_t uid = rng() % 12;
    if (rng() % 2 == 0) {
      const bool fits = total < kTotal && model[uid] < kPerUid;
      EXPECT_EQ(limits.Full(uid), !fits);
      const std::string why = limits.Admit(uid);
      ASSERT_EQ(why.empty(), fits) << why;
      if (fits) {
        ++model[uid];
        ++total;
      } else {
        EXPECT_NE(
            why.find(total >= kTotal ? "server.max_connections" : "server.max_connections_per_uid"),
            std::string::npos)
            << why;
      }
    } else if (model[uid] > 0) {
      limits.Release(uid);
      --model[uid];
      --total;
    } else {
      limits.Release(uid);  // not admitted: ignored
    }
    ASSERT_EQ(limits.total(), total);
    ASSERT_EQ(limits.of_uid(uid), model[uid]);
  }
}

TEST(AccessDenied, RootOwnUidListedUidsAndGroupsOnly) {
  Policy policy;
  EXPECT_EQ(AccessDenied(policy, {1, 0, 0}), "");
  EXPECT_EQ(AccessDenied(policy, {1, geteuid(), 5}), "");
  const std::string denied = AccessDenied(policy, {1, 65534, 65534});
  if (geteuid() != 65534) {
    EXPECT_NE(denied.find("uid 65534 (gid 65534) may not use this daemon"), std::string::npos)
        << denied;
  }
  policy.allowed_uids = {65534};
  EXPECT_EQ(AccessDenied(policy, {1, 65534, 1}), "");
  policy.allowed_uids.clear();
  policy.allowed_gids = {4242};
  EXPECT_EQ(AccessDenied(policy, {1, 65534, 4242}), "");
  // A supplementary group counts as the primary does (usermod -aG).
  EXPECT_EQ(AccessDenied(policy, {1, 65534, 65534, {27, 4242}}), "");
  const std::string other = AccessDenied(policy, {1, 65534, 65534, {27, 100}});
  EXPECT_NE(other.find("(gid 65534, groups 27,100) may not use"), std::string::npos) << other;
  // The socket group's members, by primary or supplementary gid.
  policy.socket_gid = 100;
  EXPECT_EQ(AccessDenied(policy, {1, 65534, 65534, {27, 100}}), "");
  EXPECT_EQ(AccessDenied(policy, {1, 65534, 100}), "");
  EXPECT_NE(AccessDenied(policy, {1, 65534, 65534, {27}}).find("members of the socket group 100"),
            std::string::npos);
}

TEST(LogRateLimiter, AdmitsABurstThenCountsWhatItDrops) {
  LogRateLimiter limiter;
  unsigned long suppressed = 0;
  int admitted = 0;
  for (int i = 0; i < 1000; ++i) {
    if (limiter.Allow(&suppressed)) ++admitted;
  }
  // One window at most, two if the loop straddled a second.
  EXPECT_GE(admitted, LogRateLimiter::kBurst);
  EXPECT_LE(admitted, 2 * LogRateLimiter::kBurst);
}

}  // namespace
}  // namespace memoffload::daemon
