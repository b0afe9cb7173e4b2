// A Reserve the daemon refuses because the arena is full is logged by the
// daemon, naming the job and why, and rate-limited per job: a trainer refused
// at every group of every step makes one line per 10 s, not one per refusal.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "daemon_process.h"
#include "memoffload/client/client.h"

namespace memoffload::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;
constexpr int kRefusals = 50;

size_t CountOf(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::unique_ptr<client::Client> Attach(const DaemonProcess& d, const std::string& job, int rank) {
  client::AttachOptions options;
  options.runtime_dir = d.runtime_dir();
  options.job_id = job;
  options.rank = rank;
  auto c = client::Client::Attach(options);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

TEST(ArenaFullLog, ARefusedReserveIsLoggedOncePerJobAndInterval) {
  std::string error;
  DaemonProcess::Options options;
  options.arena_size = "8MiB";
  options.chunk_size = "4MiB";
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto filler = Attach(*daemon, "filler", 0);
  auto refused = Attach(*daemon, "refused-job", 2);
  ASSERT_TRUE(filler && refused);
  ASSERT_TRUE(filler->Reserve(1, 6 * kMiB).ok());
  const std::string line =
      "Reserve refused (arena_full) to session " + std::to_string(refused->session_id()) + " (pid ";
  EXPECT_EQ(daemon->Log().find(line), std::string::npos) << "logged before any refusal";

  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRefusals; ++i) {
    auto r = refused->Reserve(100 + i, 4 * kMiB);
    ASSERT_FALSE(r.ok());
    ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The refusal is answered after its line is written: no waiting needed.
  const std::string log = daemon->Log();
  const size_t lines = CountOf(log, line);
  EXPECT_GE(lines, 1u) << log;
  // One per 10 s window the loop touched (it takes well under one).
  EXPECT_LE(lines, 1 + static_cast<size_t>(seconds / 10) + 1) << log;
  EXPECT_LT(lines, static_cast<size_t>(kRefusals)) << "not rate-limited:\n" << log;
  const size_t at = log.find(line);
  ASSERT_NE(at, std::string::npos);
  const std::string first = log.substr(at, log.find('\n', at) - at);
  EXPECT_NE(first.find("job 'refused-job', rank 2): arena full: 4.00 MiB requested"),
            std::string::npos)
      << first;

  // Another job is not hidden behind the first one's limit.
  auto other = Attach(*daemon, "other-job", -1);
  ASSERT_TRUE(other);
  ASSERT_FALSE(other->Reserve(1, 4 * kMiB).ok());
  const std::string after = daemon->Log();
  EXPECT_NE(after.find("job 'other-job'): arena full"), std::string::npos) << after;
  EXPECT_EQ(after.find("rank -1"), std::string::npos) << after;
}

}  // namespace
}  // namespace memoffload::testing
