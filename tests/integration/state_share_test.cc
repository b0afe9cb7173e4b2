// quotas.state_share against the real daemon: a job's placed state (its
// state-kind sessions' blocks) holds at most that share of the job's limit,
// the usable arena when the job has none; the job's activations keep the
// rest; a hello's max_bytes lowers one state session below it; SIGHUP
// changes it for the sessions already there.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "daemon_process.h"
#include "memoffload/client/admin.h"
#include "memoffload/client/client.h"
#include "memoffload/client/host_blocks.h"
#include "memoffload/common/units.h"

namespace memoffload::testing {
namespace {

using client::HostBlocks;
using Clock = std::chrono::steady_clock;

std::unique_ptr<DaemonProcess> StartDaemon(std::vector<std::string> extra = {},
                                           std::string metrics_address = "none") {
  DaemonProcess::Options options;
  options.metrics_address = std::move(metrics_address);
  options.extra_args = std::move(extra);
  std::string error;
  auto d = DaemonProcess::Start(options, &error);
  EXPECT_NE(d, nullptr) << error;
  return d;
}

std::shared_ptr<client::Client> Attach(const DaemonProcess& d, SessionKind kind,
                                       const std::string& job = "train", uint64_t max_bytes = 0) {
  client::AttachOptions options;
  options.runtime_dir = d.runtime_dir();
  options.job_id = job;
  options.rank = 0;
  options.kind = kind;
  options.max_bytes = max_bytes;
  auto c = client::Client::Attach(options);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::shared_ptr<client::Client>(std::move(c).value()) : nullptr;
}

// Allocates blocks of `block_bytes` until one is refused; returns how many
// were placed and the refusal in *refused.
int FillUntilRefused(HostBlocks* blocks, uint64_t block_bytes, Status* refused) {
  for (int n = 0; n < 1024; ++n) {
    Result<client::HostBlock> b = blocks->Allocate(block_bytes);
    if (!b.ok()) {
      *refused = b.status();
      return n;
    }
  }
  *refused = Status::Ok();
  return -1;
}

// The default share (0.5) of a job without a limit is half the usable
// arena: 128 MiB of 256 MiB, over two state sessions of the job. The job's
// activations still reserve the other half after the state was refused,
// and another job's state has a share of its own (what is left of it).
TEST(StateShare, StateIsRefusedAtTheShareAndActivationsStillReserve) {
  auto d = StartDaemon({}, "127.0.0.1:0");
  ASSERT_NE(d, nullptr);
  HostBlocks state(Attach(*d, SessionKind::kState));
  HostBlocks more_state(Attach(*d, SessionKind::kState));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(state.Allocate(32 * kMiB).ok());
  Status refused;
  ASSERT_EQ(FillUntilRefused(&more_state, 32 * kMiB, &refused), 2) << refused.ToString();
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  for (const char* part :
       {"state share: the placed state of job 'train' holds 128.00 MiB of its 128.00 MiB share",
        "(quotas.state_share 0.5 of the 256.00 MiB usable arena, the job having no limit)",
        "32.00 MiB more would exceed it by 32.00 MiB"}) {
    EXPECT_NE(refused.message().find(part), std::string::npos) << part << "\n" << refused.message();
  }
  // More than the whole share can never fit, and says so (a group of the
  // state session: a block is at most a chunk).
  Result<client::Reservation> whole = state.client()->Reserve(1 << 20, 129 * kMiB);
  ASSERT_EQ(whole.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(whole.status().message().find("more than the whole 128.00 MiB share"),
            std::string::npos)
      << whole.status().message();
  EXPECT_NE(whole.status().message().find("quotas.state_share"), std::string::npos);

  // The rest of the arena is the activations' (the same job).
  auto act = Attach(*d, SessionKind::kActivations);
  ASSERT_NE(act, nullptr);
  ASSERT_TRUE(act->Reserve(1, 96 * kMiB).ok());
  ASSERT_TRUE(act->Reserve(2, 32 * kMiB).ok());
  EXPECT_EQ(d->Status().used_bytes(), 256 * kMiB);
  EXPECT_EQ(d->Status().state_bytes(), 128 * kMiB);
  EXPECT_EQ(d->Status().groups(), 2u);
  EXPECT_EQ(d->Status().state_blocks(), 4u);

  const std::string addr = d->Status().metrics_address();
  const std::string metrics = HttpGet(std::stoi(addr.substr(addr.rfind(':') + 1)), "/metrics");
  EXPECT_NE(metrics.find("\nmemoffload_reserve_rejections_total{reason=\"state_share\"} 2\n"),
            std::string::npos)
      << metrics;
}

// With a job limit the share is of it (96 MiB here: 48 MiB), activations
// keep the rest of the job's limit, and a state session's own max_bytes is
// lower still.
TEST(StateShare, IsAShareOfTheJobsLimitAndAHellosMaxBytesLowersIt) {
  auto d = StartDaemon({"--job-max-bytes=96MiB"});
  ASSERT_NE(d, nullptr);
  HostBlocks state(Attach(*d, SessionKind::kState));
  Status refused;
  EXPECT_EQ(FillUntilRefused(&state, 16 * kMiB, &refused), 3);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("holds 48.00 MiB of its 48.00 MiB share (quotas.state_share "
                                   "0.5 of the job's 96.00 MiB limit)"),
            std::string::npos)
      << refused.message();
  auto act = Attach(*d, SessionKind::kActivations);
  ASSERT_TRUE(act->Reserve(1, 48 * kMiB).ok());
  Result<client::Reservation> over = act->Reserve(2, 4096);
  ASSERT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("job limit"), std::string::npos)
      << over.status().message();

  // Another job, a state session asking for 8 MiB: its own limit first.
  HostBlocks small(Attach(*d, SessionKind::kState, "eval", 8 * kMiB));
  EXPECT_EQ(FillUntilRefused(&small, 4 * kMiB, &refused), 2);
  EXPECT_NE(refused.message().find("session limit"), std::string::npos) << refused.message();
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string ConfigValue(const DaemonProcess& d, const std::string& key, std::string* source) {
  auto admin = client::AdminClient::Connect(d.runtime_dir());
  if (!admin.ok()) return "";
  auto config = (*admin)->GetConfig();
  if (!config.ok()) return "";
  for (const auto& e : config->entries()) {
    if (e.key() != key) continue;
    if (source != nullptr) *source = e.source();
    return e.value();
  }
  return "";
}

// SIGHUP changes the share of the sessions already attached: the state that
// was refused at a quarter fits at three quarters, and a lower share keeps
// what is placed but refuses more.
TEST(StateShare, SighupChangesTheShareOfTheSessionsAlreadyThere) {
  char dir[] = "/tmp/memoffload-share-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/memoffloadd.toml";
  WriteFile(path, "[quotas]\nstate_share = 0.25\n");
  auto d = StartDaemon({"--config=" + path});
  ASSERT_NE(d, nullptr);
  std::string source;
  EXPECT_EQ(ConfigValue(*d, "quotas.state_share", &source), "0.25");
  EXPECT_EQ(source, "file");
  HostBlocks state(Attach(*d, SessionKind::kState));
  Status refused;
  EXPECT_EQ(FillUntilRefused(&state, 32 * kMiB, &refused), 2);  // 64 MiB of 256 MiB
  EXPECT_NE(refused.message().find("of its 64.00 MiB share (quotas.state_share 0.25"),
            std::string::npos)
      << refused.message();

  WriteFile(path, "[quotas]\nstate_share = 0.75\n");
  kill(d->pid(), SIGHUP);
  const auto start = Clock::now();
  while (ConfigValue(*d, "quotas.state_share", nullptr) != "0.75" &&
         Clock::now() - start < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(ConfigValue(*d, "quotas.state_share", nullptr), "0.75");
  EXPECT_NE(d->Log().find("config quotas.state_share: 0.25 -> 0.75\n"), std::string::npos)
      << d->Log();
  EXPECT_EQ(FillUntilRefused(&state, 32 * kMiB, &refused), 4);  // 192 MiB now
  EXPECT_NE(refused.message().find("holds 192.00 MiB of its 192.00 MiB share"), std::string::npos)
      << refused.message();
  EXPECT_EQ(d->Status().state_share(), 0.75);

  WriteFile(path, "[quotas]\nstate_share = 0.5\n");
  kill(d->pid(), SIGHUP);
  const auto again = Clock::now();
  while (ConfigValue(*d, "quotas.state_share", nullptr) != "0.5" &&
         Clock::now() - again < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(d->Status().state_bytes(), 192 * kMiB);  // kept
  Result<client::HostBlock> more = state.Allocate(4096);
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(more.status().message().find("holds 192.00 MiB of its 128.00 MiB share"),
            std::string::npos)
      << more.status().message();

  // A value out of range is rejected and the share in force stays.
  WriteFile(path, "[quotas]\nstate_share = 1.5\n");
  kill(d->pid(), SIGHUP);
  const auto bad = Clock::now();
  while (d->Log().find("config reload rejected") == std::string::npos &&
         Clock::now() - bad < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(d->Log().find("quotas.state_share: '1.5' is not a fraction in (0, 1]"),
            std::string::npos)
      << d->Log();
  EXPECT_EQ(ConfigValue(*d, "quotas.state_share", nullptr), "0.5");
  unlink(path.c_str());
  rmdir(dir);
}

}  // namespace
}  // namespace memoffload::testing
