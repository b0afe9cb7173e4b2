// The mlock warning path: the daemon started with a small RLIMIT_MEMLOCK and
// without CAP_IPC_LOCK (so running the tests as root does not bypass the
// limit) logs exactly one warning that says how to raise the limit, reports
// mlocked=false, and still serves.
#include <gtest/gtest.h>
#include <linux/capability.h>

#include <fstream>
#include <sstream>
#include <string>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

TEST(Mlock, LowLimitWarnsOnceSaysHowToRaiseItAndServes) {
  DaemonProcess::Options o;
  o.memlock_limit_bytes = 64 * 1024;
  std::string error;
  auto daemon = DaemonProcess::Start(o, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string log = daemon->Log();
  std::istringstream lines(log);
  std::string line, warning;
  int warnings = 0;
  while (std::getline(lines, line)) {
    if (line.find("WARN") != std::string::npos && line.find("mlock") != std::string::npos) {
      ++warnings;
      warning = line;
    }
  }
  ASSERT_EQ(warnings, 1) << log;
  EXPECT_NE(warning.find("RLIMIT_MEMLOCK is 64.00 KiB"), std::string::npos) << warning;
  EXPECT_NE(warning.find("the arena needs 256.00 MiB"), std::string::npos) << warning;
  EXPECT_NE(warning.find("ulimit -l"), std::string::npos) << warning;
  EXPECT_NE(warning.find("LimitMEMLOCK"), std::string::npos) << warning;
  EXPECT_NE(warning.find("CAP_IPC_LOCK"), std::string::npos) << warning;
  EXPECT_NE(log.find("mlock no"), std::string::npos) << log;
  EXPECT_FALSE(daemon->Status().mlocked());

  client::AttachOptions options;
  options.runtime_dir = daemon->runtime_dir();
  auto c = client::Client::Attach(options);
  ASSERT_TRUE(c.ok()) << c.status().ToString() << "\n" << daemon->Log();
  auto r = (*c)->Reserve(1, 8 << 20);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::string in(8 << 20, 'm'), out(8 << 20, '\0');
  ASSERT_TRUE((*c)->Write(r->extents, 0, in.data(), in.size()).ok());
  ASSERT_TRUE((*c)->Read(r->extents, 0, out.data(), out.size()).ok());
  EXPECT_EQ(in, out);
}

// True when this process has CAP_IPC_LOCK in its effective set.
bool HasIpcLock() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      return (std::stoull(line.substr(7), nullptr, 16) >> CAP_IPC_LOCK & 1) != 0;
    }
  }
  return false;
}

// The control for the test above: with CAP_IPC_LOCK the same arena locks.
TEST(Mlock, WithIpcLockTheArenaIsLockedWithoutWarning) {
  if (!HasIpcLock()) GTEST_SKIP() << "no CAP_IPC_LOCK: the default limit may not allow locking";
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  EXPECT_TRUE(daemon->Status().mlocked()) << daemon->Log();
  EXPECT_EQ(daemon->Log().find("mlock failed"), std::string::npos) << daemon->Log();
}

}  // namespace
}  // namespace memoffload::testing
