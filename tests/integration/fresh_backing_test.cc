// Fresh backing against the real daemon (issue 13 item 1): a process of an
// old tenant (uid 65534) keeps what it was handed after its session ended: a
// mapping after closing its broker connection on purpose, a mapping in a
// forked child after its parent died (pidfd reclaim), or the fds passed on
// to another process by SCM_RIGHTS. The chunks then change tenant (to this
// process, root). The keeper must neither read the new tenant's bytes nor
// write into them, and the daemon reports what the keeper holds as stale
// until it lets go.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;
using Clock = std::chrono::steady_clock;

// One line from fd (without the newline), waiting up to `timeout`; "" on
// timeout or end of file.
std::string ReadLineWithin(int fd, std::chrono::milliseconds timeout) {
  std::string line;
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 20) <= 0) continue;
    char c = 0;
    if (read(fd, &c, 1) != 1) return "";
    if (c == '\n') return line;
    line += c;
  }
  return "";
}

template <typename Pred>
bool WaitUntil(Pred pred, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

class FreshBacking : public ::testing::TestWithParam<const char*> {};

TEST_P(FreshBacking, KeeperOfAnOldTenantNeitherReadsNorWritesTheNewTenantsBytes) {
  const std::string mode = GetParam();
  std::string error;
  DaemonProcess::Options options = TwoTenantOptions("32MiB", "16MiB");
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string go_file = daemon->scratch_dir() + "/go";

  // Tenant A (uid 65534) takes both chunks, fills them, releases them and
  // ends its session while keeping them (by `mode`).
  int out = -1;
  const pid_t keeper_parent = Spawn({BinDir() + "/stale_keeper", daemon->runtime_dir(), "65534",
                                     mode, std::to_string(32 * kMiB), go_file},
                                    &out);
  ASSERT_GT(keeper_parent, 0);
  const std::string keeper_line = ReadLineWithin(out, std::chrono::seconds(20));
  int keeper = 0;
  ASSERT_EQ(std::sscanf(keeper_line.c_str(), "KEEPER %d", &keeper), 1)
      << "'" << keeper_line << "'" << daemon->Log();
  if (keeper != keeper_parent) {
    EXPECT_EQ(WaitFor(keeper_parent, 10000), 0);
  }
  ASSERT_TRUE(WaitUntil([&] { return daemon->Status().sessions() == 0; }, std::chrono::seconds(5)))
      << "A's session was not reclaimed" << daemon->Log();

  // Tenant B (root) gets both chunks and writes its bytes.
  client::AttachOptions attach;
  attach.runtime_dir = daemon->runtime_dir();
  auto b = client::Client::Attach(attach);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  auto r = (*b)->Reserve(1, 32 * kMiB);
  ASSERT_TRUE(r.ok()) << r.status().ToString() << daemon->Log();
  std::vector<uint8_t> secret(32 * kMiB, 0x5B);
  ASSERT_TRUE((*b)->Write(r->extents, 0, secret.data(), secret.size()).ok());
  ASSERT_TRUE((*b)->Commit(1, secret.size()).ok());
  for (const Extent& e : r->extents) EXPECT_EQ((*b)->chunk_generation(e.chunk), 2u);

  // What A kept is counted outside the arena, in GetStatus (memoffloadctl
  // status) and the metric.
  EXPECT_TRUE(WaitUntil([&] { return daemon->Status().stale_bytes() == 32 * kMiB; },
                        std::chrono::seconds(5)))
      << "stale bytes " << daemon->Status().stale_bytes();
  EXPECT_EQ(daemon->Status().replaced_backings(), 2u);
  // ...and stays counted across the daemon's /proc scans (one a second):
  // the keeper still holds both.
  const auto until = Clock::now() + std::chrono::milliseconds(2500);
  while (Clock::now() < until) {
    ASSERT_EQ(daemon->Status().stale_backings(), 2u)
        << "a scan missed the keeper (mode " << mode << ")";
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }

  // A reads what it maps, then overwrites all of it.
  std::ofstream(go_file) << "go\n";
  EXPECT_EQ(ReadLineWithin(out, std::chrono::seconds(20)), "RESULT OWN yes SAW_B no")
      << "tenant A saw tenant B's bytes (mode " << mode << ")";
  EXPECT_EQ(ReadLineWithin(out, std::chrono::seconds(20)), "WROTE");

  // B's bytes are untouched.
  auto p = (*b)->Prefetch(1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  std::vector<uint8_t> back(secret.size());
  ASSERT_TRUE((*b)->Read(p->extents, 0, back.data(), back.size()).ok());
  EXPECT_TRUE(back == secret) << "tenant A wrote into tenant B's bytes (mode " << mode << ")";
  ASSERT_TRUE((*b)->Release(1).ok());

  // Once A lets go, its pages are gone and no longer counted.
  kill(keeper, SIGKILL);
  if (keeper == keeper_parent) WaitFor(keeper_parent, 10000);
  EXPECT_TRUE(
      WaitUntil([&] { return daemon->Status().stale_bytes() == 0; }, std::chrono::seconds(10)))
      << "stale bytes " << daemon->Status().stale_bytes();
  close(out);
}

INSTANTIATE_TEST_SUITE_P(Modes, FreshBacking, ::testing::Values("close", "parent-dies", "pass-fd"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace memoffload::testing
