// memoffloadctl against the real daemon: both output formats, drain and
// undrain, config, and exit codes scripts rely on.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <iterator>
#include <sstream>

#include "ctl_json.h"
#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/common/units.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

class CtlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    daemon_ = DaemonProcess::Start({}, &error);
    ASSERT_NE(daemon_, nullptr) << error;
  }
  int Ctl(std::vector<std::string> args, std::string* out) {
    args.insert(args.begin(),
                {BinDir() + "/memoffloadctl", "--runtime-dir", daemon_->runtime_dir()});
    return RunCapture(args, out);
  }
  std::unique_ptr<DaemonProcess> daemon_;
};

// What each uid holds, next to the per-uid limits: what an operator reads
// when a Reserve is refused with uid_limit or uid_chunks.
TEST(CtlUids, StatusShowsEachUidNextToItsLimits) {
  std::string error;
  DaemonProcess::Options options;
  options.open_permissions = true;
  options.extra_args = {"--allowed-uids=65534", "--uid-max-bytes=64MiB", "--uid-max-chunks=3"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  std::vector<std::unique_ptr<client::Client>> clients;
  for (const char* job : {"a", "b"}) {
    client::AttachOptions attach;
    attach.runtime_dir = daemon->runtime_dir();
    attach.job_id = job;
    auto c = client::Client::Attach(attach);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE((*c)->Reserve(1, 3 * kMiB).ok());
    clients.push_back(std::move(c).value());
  }
  // uid 65534 reserves and exits: its session is gone, its chunk stays its.
  std::string out;
  ASSERT_EQ(RunCapture(std::vector<std::string>{BinDir() + "/offload_worker", "job-as",
                                                daemon->runtime_dir(), "65534", "c",
                                                std::to_string(kMiB), "0"},
                       &out),
            0)
      << out;
  auto ctl = [&](std::vector<std::string> args) {
    args.insert(args.begin(),
                {BinDir() + "/memoffloadctl", "--runtime-dir", daemon->runtime_dir()});
    EXPECT_EQ(RunCapture(args, &out), 0) << out;
  };
  for (int i = 0; i < 100 && daemon->Status().sessions() != 2; ++i) usleep(20000);
  ctl({"status"});
  const std::string me = std::to_string(getuid());
  EXPECT_NE(out.find("uid " + me + std::string(17 - me.size(), ' ') +
                     "2 sessions, 6.00 MiB of 64.00 MiB held, 1 of 3 chunks, 0 of 8192 regions "
                     "holding 0 B of 64.00 MiB"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("uid 65534            0 sessions, 0 B of 64.00 MiB held, 1 of 3 chunks"),
            std::string::npos)
      << out;
  ctl({"status", "--json"});
  auto status = ParseJson<v1::GetStatusResponse>(out);
  EXPECT_EQ(status.uid_max_bytes(), 64 * kMiB);
  EXPECT_EQ(status.uid_max_chunks(), 3u);
  ASSERT_EQ(status.uids_size(), 2) << out;
  EXPECT_EQ(status.uids(0).uid(), getuid());
  EXPECT_EQ(status.uids(0).sessions(), 2u);
  EXPECT_EQ(status.uids(0).held_bytes(), 6 * kMiB);
  EXPECT_EQ(status.uids(0).owned_chunks(), 1u);
  EXPECT_EQ(status.uids(1).uid(), 65534u);
  EXPECT_EQ(status.uids(1).sessions(), 0u);
  EXPECT_EQ(status.uids(1).owned_chunks(), 1u);
  // Both per-uid limits are set: no warning about a shared node.
  EXPECT_EQ(daemon->Log().find("opened a session while"), std::string::npos) << daemon->Log();
}

TEST_F(CtlTest, StatusHumanAndJson) {
  client::AttachOptions options;
  options.runtime_dir = daemon_->runtime_dir();
  options.job_id = "ctl-job";
  options.rank = 5;
  auto c = client::Client::Attach(options);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Reserve(1, 3 << 20).ok());

  std::string out;
  ASSERT_EQ(Ctl({"status"}, &out), 0) << out;
  EXPECT_NE(out.find("capacity             256.00 MiB"), std::string::npos) << out;
  EXPECT_NE(out.find("used                 3.00 MiB (1.2%)"), std::string::npos) << out;
  EXPECT_NE(out.find("sessions             1"), std::string::npos) << out;

  ASSERT_EQ(Ctl({"status", "--json"}, &out), 0) << out;
  auto status = ParseJson<v1::GetStatusResponse>(out);
  EXPECT_EQ(status.capacity_bytes(), 256u << 20);
  EXPECT_EQ(status.used_bytes(), 3u << 20);
  EXPECT_EQ(status.reserved_bytes(), 3u << 20);
  EXPECT_EQ(status.groups(), 1u);

  ASSERT_EQ(Ctl({"sessions"}, &out), 0) << out;
  EXPECT_NE(out.find("ctl-job"), std::string::npos) << out;
  EXPECT_NE(out.find("3.00 MiB"), std::string::npos) << out;
  ASSERT_EQ(Ctl({"--json", "sessions"}, &out), 0) << out;
  auto sessions = ParseJson<v1::ListSessionsResponse>(out);
  ASSERT_EQ(sessions.sessions_size(), 1);
  EXPECT_EQ(sessions.sessions(0).job_id(), "ctl-job");
  EXPECT_EQ(sessions.sessions(0).rank(), 5);
  EXPECT_EQ(sessions.sessions(0).pid(), getpid());
  EXPECT_EQ(sessions.sessions(0).held_bytes(), 3u << 20);
  EXPECT_EQ(sessions.sessions(0).groups(), 1u);
}

TEST_F(CtlTest, DrainAndUndrain) {
  std::string out;
  ASSERT_EQ(Ctl({"drain"}, &out), 0) << out;
  EXPECT_NE(out.find("draining"), std::string::npos) << out;
  EXPECT_TRUE(daemon_->Status().draining());
  client::AttachOptions options;
  options.runtime_dir = daemon_->runtime_dir();
  auto refused = client::Client::Attach(options);
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);

  ASSERT_EQ(Ctl({"undrain", "--json"}, &out), 0) << out;
  EXPECT_FALSE(ParseJson<v1::DrainResponse>(out).draining());
  EXPECT_FALSE(daemon_->Status().draining());
  EXPECT_TRUE(client::Client::Attach(options).ok());
}

TEST_F(CtlTest, ConfigShowsValuesAndSources) {
  std::string out;
  ASSERT_EQ(Ctl({"config"}, &out), 0) << out;
  EXPECT_NE(out.find("[arena]"), std::string::npos) << out;
  EXPECT_NE(out.find("size = 268435456  # flag"), std::string::npos) << out;
  ASSERT_EQ(Ctl({"config", "--json"}, &out), 0) << out;
  auto config = ParseJson<v1::GetConfigResponse>(out);
  bool found = false;
  for (const auto& e : config.entries()) {
    if (e.key() == "lifecycle.drain_timeout") {
      found = true;
      EXPECT_EQ(e.value(), "3000ms");
      EXPECT_EQ(e.source(), "flag");
    }
  }
  EXPECT_TRUE(found);
}

TEST_F(CtlTest, ExitCodes) {
  std::string out;
  EXPECT_EQ(Ctl({"frobnicate"}, &out), 2);
  EXPECT_EQ(Ctl({}, &out), 2);
  EXPECT_EQ(RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", "/nonexistent/dir", "status"},
                       &out),
            3);
  // Without access to the admin token, drain is refused with exit code 4.
  const std::string token = daemon_->runtime_dir() + "/admin.token";
  const std::string hidden = token + ".hidden";
  ASSERT_EQ(rename(token.c_str(), hidden.c_str()), 0);
  EXPECT_EQ(Ctl({"drain"}, &out), 4);
  ASSERT_EQ(rename(hidden.c_str(), token.c_str()), 0);
  EXPECT_FALSE(daemon_->Status().draining());
}

// Runs memoffloadctl with stderr folded into the captured output.
int CtlWithStderr(const std::string& runtime_dir, const std::string& command, std::string* out) {
  return RunCapture({"/bin/sh", "-c",
                     "exec '" + BinDir() + "/memoffloadctl' --runtime-dir '" + runtime_dir + "' " +
                         command + " 2>&1"},
                    out);
}

TEST_F(CtlTest, StoppedDaemonIsUnreachableNotPermissionDenied) {
  const std::string dir = daemon_->runtime_dir();
  const std::string socket = dir + "/memoffload.sock";
  ASSERT_EQ(daemon_->Stop(SIGTERM, 10000), 0);
  // A clean stop removed the admin token along with the sockets.
  ASSERT_NE(access((dir + "/admin.token").c_str(), F_OK), 0);
  std::string out;
  for (const std::string command : {"drain", "undrain", "status", "sessions", "config"}) {
    EXPECT_EQ(CtlWithStderr(dir, command, &out), 3) << command << ": " << out;
    EXPECT_NE(out.find("unix:" + socket), std::string::npos) << command << ": " << out;
  }
  EXPECT_EQ(CtlWithStderr("/nonexistent/dir", "status", &out), 3) << out;
  EXPECT_NE(out.find("unix:/nonexistent/dir/memoffload.sock"), std::string::npos) << out;
}

TEST_F(CtlTest, SessionsTableShowsRankPidUidAndAge) {
  client::AttachOptions options;
  options.runtime_dir = daemon_->runtime_dir();
  options.job_id = "table-job";
  options.rank = 7;
  auto c = client::Client::Attach(options);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Reserve(1, 2 << 20).ok());
  std::string out;
  ASSERT_EQ(Ctl({"sessions"}, &out), 0) << out;
  std::istringstream lines(out);
  std::string header, row;
  ASSERT_TRUE(std::getline(lines, header));
  ASSERT_TRUE(std::getline(lines, row));
  std::istringstream h(header);
  std::vector<std::string> columns{std::istream_iterator<std::string>(h), {}};
  EXPECT_EQ(columns, (std::vector<std::string>{"SESSION", "JOB", "KIND", "RANK", "PID", "UID",
                                               "HELD", "GROUPS", "BLOCKS", "AGE"}))
      << header;
  std::istringstream r(row);
  std::vector<std::string> cells{std::istream_iterator<std::string>(r), {}};
  // HELD is "2.00 MiB": two cells.
  ASSERT_EQ(cells.size(), 11u) << row;
  EXPECT_EQ(cells[1], "table-job");
  EXPECT_EQ(cells[2], "other");  // a client that does not say what it is for
  EXPECT_EQ(cells[3], "7");
  EXPECT_EQ(cells[4], std::to_string(getpid()));
  EXPECT_EQ(cells[5], std::to_string(getuid()));
  EXPECT_EQ(cells[6] + " " + cells[7], "2.00 MiB");
  EXPECT_EQ(cells[8], "1");
  EXPECT_EQ(cells[9], "0");
  EXPECT_EQ(cells[10].back(), 's') << row;
}

TEST_F(CtlTest, StatusShowsWaitingReservesAndNodeReserve) {
  std::string out;
  ASSERT_EQ(Ctl({"status"}, &out), 0) << out;
  EXPECT_NE(out.find("waiting reserves     0"), std::string::npos) << out;
  EXPECT_NE(out.find("node reserve         0 B"), std::string::npos) << out;
}

}  // namespace
}  // namespace memoffload::testing
