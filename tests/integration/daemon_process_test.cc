// The checks DaemonProcess makes for every test: the daemon must exit
// cleanly with 0 unless killed on purpose, and its log must hold no
// sanitizer report. Each check is shown to fail the test when it should.
#include "daemon_process.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <fstream>

namespace memoffload::testing {
namespace {

// EXPECT_NONFATAL_FAILURE's statement cannot use locals.
std::unique_ptr<DaemonProcess> g_daemon;

std::unique_ptr<DaemonProcess> StartOrFail() {
  std::string error;
  auto d = DaemonProcess::Start({}, &error);
  EXPECT_NE(d, nullptr) << error;
  return d;
}

TEST(DaemonProcess, SanitizerReportFindsEachKind) {
  EXPECT_EQ(SanitizerReport("memoffloadd[7] INFO listening\nmemoffloadd[7] INFO stopped\n"), "");
  for (const char* line :
       {"==12==ERROR: AddressSanitizer: heap-use-after-free on address 0x6020",
        "==12==ERROR: LeakSanitizer: detected memory leaks",
        "WARNING: ThreadSanitizer: data race (pid=12)",
        "daemon/memory/allocator.cc:10:5: runtime error: signed integer overflow"}) {
    EXPECT_EQ(SanitizerReport(std::string("memoffloadd[7] INFO x\n") + line + "\nmore\n"),
              std::string(line) + "\n");
  }
}

TEST(DaemonProcess, ASignalDeathFailsTheTest) {
  g_daemon = StartOrFail();
  ASSERT_NE(g_daemon, nullptr);
  EXPECT_NONFATAL_FAILURE(g_daemon->Stop(SIGABRT, 10000), "was killed by signal 6");
  g_daemon.reset();
}

TEST(DaemonProcess, AKillOnPurposeDoesNot) {
  g_daemon = StartOrFail();
  ASSERT_NE(g_daemon, nullptr);
  const int status = g_daemon->Stop(SIGKILL, 10000);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  g_daemon.reset();
}

TEST(DaemonProcess, ASanitizerReportInTheLogFailsTheTest) {
  g_daemon = StartOrFail();
  ASSERT_NE(g_daemon, nullptr);
  g_daemon->Stop(SIGTERM, 10000);  // a clean exit; the report is what fails
  {
    std::ofstream log(g_daemon->scratch_dir() + "/daemon.log", std::ios::app);
    log << "==1==ERROR: LeakSanitizer: detected memory leaks\n";
  }
  EXPECT_NONFATAL_FAILURE(g_daemon.reset(), "LeakSanitizer: detected memory leaks");
}

TEST(DaemonProcess, ACleanStopPassesAndExitsZero) {
  auto d = StartOrFail();
  ASSERT_NE(d, nullptr);
  const int status = d->Stop(SIGTERM, 10000);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace memoffload::testing
