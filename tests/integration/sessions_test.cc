// Access policy, quotas, waiting reserves, pidfd reclaim and SIGHUP reload,
// against the real daemon.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/admin.h"
#include "memoffload/client/client.h"

namespace memoffload::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMiB = 1 << 20;

std::unique_ptr<client::Client> Attach(const DaemonProcess& d, const std::string& job = "job",
                                       uint64_t max_bytes = 0) {
  client::AttachOptions options;
  options.runtime_dir = d.runtime_dir();
  options.job_id = job;
  options.max_bytes = max_bytes;
  auto c = client::Client::Attach(options);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

TEST(Access, OtherUidIsRefusedWithReasonUnlessAllowed) {
  std::string error;
  DaemonProcess::Options options;
  options.open_permissions = true;
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  std::string out;
  int code =
      RunCapture({BinDir() + "/offload_worker", "attach-as", daemon->runtime_dir(), "65534"}, &out);
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.rfind("ERR PERMISSION_DENIED", 0), 0u) << out;
  EXPECT_NE(out.find("uid 65534"), std::string::npos) << out;
  EXPECT_NE(out.find("access.allowed_uids"), std::string::npos) << out;
  EXPECT_NE(daemon->Log().find("attach refused"), std::string::npos);
  EXPECT_EQ(daemon->Status().sessions(), 0u);

  options.extra_args = {"--allowed-uids=65534"};
  auto allowing = DaemonProcess::Start(options, &error);
  ASSERT_NE(allowing, nullptr) << error;
  code = RunCapture({BinDir() + "/offload_worker", "attach-as", allowing->runtime_dir(), "65534"},
                    &out);
  EXPECT_EQ(code, 0) << out << allowing->Log();
  EXPECT_EQ(out, "OK\n");

  // A member of an allowed group by a supplementary group (what `usermod -aG
  // memoffload alice` makes) is let in; the same uid without it is not.
  options.extra_args = {"--allowed-gids=4242"};
  auto by_group = DaemonProcess::Start(options, &error);
  ASSERT_NE(by_group, nullptr) << error;
  code = RunCapture(
      {BinDir() + "/offload_worker", "attach-as", by_group->runtime_dir(), "65534", "4242"}, &out);
  EXPECT_EQ(code, 0) << out << by_group->Log();
  EXPECT_EQ(out, "OK\n");
  code = RunCapture({BinDir() + "/offload_worker", "attach-as", by_group->runtime_dir(), "65534"},
                    &out);
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.rfind("ERR PERMISSION_DENIED", 0), 0u) << out;

  // The socket group's members need no access list: the 0660 sockets let
  // them connect, so they may attach.
  options.extra_args = {"--socket-group=4243"};
  auto by_socket_group = DaemonProcess::Start(options, &error);
  ASSERT_NE(by_socket_group, nullptr) << error;
  code = RunCapture(
      {BinDir() + "/offload_worker", "attach-as", by_socket_group->runtime_dir(), "65534", "4243"},
      &out);
  EXPECT_EQ(code, 0) << out << by_socket_group->Log();
  EXPECT_EQ(out, "OK\n");
}

TEST(Quotas, SessionAndJobLimitsAndNodeReserveNameTheLimit) {
  std::string error;
  DaemonProcess::Options options;
  options.extra_args = {"--session-max-bytes=64MiB", "--job-max-bytes=96MiB",
                        "--node-reserve-bytes=64MiB"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto a = Attach(*daemon, "train");
  auto b = Attach(*daemon, "train");
  auto small = Attach(*daemon, "eval", 8 * kMiB);  // asks for less than the default
  ASSERT_TRUE(a && b && small);

  ASSERT_TRUE(a->Reserve(1, 48 * kMiB).ok());
  auto r = a->Reserve(2, 32 * kMiB);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("session limit"), std::string::npos);
  EXPECT_NE(r.status().message().find("exceed it by 16.00 MiB"), std::string::npos)
      << r.status().message();

  ASSERT_TRUE(b->Reserve(1, 40 * kMiB).ok());
  r = b->Reserve(2, 16 * kMiB);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("job limit: job 'train' holds 88.00 MiB of its 96.00 MiB"),
            std::string::npos)
      << r.status().message();

  r = small->Reserve(1, 9 * kMiB);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("of its 8.00 MiB limit"), std::string::npos)
      << r.status().message();

  // 256 MiB arena, 64 MiB node reserve: 192 MiB usable, 88 MiB in use.
  auto c = Attach(*daemon, "third");
  auto d = Attach(*daemon, "fourth");
  ASSERT_TRUE(c->Reserve(1, 64 * kMiB).ok());
  ASSERT_TRUE(d->Reserve(1, 40 * kMiB).ok());  // 192 MiB in use now
  r = d->Reserve(2, 4096);

  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("node reserve 64.00 MiB"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(daemon->Status().node_reserve_bytes(), 64 * kMiB);
}

TEST(Quotas, SameJobIdUnderAnotherUidIsAnotherJob) {
  std::string error;
  DaemonProcess::Options options;
  options.open_permissions = true;
  options.extra_args = {"--allowed-uids=65534", "--job-max-bytes=64MiB"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto mine = Attach(*daemon, "shared");
  ASSERT_TRUE(mine);
  ASSERT_TRUE(mine->Reserve(1, 64 * kMiB).ok());  // my job's whole quota
  // Another uid naming the same job id has its own 64 MiB.
  std::string out;
  int code = RunCapture({BinDir() + "/offload_worker", "job-as", daemon->runtime_dir(), "65534",
                         "shared", std::to_string(32 * kMiB), "0"},
                        &out);
  EXPECT_EQ(code, 0) << out << daemon->Log();
  EXPECT_EQ(out.rfind("RESERVED 33554432 ", 0), 0u) << out;
  // Its small ask does not lower my job's limit: a hello asking for 4 KiB
  // that another uid sends while I hold 64 MiB is its own job's affair.
  code = RunCapture({BinDir() + "/offload_worker", "job-as", daemon->runtime_dir(), "65534",
                     "shared", "8192", "4096"},
                    &out);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("job limit: 8.00 KiB is more than the whole 4.00 KiB limit of job 'shared'"),
            std::string::npos)
      << out;
  EXPECT_EQ(mine->Reserve(2, kMiB).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(mine->Release(1).ok());
  EXPECT_TRUE(mine->Reserve(1, 64 * kMiB).ok());
}

// A job id is the client's to name: quotas.uid_max_bytes bounds all the
// sessions of one uid, whatever job ids they name, and not another uid's.
// uid 65534 (offload_worker) attaches as job "a" and reserves 32 MiB: a
// uid at its own limit leaves another uid its room.
void ExpectNobodyReserves32MiB(const DaemonProcess& daemon) {
  std::string out;
  const int code = RunCapture({BinDir() + "/offload_worker", "job-as", daemon.runtime_dir(),
                               "65534", "a", std::to_string(32 * kMiB), "0"},
                              &out);
  EXPECT_EQ(code, 0) << out << daemon.Log();
  EXPECT_EQ(out.rfind("RESERVED 33554432 ", 0), 0u) << out;
}

// A daemon that uid 65534 may attach to too, with `flags` (a per-uid limit
// among them); nullptr (after a test failure) when it does not start.
std::unique_ptr<DaemonProcess> StartWithSecondUid(std::vector<std::string> flags) {
  std::string error;
  DaemonProcess::Options options;
  options.open_permissions = true;
  options.extra_args = {"--allowed-uids=65534"};
  options.extra_args.insert(options.extra_args.end(), flags.begin(), flags.end());
  auto daemon = DaemonProcess::Start(options, &error);
  if (daemon == nullptr) ADD_FAILURE() << error;
  return daemon;
}

TEST(Quotas, AUidLimitSpansEveryJobIdTheUidNamesAndNotAnotherUid) {
  auto daemon = StartWithSecondUid({"--uid-max-bytes=64MiB"});
  ASSERT_NE(daemon, nullptr);
  auto a = Attach(*daemon, "a");
  auto b = Attach(*daemon, "b");
  auto c = Attach(*daemon, "c");
  ASSERT_TRUE(a && b && c);
  ASSERT_TRUE(a->Reserve(1, 40 * kMiB).ok());
  ASSERT_TRUE(b->Reserve(1, 24 * kMiB).ok());
  auto r = c->Reserve(1, 4096);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("uid limit: the sessions of uid " + std::to_string(getuid()) +
                                      " hold 64.00 MiB of its 64.00 MiB"),
            std::string::npos)
      << r.status().message();
  ExpectNobodyReserves32MiB(*daemon);
  ASSERT_TRUE(a->Release(1).ok());
  EXPECT_TRUE(c->Reserve(1, 40 * kMiB).ok());
}

// With tenant = job each job id is a tenant with chunks of its own: a uid
// kept one chunk from every other uid per job id it named, with 4 KiB in
// each. quotas.uid_max_chunks bounds the chunks of all its job ids.
TEST(Quotas, AUidChunkLimitSpansEveryJobIdTheUidNamesAndNotAnotherUid) {
  auto daemon = StartWithSecondUid({"--tenant=job", "--uid-max-chunks=2"});
  ASSERT_NE(daemon, nullptr);
  auto a = Attach(*daemon, "a");
  auto b = Attach(*daemon, "b");
  auto c = Attach(*daemon, "c");
  ASSERT_TRUE(a && b && c);
  ASSERT_TRUE(a->Reserve(1, 4096).ok());
  ASSERT_TRUE(b->Reserve(1, 4096).ok());
  auto r = c->Reserve(1, 4096);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("uid chunk limit: the tenants of uid " +
                                      std::to_string(getuid()) + " own 2 chunks"),
            std::string::npos)
      << r.status().message();
  // Another uid still takes a chunk of the four.
  ExpectNobodyReserves32MiB(*daemon);
  // A job's chunk passes to another job of the uid once it is empty and no
  // process of the job has it mapped.
  ASSERT_TRUE(b->Release(1).ok());
  EXPECT_EQ(c->Reserve(1, 4096).status().code(), StatusCode::kResourceExhausted);
  b.reset();
  for (int i = 0; i < 100 && daemon->Status().sessions() != 2; ++i) usleep(20000);
  r = c->Reserve(1, 4096);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(daemon->Status().owned_chunks(), 3u);
  // The chunk limit is set, the bytes limit is not: the warning names that.
  EXPECT_NE(daemon->Log().find("and quotas.uid_max_bytes is 0 (no limit): one uid can hold the "
                               "whole arena"),
            std::string::npos)
      << daemon->Log();
}

TEST(Tenants, JobTenantsOfDifferentUidsDoNotShareChunks) {
  std::string error;
  DaemonProcess::Options options;
  options.open_permissions = true;
  options.extra_args = {"--allowed-uids=65534", "--tenant=job"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto mine = Attach(*daemon, "shared");
  ASSERT_TRUE(mine);
  auto r = mine->Reserve(1, kMiB);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const std::string my_chunk = std::to_string(r->extents[0].chunk);
  std::string out;
  int code = RunCapture({BinDir() + "/offload_worker", "job-as", daemon->runtime_dir(), "65534",
                         "shared", std::to_string(kMiB), "0"},
                        &out);
  ASSERT_EQ(code, 0) << out << daemon->Log();
  unsigned long reserved = 0;
  char refused[256] = {0}, got[256] = {0};
  ASSERT_EQ(
      std::sscanf(out.c_str(), "RESERVED %lu REFUSED %255s GOT %255s", &reserved, refused, got), 3)
      << out;
  // The other uid's "shared" is another tenant: my chunk's fd is refused and
  // its bytes land elsewhere.
  EXPECT_NE(("," + std::string(refused) + ",").find("," + my_chunk + ","), std::string::npos)
      << out;
  EXPECT_EQ(("," + std::string(got) + ",").find("," + my_chunk + ","), std::string::npos) << out;
  // No per-uid limit is set: the operator is told once that one uid can take
  // the arena from the other.
  const std::string warning = "WARN uid 65534 opened a session while uid " +
                              std::to_string(getuid()) +
                              " has sessions, and quotas.uid_max_bytes and uid_max_chunks are 0";
  const std::string log = daemon->Log();
  EXPECT_NE(log.find(warning), std::string::npos) << log;
  EXPECT_EQ(log.find("opened a session while", log.find(warning) + warning.size()),
            std::string::npos)
      << log;
}

TEST(Quotas, WaitingReserveIsServedWhenAnotherSessionReleases) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto holder = Attach(*daemon);
  auto waiter = Attach(*daemon);
  ASSERT_TRUE(holder->Reserve(1, 200 * kMiB).ok());
  std::thread releaser([&] {
    const auto start = Clock::now();
    while (daemon->Status().waiting_reserves() == 0 &&
           Clock::now() - start < std::chrono::seconds(5)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(holder->Release(1).ok());
  });
  client::ReserveOptions wait;
  wait.wait_for_space = true;
  wait.wait_timeout_ms = 10000;
  auto r = waiter->Reserve(1, 100 * kMiB, wait);
  releaser.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->reserved_bytes, 100 * kMiB);
  EXPECT_EQ(daemon->Status().waiting_reserves(), 0u);
}

TEST(Quotas, WaitingReserveTimesOutAtItsDeadline) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto holder = Attach(*daemon);
  auto waiter = Attach(*daemon);
  ASSERT_TRUE(holder->Reserve(1, 200 * kMiB).ok());
  client::ReserveOptions wait;
  wait.wait_for_space = true;
  wait.wait_timeout_ms = 400;
  const auto start = Clock::now();
  auto r = waiter->Reserve(1, 100 * kMiB, wait);
  const auto waited = Clock::now() - start;
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  EXPECT_NE(r.status().message().find("until the deadline"), std::string::npos)
      << r.status().message();
  EXPECT_GE(waited, std::chrono::milliseconds(300));
  EXPECT_LT(waited, std::chrono::seconds(2));
  // Without wait_for_space the same request fails at once.
  const auto now = Clock::now();
  EXPECT_EQ(waiter->Reserve(1, 100 * kMiB).status().code(), StatusCode::kResourceExhausted);
  EXPECT_LT(Clock::now() - now, std::chrono::milliseconds(200));
}

TEST(Lifeline, ChildHoldingTheSocketDoesNotKeepADeadParentsMemory) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  int out = -1;
  pid_t parent =
      Spawn({BinDir() + "/offload_worker", "fork-hold", daemon->runtime_dir(), "16777216"}, &out);
  std::string line;
  char ch;
  while (read(out, &ch, 1) == 1 && ch != '\n') line.push_back(ch);
  close(out);
  unsigned long held = 0;
  int child = 0;
  ASSERT_EQ(std::sscanf(line.c_str(), "HELD %lu %d", &held, &child), 2) << line;
  EXPECT_EQ(held, 16 * kMiB);
  EXPECT_EQ(daemon->Status().used_bytes(), 16 * kMiB);

  const auto killed = Clock::now();
  kill(parent, SIGKILL);
  WaitFor(parent, 2000);
  v1::GetStatusResponse s;
  while (Clock::now() - killed < std::chrono::seconds(1)) {
    s = daemon->Status();
    if (s.used_bytes() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(s.used_bytes(), 0u) << "the child still holds the socket; pidfd must reclaim";
  EXPECT_EQ(s.sessions(), 0u);
  EXPECT_EQ(kill(child, 0), 0) << "the child should still be alive";
  EXPECT_NE(daemon->Log().find("closed (process_exited)"), std::string::npos) << daemon->Log();
  kill(child, SIGKILL);
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string ConfigValue(const DaemonProcess& d, const std::string& key) {
  auto admin = client::AdminClient::Connect(d.runtime_dir());
  auto config = (*admin)->GetConfig();
  if (!config.ok()) return "";
  for (const auto& e : config->entries()) {
    if (e.key() == key) return e.value();
  }
  return "";
}

std::string ConfigSource(const DaemonProcess& d, const std::string& key) {
  auto admin = client::AdminClient::Connect(d.runtime_dir());
  auto config = (*admin)->GetConfig();
  if (!config.ok()) return "";
  for (const auto& e : config->entries()) {
    if (e.key() == key) return e.source();
  }
  return "";
}

TEST(Reload, SighupAppliesAValidFileAndRejectsAnInvalidOne) {
  std::string error;
  DaemonProcess::Options options;
  char dir[] = "/tmp/memoffload-reload-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/memoffloadd.toml";
  WriteFile(path, "[quotas]\nsession_max_bytes = \"1MiB\"\n");
  options.extra_args = {"--config=" + path};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto c = Attach(*daemon);
  EXPECT_EQ(c->Reserve(1, 2 * kMiB).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ConfigValue(*daemon, "quotas.session_max_bytes"), "1048576");

  // Settings that need a restart are logged as such and keep their value and
  // source; access.tenant is one of them. Region limits apply at once.
  WriteFile(path,
            "[server]\nlog_level = \"warn\"\n[access]\ntenant = \"job\"\n"
            "[quotas]\nsession_max_bytes = \"4MiB\"\n[regions]\nmax_per_job = 7\n");
  kill(daemon->pid(), SIGHUP);
  const auto start = Clock::now();
  while (ConfigValue(*daemon, "quotas.session_max_bytes") != "4194304" &&
         Clock::now() - start < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(ConfigValue(*daemon, "quotas.session_max_bytes"), "4194304");
  EXPECT_EQ(ConfigSource(*daemon, "quotas.session_max_bytes"), "file");
  EXPECT_EQ(ConfigValue(*daemon, "server.log_level"), "info");
  EXPECT_EQ(ConfigSource(*daemon, "server.log_level"), "default");
  EXPECT_EQ(ConfigValue(*daemon, "access.tenant"), "uid");
  EXPECT_EQ(ConfigSource(*daemon, "access.tenant"), "default");
  EXPECT_NE(daemon->Log().find("config access.tenant: uid -> job (takes effect at restart)"),
            std::string::npos)
      << daemon->Log();
  EXPECT_NE(daemon->Log().find("config server.log_level: info -> warn (takes effect at restart)"),
            std::string::npos)
      << daemon->Log();
  EXPECT_EQ(ConfigValue(*daemon, "regions.max_per_job"), "7");
  EXPECT_EQ(ConfigSource(*daemon, "regions.max_per_job"), "file");
  EXPECT_NE(daemon->Log().find("config regions.max_per_job: 1024 -> 7\n"), std::string::npos)
      << daemon->Log();
  // The new limit applies to the existing session too.
  EXPECT_TRUE(c->Reserve(1, 2 * kMiB).ok());
  auto fresh = Attach(*daemon);
  EXPECT_EQ(fresh->Reserve(1, 5 * kMiB).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(daemon->Status().sessions(), 2u);

  WriteFile(path, "[quotas]\nsession_max_bytes = \"lots\"\n");
  kill(daemon->pid(), SIGHUP);
  const auto wait = Clock::now();
  while (daemon->Log().find("config reload rejected") == std::string::npos &&
         Clock::now() - wait < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(daemon->Log().find("config reload rejected, keeping the previous configuration: "
                               "config file " +
                               path + ": quotas.session_max_bytes"),
            std::string::npos)
      << daemon->Log();
  EXPECT_EQ(ConfigValue(*daemon, "quotas.session_max_bytes"), "4194304");
  EXPECT_EQ(daemon->Status().sessions(), 2u);  // no session dropped
  unlink(path.c_str());
  rmdir(dir);
}

// Waits up to 5 s for `text` in the daemon's log.
bool WaitForLog(const DaemonProcess& d, const std::string& text) {
  const auto start = Clock::now();
  while (d.Log().find(text) == std::string::npos) {
    if (Clock::now() - start > std::chrono::seconds(5)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

TEST(Reload, NodeReserveIsCheckedAgainstTheRunningArena) {
  std::string error;
  DaemonProcess::Options options;
  char dir[] = "/tmp/memoffload-reload-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/memoffloadd.toml";
  WriteFile(path,
            "[arena]\nsize = \"256MiB\"\nchunk_size = \"64MiB\"\n"
            "[quotas]\nnode_reserve_bytes = \"64MiB\"\n");
  options.arena_size = "";  // from the file, so a reload may name another size
  options.chunk_size = "";
  options.extra_args = {"--config=" + path};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  ASSERT_EQ(daemon->Status().capacity_bytes(), 256 * kMiB);
  ASSERT_EQ(daemon->Status().node_reserve_bytes(), 64 * kMiB);

  // Valid for the 1 GiB arena the file names, but the running arena is
  // 256 MiB: the reserve would leave nothing (and wrapped the usable size).
  WriteFile(path,
            "[arena]\nsize = \"1GiB\"\nchunk_size = \"64MiB\"\n"
            "[quotas]\nnode_reserve_bytes = \"512MiB\"\n");
  kill(daemon->pid(), SIGHUP);
  ASSERT_TRUE(WaitForLog(*daemon, "config reload rejected")) << daemon->Log();
  EXPECT_NE(daemon->Log().find("quotas.node_reserve_bytes 512.00 MiB (536870912 bytes) leaves "
                               "nothing of the running 256.00 MiB (268435456 bytes) arena"),
            std::string::npos)
      << daemon->Log();
  EXPECT_EQ(daemon->Status().node_reserve_bytes(), 64 * kMiB);
  EXPECT_EQ(ConfigValue(*daemon, "quotas.node_reserve_bytes"), "67108864");
  // The old reserve still holds: 192 MiB usable.
  auto c = Attach(*daemon);
  EXPECT_EQ(c->Reserve(1, 200 * kMiB).status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(c->Reserve(1, 192 * kMiB).ok());
  unlink(path.c_str());
  rmdir(dir);
}

}  // namespace
}  // namespace memoffload::testing
