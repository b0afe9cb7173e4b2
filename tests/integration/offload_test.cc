// Several client processes offload and read back random groups in parallel.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include "daemon_process.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

TEST(Offload, FourProcessesReadBackEveryByte) {
  std::string error;
  DaemonProcess::Options options;
  options.arena_size = "768MiB";
  options.chunk_size = "128MiB";
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;

  std::vector<pid_t> workers;
  for (int i = 0; i < 4; ++i) {
    workers.push_back(Spawn({BinDir() + "/offload_worker", "verify", daemon->runtime_dir(),
                             std::to_string(100 + i), "24", "1024", std::to_string(64 << 20)},
                            nullptr));
  }
  for (pid_t pid : workers) {
    int status = WaitFor(pid, 120000);
    ASSERT_NE(status, -1) << "worker timed out";
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "worker failed, status " << status << "\n"
        << daemon->Log();
  }
  // Every worker released everything and detached.
  v1::GetStatusResponse s = daemon->Status();
  EXPECT_EQ(s.used_bytes(), 0u);
  EXPECT_EQ(s.free_bytes(), s.capacity_bytes());
  EXPECT_EQ(s.groups(), 0u);
}

}  // namespace
}  // namespace memoffload::testing
