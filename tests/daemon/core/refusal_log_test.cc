// RefusalLog against a clock the test moves: one admitted line per key and
// interval, the count of what was left out on the next one, keys apart.
#include "core/refusal_log.h"

#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <string>

namespace memoffload::daemon {
namespace {

using std::chrono::seconds;
using Clock = RefusalLog::Clock;

TEST(RefusalLog, AdmitsOneLinePerKeyAndIntervalAndCountsTheRest) {
  RefusalLog log(seconds(10));
  const Clock::time_point t0{};
  EXPECT_EQ(log.Admit("0:a", t0), std::optional<uint64_t>(0));
  for (int i = 1; i <= 7; ++i) EXPECT_EQ(log.Admit("0:a", t0 + seconds(i)), std::nullopt) << i;
  // Another job of the same uid, another uid's job of the same name: apart.
  EXPECT_EQ(log.Admit("0:b", t0 + seconds(1)), std::optional<uint64_t>(0));
  EXPECT_EQ(log.Admit("7:a", t0 + seconds(1)), std::optional<uint64_t>(0));
  EXPECT_EQ(log.Admit("0:a", t0 + seconds(9)), std::nullopt);
  // Past the interval: admitted, with the 8 left out since the last line.
  EXPECT_EQ(log.Admit("0:a", t0 + seconds(10)), std::optional<uint64_t>(8));
  EXPECT_EQ(log.Admit("0:a", t0 + seconds(19)), std::nullopt);
  EXPECT_EQ(log.Admit("0:a", t0 + seconds(40)), std::optional<uint64_t>(1));
  EXPECT_EQ(log.Admit("0:b", t0 + seconds(40)), std::optional<uint64_t>(0));
}

TEST(RefusalLog, StaysBoundedWithManyKeys) {
  RefusalLog log(seconds(10));
  const Clock::time_point t0{};
  for (size_t i = 0; i < RefusalLog::kMaxKeys; ++i) {
    ASSERT_TRUE(log.Admit("0:job-" + std::to_string(i), t0).has_value());
  }
  // Full, nobody quiet yet: admitted untracked (a line, never a growing map).
  EXPECT_EQ(log.Admit("0:new", t0 + seconds(1)), std::optional<uint64_t>(0));
  EXPECT_EQ(log.Admit("0:new", t0 + seconds(2)), std::optional<uint64_t>(0));
  // A known key is still limited.
  EXPECT_EQ(log.Admit("0:job-1", t0 + seconds(2)), std::nullopt);
  // Once the old keys are quiet for an interval they make room.
  EXPECT_EQ(log.Admit("0:new", t0 + seconds(11)), std::optional<uint64_t>(0));
  EXPECT_EQ(log.Admit("0:new", t0 + seconds(12)), std::nullopt);
}

}  // namespace
}  // namespace memoffload::daemon
