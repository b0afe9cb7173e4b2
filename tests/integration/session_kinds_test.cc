// Every session says what it is for (its hello's kind), and the real daemon
// shows it: memoffloadctl sessions (KIND and BLOCKS columns, --json), status
// (sessions by kind, placed state apart from groups) and /metrics. A state
// session's blocks are not counted as groups anywhere.
#include <gtest/gtest.h>
#include <unistd.h>

#include <iterator>
#include <map>
#include <sstream>

#include "ctl_json.h"
#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/client/host_blocks.h"
#include "memoffload/common/units.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

// One session of each kind in job "kinds": activations holding one 3 MiB
// group, state holding two placed 1 MiB blocks, checkpoints and other
// (a tool) holding nothing.
class SessionKinds : public ::testing::Test {
 protected:
  // Metrics only where a test reads them: their listener takes about 2 s
  // to stop.
  virtual bool WithMetrics() const { return false; }
  void SetUp() override {
    DaemonProcess::Options options;
    if (WithMetrics()) options.metrics_address = "127.0.0.1:0";
    std::string error;
    daemon_ = DaemonProcess::Start(options, &error);
    ASSERT_NE(daemon_, nullptr) << error;
    for (SessionKind kind : {SessionKind::kActivations, SessionKind::kState,
                             SessionKind::kCheckpoints, SessionKind::kOther}) {
      client::AttachOptions attach;
      attach.runtime_dir = daemon_->runtime_dir();
      attach.job_id = "kinds";
      attach.rank = static_cast<int>(kind);
      attach.kind = kind;
      auto c = client::Client::Attach(attach);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      clients_.push_back(std::move(c).value());
    }
    ASSERT_TRUE(clients_[0]->Reserve(1, 3 * kMiB).ok());
    blocks_ = std::make_unique<client::HostBlocks>(clients_[1]);
    for (int i = 0; i < 2; ++i) {
      Result<client::HostBlock> b = blocks_->Allocate(kMiB);
      ASSERT_TRUE(b.ok()) << b.status().ToString();
    }
  }
  int Ctl(std::vector<std::string> args, std::string* out) {
    args.insert(args.begin(),
                {BinDir() + "/memoffloadctl", "--runtime-dir", daemon_->runtime_dir()});
    return RunCapture(args, out);
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::vector<std::shared_ptr<client::Client>> clients_;
  std::unique_ptr<client::HostBlocks> blocks_;
};

TEST_F(SessionKinds, SessionsShowEachKindAndAStateSessionsBlocksAreNotGroups) {
  std::string out;
  ASSERT_EQ(Ctl({"--json", "sessions"}, &out), 0) << out;
  auto list = ParseJson<v1::ListSessionsResponse>(out);
  ASSERT_EQ(list.sessions_size(), 4) << out;
  std::map<std::string, v1::SessionInfo> by_kind;
  for (const auto& s : list.sessions()) by_kind[s.kind()] = s;
  ASSERT_EQ(by_kind.size(), 4u) << out;
  EXPECT_EQ(by_kind["activations"].groups(), 1u);
  EXPECT_EQ(by_kind["activations"].blocks(), 0u);
  EXPECT_EQ(by_kind["activations"].held_bytes(), 3 * kMiB);
  EXPECT_EQ(by_kind["state"].groups(), 0u);
  EXPECT_EQ(by_kind["state"].blocks(), 2u);
  EXPECT_EQ(by_kind["state"].held_bytes(), 2 * kMiB);
  EXPECT_EQ(by_kind["checkpoints"].held_bytes(), 0u);
  EXPECT_EQ(by_kind["other"].groups(), 0u);

  ASSERT_EQ(Ctl({"sessions"}, &out), 0) << out;
  std::istringstream lines(out);
  std::string header;
  ASSERT_TRUE(std::getline(lines, header));
  std::istringstream h(header);
  std::vector<std::string> columns{std::istream_iterator<std::string>(h), {}};
  EXPECT_EQ(columns, (std::vector<std::string>{"SESSION", "JOB", "KIND", "RANK", "PID", "UID",
                                               "HELD", "GROUPS", "BLOCKS", "AGE"}))
      << header;
  std::map<std::string, std::vector<std::string>> rows;
  for (std::string row; std::getline(lines, row);) {
    std::istringstream r(row);
    std::vector<std::string> cells{std::istream_iterator<std::string>(r), {}};
    ASSERT_EQ(cells.size(), 11u) << row;  // HELD is two cells ("2.00 MiB")
    EXPECT_EQ(cells[1], "kinds") << row;
    rows[cells[2]] = cells;
  }
  ASSERT_EQ(rows.size(), 4u) << out;
  EXPECT_EQ(rows["state"][6] + " " + rows["state"][7], "2.00 MiB");
  EXPECT_EQ(rows["state"][8], "0");  // GROUPS
  EXPECT_EQ(rows["state"][9], "2");  // BLOCKS
  EXPECT_EQ(rows["activations"][8], "1");
  EXPECT_EQ(rows["activations"][9], "0");
  EXPECT_EQ(rows["checkpoints"][3], std::to_string(static_cast<int>(SessionKind::kCheckpoints)));
}

TEST_F(SessionKinds, StatusCountsSessionsByKindAndPlacedStateApartFromGroups) {
  std::string out;
  ASSERT_EQ(Ctl({"status", "--json"}, &out), 0) << out;
  auto status = ParseJson<v1::GetStatusResponse>(out);
  EXPECT_EQ(status.sessions(), 4u);
  EXPECT_EQ(status.groups(), 1u);  // the activations' group; not the two blocks
  EXPECT_EQ(status.state_blocks(), 2u);
  EXPECT_EQ(status.state_bytes(), 2 * kMiB);
  EXPECT_EQ(status.state_share(), 0.5);
  ASSERT_EQ(status.kinds_size(), 4) << out;
  const char* const names[] = {"other", "activations", "state", "checkpoints"};
  const uint64_t held[] = {0, 3 * kMiB, 2 * kMiB, 0};
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(status.kinds(k).kind(), names[k]);
    EXPECT_EQ(status.kinds(k).sessions(), 1u) << names[k];
    EXPECT_EQ(status.kinds(k).held_bytes(), held[k]) << names[k];
  }

  ASSERT_EQ(Ctl({"status"}, &out), 0) << out;
  for (const char* line :
       {"\nsessions             4\n", "\n  other              1 holding 0 B\n",
        "\n  activations        1 holding 3.00 MiB\n",
        "\n  state              1 holding 2.00 MiB in 2 blocks (at most quotas.state_share 0.5 "
        "of a job's limit)\n",
        "\n  checkpoints        1 holding 0 B\n", "\ngroups               1\n"}) {
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
  }

  // Blocks freed are gone from the state's count; the group stays a group.
  blocks_.reset();
  status = daemon_->Status();
  EXPECT_EQ(status.state_blocks(), 0u);
  EXPECT_EQ(status.state_bytes(), 0u);
  EXPECT_EQ(status.groups(), 1u);
}

class SessionKindsMetrics : public SessionKinds {
 protected:
  bool WithMetrics() const override { return true; }
};

TEST_F(SessionKindsMetrics, CountSessionsByKindAndPlacedStateInTheirOwnSeries) {
  const std::string addr = daemon_->Status().metrics_address();
  ASSERT_FALSE(addr.empty());
  const std::string metrics = HttpGet(std::stoi(addr.substr(addr.rfind(':') + 1)), "/metrics");
  for (const char* series : {
           "\nmemoffload_sessions 4\n",
           "\nmemoffload_sessions_by_kind{kind=\"other\"} 1\n",
           "\nmemoffload_sessions_by_kind{kind=\"activations\"} 1\n",
           "\nmemoffload_sessions_by_kind{kind=\"state\"} 1\n",
           "\nmemoffload_sessions_by_kind{kind=\"checkpoints\"} 1\n",
           "\nmemoffload_groups 1\n",
           "\nmemoffload_state_blocks 2\n",
           "\nmemoffload_state_bytes 2097152\n",
       }) {
    EXPECT_NE(metrics.find(series), std::string::npos) << series << "\n" << metrics;
  }
}

}  // namespace
}  // namespace memoffload::testing
