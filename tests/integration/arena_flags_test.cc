// memoffloadd's arena flags end to end: --hugepages without reserved
// hugepages falls back and serves; --numa-node accepts node 0 and refuses a
// node that does not exist with a clear message.
#include <gtest/gtest.h>

#include <cstring>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/common/units.h"
#include "memoffload/shared_mem/chunk.h"

namespace memoffload::testing {
namespace {

// Attaches, reserves 1 MiB and round-trips a pattern through it.
void ExpectServes(const DaemonProcess& daemon) {
  client::AttachOptions options;
  options.runtime_dir = daemon.runtime_dir();
  auto c = client::Client::Attach(options);
  ASSERT_TRUE(c.ok()) << c.status().ToString() << "\n" << daemon.Log();
  auto r = (*c)->Reserve(1, 1 << 20);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::string in(1 << 20, 'x'), out(1 << 20, '\0');
  ASSERT_TRUE((*c)->Write(r->extents, 0, in.data(), in.size()).ok());
  ASSERT_TRUE((*c)->Read(r->extents, 0, out.data(), out.size()).ok());
  EXPECT_EQ(in, out);
}

TEST(ArenaFlags, HugepagesFallBackWithOneClearLineAndServe) {
  if (FreeHugePages() > 0) GTEST_SKIP() << "this machine has hugepages reserved";
  DaemonProcess::Options o;
  o.extra_args = {"--hugepages"};
  std::string error;
  auto daemon = DaemonProcess::Start(o, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string log = daemon->Log();
  EXPECT_NE(log.find("--hugepages: using normal pages for 4 of 4 chunks: not enough hugepages"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("sysctl -w vm.nr_hugepages="), std::string::npos) << log;
  ExpectServes(*daemon);
}

TEST(ArenaFlags, HugepagesWithAChunkSizeNotAHugepageMultipleSaysSo) {
  if (DefaultHugePageBytes() != 2 * kMiB) GTEST_SKIP() << "hugepage size is not 2 MiB";
  DaemonProcess::Options o;
  o.chunk_size = "63MiB";  // 256 MiB = 4 chunks of 63 MiB + one of 4 MiB
  o.extra_args = {"--hugepages"};
  std::string error;
  auto daemon = DaemonProcess::Start(o, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string log = daemon->Log();
  EXPECT_NE(log.find("--hugepages: using normal pages for 5 of 5 chunks: chunk size 63.00 MiB is "
                     "not a multiple of the hugepage size 2.00 MiB"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("not enough hugepages"), std::string::npos) << log;
  ExpectServes(*daemon);
}

TEST(ArenaFlags, NumaNodeZeroServes) {
  DaemonProcess::Options o;
  o.extra_args = {"--numa-node=0"};
  std::string error;
  auto daemon = DaemonProcess::Start(o, &error);
  ASSERT_NE(daemon, nullptr) << error;
  EXPECT_NE(daemon->Log().find("NUMA node 0"), std::string::npos) << daemon->Log();
  ExpectServes(*daemon);
}

TEST(ArenaFlags, MissingNumaNodeIsAClearError) {
  DaemonProcess::Options o;
  o.extra_args = {"--numa-node=999"};
  std::string error;
  auto daemon = DaemonProcess::Start(o, &error);
  ASSERT_EQ(daemon, nullptr);
  EXPECT_NE(error.find("arena.numa_node: node 999 does not exist; online nodes: "),
            std::string::npos)
      << error;
}

}  // namespace
}  // namespace memoffload::testing
