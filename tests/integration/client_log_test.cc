// The client's log (memoffload/client/log.h) against the real daemon: the
// attach line and the restart line go through the installed sink, with the
// session's rank, never straight to stderr; the default line names the rank
// only when it is known; the daemon's own lines never say "rank -1".
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/client/log.h"

namespace memoffload::testing {
namespace {

using client::LogLevel;
using client::LogRecord;

std::mutex g_mu;
std::vector<LogRecord>* g_records = nullptr;  // GUARDED_BY(g_mu)

void Capture(LogRecord record) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_records != nullptr) g_records->push_back(std::move(record));
}

// Captures what the client logs while it lives; the sink before it is put back.
class CapturedLog {
 public:
  CapturedLog() {
    std::lock_guard<std::mutex> lock(g_mu);
    g_records = &records_;
    previous_ = client::SetLogSink(Capture);
  }
  ~CapturedLog() {
    client::SetLogSink(previous_);
    std::lock_guard<std::mutex> lock(g_mu);
    g_records = nullptr;
  }
  std::vector<LogRecord> Take() {
    std::lock_guard<std::mutex> lock(g_mu);
    return std::exchange(records_, {});
  }

 private:
  std::vector<LogRecord> records_;
  client::LogSink previous_ = nullptr;
};

std::string Hex16(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

std::string Messages(const std::vector<LogRecord>& records) {
  std::string all;
  for (const LogRecord& r : records) all += "[" + std::to_string(r.rank) + "] " + r.message + "\n";
  return all;
}

TEST(ClientLog, TheDefaultLineNamesTheRankOnlyWhenKnown) {
  EXPECT_EQ(client::FormatLogLine({LogLevel::kInfo, StatusCode::kOk, 3, "x"}),
            "memoffload: rank 3: x");
  EXPECT_EQ(client::FormatLogLine({LogLevel::kInfo, StatusCode::kOk, -1, "x"}), "memoffload: x");
}

TEST(ClientLog, AttachAndRestartLinesGoThroughTheSinkWithTheRank) {
  std::string error;
  DaemonProcess::Options options;
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  CapturedLog log;
  client::AttachOptions attach;
  attach.runtime_dir = daemon->runtime_dir();
  attach.job_id = "log-test";
  attach.rank = 4;
  auto first = client::Client::Attach(attach);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  std::vector<LogRecord> records = log.Take();
  ASSERT_EQ(records.size(), 1u) << Messages(records);
  EXPECT_EQ(records[0].level, LogLevel::kInfo);
  EXPECT_EQ(records[0].rank, 4);
  EXPECT_EQ(records[0].message, "session " + std::to_string((*first)->session_id()) +
                                    " on memoffloadd instance " + Hex16((*first)->instance_id()) +
                                    " (" + daemon->runtime_dir() + ")");
  // The daemon names the rank it was told, and no rank it was not told.
  EXPECT_NE(daemon->Log().find("job 'log-test', rank 4 ("), std::string::npos) << daemon->Log();
  attach.rank = -1;
  auto second = client::Client::Attach(attach);  // same instance: nothing to say
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_TRUE(log.Take().empty());
  EXPECT_EQ(daemon->Log().find("rank -1"), std::string::npos) << daemon->Log();
  const uint64_t old_instance = (*first)->instance_id();
  second->reset();
  first->reset();

  // A new instance on the same runtime dir: one warning naming both.
  daemon->Stop(SIGTERM, 10000);
  options.runtime_dir = daemon->runtime_dir();
  auto restarted = DaemonProcess::Start(options, &error);
  ASSERT_NE(restarted, nullptr) << error;
  attach.rank = 4;
  auto third = client::Client::Attach(attach);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  records = log.Take();
  ASSERT_EQ(records.size(), 1u) << Messages(records);
  EXPECT_EQ(records[0].level, LogLevel::kWarning);
  EXPECT_EQ(records[0].rank, 4);
  EXPECT_NE(records[0].message.find("(was " + Hex16(old_instance) + ": the daemon of " +
                                    restarted->runtime_dir() + " restarted)"),
            std::string::npos)
      << records[0].message;
}

}  // namespace
}  // namespace memoffload::testing
