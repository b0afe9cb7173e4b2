// Session lifeline, shutdown, and start-up refusals of the real daemon.
#include <grp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::string ReadLine(int fd) {
  std::string line;
  char c;
  while (read(fd, &c, 1) == 1 && c != '\n') line.push_back(c);
  return line;
}

TEST(Lifecycle, KilledClientsBytesAreBackWithinOneSecond) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  int out = -1;
  pid_t worker =
      Spawn({BinDir() + "/offload_worker", "hold", daemon->runtime_dir(), "6", "8388608"}, &out);
  const std::string line = ReadLine(out);
  close(out);
  ASSERT_EQ(line, "HELD 50331648") << daemon->Log();
  v1::GetStatusResponse before = daemon->Status();
  EXPECT_EQ(before.used_bytes(), 48u << 20);
  EXPECT_EQ(before.sessions(), 1u);

  const auto killed_at = Clock::now();
  kill(worker, SIGKILL);
  v1::GetStatusResponse after;
  while (Clock::now() - killed_at < std::chrono::seconds(1)) {
    after = daemon->Status();
    if (after.used_bytes() == 0 && after.sessions() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - killed_at).count();
  WaitFor(worker, 1000);
  EXPECT_EQ(after.used_bytes(), 0u) << "reclaimed after " << seconds << " s";
  EXPECT_EQ(after.free_bytes(), after.capacity_bytes());
  EXPECT_EQ(after.sessions(), 0u);
  EXPECT_LT(seconds, 1.0);
  EXPECT_NE(daemon->Log().find("closed (lifeline_closed)"), std::string::npos);
}

TEST(Lifecycle, DestroyedClientEndsItsSession) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  {
    client::AttachOptions options;
    options.runtime_dir = daemon->runtime_dir();
    auto c = client::Client::Attach(options);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE((*c)->Reserve(1, 1 << 20).ok());
    EXPECT_EQ(daemon->Status().sessions(), 1u);
  }
  const auto start = Clock::now();
  while (daemon->Status().sessions() != 0 && Clock::now() - start < std::chrono::seconds(2)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(daemon->Status().sessions(), 0u);
  EXPECT_EQ(daemon->Status().used_bytes(), 0u);
}

TEST(Lifecycle, SigtermExitsZeroAndRemovesSockets) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  client::AttachOptions options;
  options.runtime_dir = daemon->runtime_dir();
  auto c = client::Client::Attach(options);  // an idle attached session does not block exit
  ASSERT_TRUE(c.ok());
  const std::string dir = daemon->runtime_dir();
  const auto start = Clock::now();
  int status = daemon->Stop(SIGTERM, 10000);
  ASSERT_NE(status, -1) << "daemon did not stop";
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  EXPECT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << daemon->Log();
  EXPECT_FALSE(std::filesystem::exists(dir + "/broker.sock"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/memoffload.sock"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/admin.token"));
  EXPECT_NE(daemon->Log().find("stopped cleanly"), std::string::npos);
  // The client sees the daemon gone as UNAVAILABLE, not a crash.
  EXPECT_EQ((*c)->Reserve(2, 4096).status().code(), StatusCode::kUnavailable);
}

TEST(Lifecycle, SigtermDrainsUntilGroupsAreReleased) {
  std::string error;
  DaemonProcess::Options opts;
  opts.drain_timeout = "20s";
  auto daemon = DaemonProcess::Start(opts, &error);
  ASSERT_NE(daemon, nullptr) << error;
  client::AttachOptions options;
  options.runtime_dir = daemon->runtime_dir();
  auto c = client::Client::Attach(options);
  ASSERT_TRUE(c.ok());
  auto& client = **c;
  ASSERT_TRUE(client.Reserve(1, 1 << 20).ok());
  kill(daemon->pid(), SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // Still serving the group it holds, but refusing new work.
  EXPECT_TRUE(daemon->Status().draining());
  // The refusals say why, without suggesting an undrain that cannot help.
  Result<client::Reservation> refused = client.Reserve(2, 4096);
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("shutting down"), std::string::npos)
      << refused.status().message();
  EXPECT_EQ(refused.status().message().find("undrain"), std::string::npos)
      << refused.status().message();
  // The daemon answered: the message must not say it did not.
  EXPECT_EQ(refused.status().message().find("did not answer"), std::string::npos)
      << refused.status().message();
  auto late = client::Client::Attach(options);
  EXPECT_EQ(late.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(late.status().message().find("shutting down"), std::string::npos)
      << late.status().message();
  EXPECT_EQ(late.status().message().find("undrain"), std::string::npos) << late.status().message();
  // An operator's undrain cannot cancel the SIGTERM drain.
  std::string out;
  EXPECT_EQ(RunCapture({"/bin/sh", "-c",
                        "exec '" + BinDir() + "/memoffloadctl' --runtime-dir '" +
                            daemon->runtime_dir() + "' undrain 2>&1"},
                       &out),
            1)
      << out;
  EXPECT_NE(out.find("shutting down"), std::string::npos) << out;
  EXPECT_TRUE(daemon->Status().draining());
  EXPECT_EQ(client.Reserve(2, 4096).status().code(), StatusCode::kUnavailable);
  ASSERT_TRUE(client.Commit(1, 1 << 20).ok());
  ASSERT_TRUE(client.Prefetch(1).ok());
  ASSERT_TRUE(client.Release(1).ok());
  const auto released = Clock::now();
  int status = daemon->Wait(5000);
  ASSERT_NE(status, -1) << daemon->Log();
  EXPECT_LT(Clock::now() - released, std::chrono::seconds(1));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_NE(daemon->Log().find("drained: no groups held"), std::string::npos) << daemon->Log();
}

TEST(Lifecycle, SigtermDrainDeadlineWithGroupsHeldStillExitsZero) {
  std::string error;
  DaemonProcess::Options opts;
  opts.drain_timeout = "1s";
  auto daemon = DaemonProcess::Start(opts, &error);
  ASSERT_NE(daemon, nullptr) << error;
  client::AttachOptions options;
  options.runtime_dir = daemon->runtime_dir();
  auto c = client::Client::Attach(options);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Reserve(1, 1 << 20).ok());  // held through the whole drain
  const auto start = Clock::now();
  kill(daemon->pid(), SIGTERM);
  int status = daemon->Wait(10000);
  const auto took = Clock::now() - start;
  ASSERT_NE(status, -1) << daemon->Log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << daemon->Log();
  EXPECT_GE(took, std::chrono::milliseconds(900));
  EXPECT_LT(took, std::chrono::milliseconds(2500));
  EXPECT_NE(daemon->Log().find("drain deadline passed with 1.00 MiB still held by 1 sessions"),
            std::string::npos)
      << daemon->Log();
}

// Issue 39: while draining, every attach of an ordinary trainer trying
// again was a WARN ("attach refused"), and one that had not yet read its
// refusal when the daemon closed the connection a second one ("left replies
// unread ... connection slot stays taken"), as if it were hostile. Now a
// refusal while draining is INFO, and only a peer that still has not read
// what it was sent a sweep later is a WARN.
TEST(Lifecycle, OrdinaryAttachesRefusedWhileDrainingAreNoWarnings) {
  std::string error;
  DaemonProcess::Options opts;
  opts.drain_timeout = "3s";
  auto daemon = DaemonProcess::Start(opts, &error);
  ASSERT_NE(daemon, nullptr) << error;
  client::AttachOptions options;
  options.runtime_dir = daemon->runtime_dir();
  auto held = client::Client::Attach(options);
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE((*held)->Reserve(1, 1 << 20).ok());  // keeps the daemon draining
  kill(daemon->pid(), SIGTERM);
  const auto until = Clock::now() + std::chrono::seconds(2);
  while (daemon->Log().find("draining") == std::string::npos && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int i = 0; i < 12; ++i) {
    auto refused = client::Client::Attach(options);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().ToString();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // past two linger sweeps
  const std::string log = daemon->Log();
  EXPECT_NE(
      log.find("INFO attach of pid " + std::to_string(getpid()) + " uid 0 refused while draining"),
      std::string::npos)
      << log;
  EXPECT_EQ(log.find("WARN attach refused"), std::string::npos) << log;
  EXPECT_EQ(log.find("has not read what the daemon sent"), std::string::npos) << log;
  EXPECT_EQ(log.find("left replies unread"), std::string::npos) << log;
  held->reset();
  EXPECT_NE(daemon->Wait(10000), -1) << daemon->Log();
}

TEST(Lifecycle, SocketsAreMode0660AndOwnedByTheSocketGroup) {
  // "daemon" (gid 1 on Debian) is a group root may hand the sockets to.
  const group* daemon_group = getgrnam("daemon");
  ASSERT_NE(daemon_group, nullptr) << "this test needs the 'daemon' group";
  const gid_t gid = daemon_group->gr_gid;
  ASSERT_NE(gid, getegid());  // else the chown would prove nothing
  std::string error;
  DaemonProcess::Options opts;
  opts.extra_args = {"--socket-group=daemon"};
  auto daemon = DaemonProcess::Start(opts, &error);
  ASSERT_NE(daemon, nullptr) << error;
  for (const char* name : {"/broker.sock", "/memoffload.sock"}) {
    struct stat st;
    ASSERT_EQ(stat((daemon->runtime_dir() + name).c_str(), &st), 0) << name;
    EXPECT_TRUE(S_ISSOCK(st.st_mode)) << name;
    EXPECT_EQ(st.st_mode & 07777, 0660u) << name << std::oct << " mode " << (st.st_mode & 07777);
    EXPECT_EQ(st.st_gid, gid) << name;
  }
  // Without socket_group the daemon's own group keeps them, same mode.
  auto plain = DaemonProcess::Start({}, &error);
  ASSERT_NE(plain, nullptr) << error;
  for (const char* name : {"/broker.sock", "/memoffload.sock"}) {
    struct stat st;
    ASSERT_EQ(stat((plain->runtime_dir() + name).c_str(), &st), 0) << name;
    EXPECT_EQ(st.st_mode & 07777, 0660u) << name;
    EXPECT_EQ(st.st_gid, getegid()) << name;
  }
}

TEST(Lifecycle, SecondDaemonOnSameDirIsRefused) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  int out = -1;
  pid_t second = Spawn({BinDir() + "/memoffloadd", "--runtime-dir=" + daemon->runtime_dir(),
                        "--arena-size=8MiB", "--metrics-address=none"},
                       &out);
  int status = WaitFor(second, 20000);
  close(out);
  ASSERT_NE(status, -1);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0);
  // The first daemon is unharmed.
  EXPECT_GT(daemon->Status().capacity_bytes(), 0u);
}

TEST(Lifecycle, UnusableRuntimeDirIsOneLineNamingThePath) {
  std::string out;
  // RunCapture collects stdout; the daemon reports on stderr, so send it there.
  const std::string dir = "/nonexistent-parent/memoffload";
  int code = RunCapture({"/bin/sh", "-c",
                         BinDir() + "/memoffloadd --runtime-dir " + dir +
                             " --arena-size 4MiB --metrics-address none 2>&1"},
                        &out);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("cannot create runtime dir " + dir), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
}

TEST(Lifecycle, UnwritableRuntimeDirIsOneLineNamingThePath) {
  // As root every existing directory is writable (access(2) ignores the
  // mode), so the unusable dir is one whose parent is a regular file.
  char scratch[] = "/tmp/memoffload-rundir-XXXXXX";
  ASSERT_NE(mkdtemp(scratch), nullptr);
  const std::string file = std::string(scratch) + "/file";
  { std::ofstream(file) << "not a directory\n"; }
  const std::string dir = file + "/dir";
  std::string out;
  int code = RunCapture({"/bin/sh", "-c",
                         BinDir() + "/memoffloadd --runtime-dir " + dir +
                             " --arena-size 4MiB --metrics-address none 2>&1"},
                        &out);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find(dir), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  if (geteuid() != 0) {
    // Not root: an existing directory without write permission.
    const std::string locked = std::string(scratch) + "/locked";
    ASSERT_EQ(mkdir(locked.c_str(), 0500), 0);
    code = RunCapture({"/bin/sh", "-c",
                       BinDir() + "/memoffloadd --runtime-dir " + locked +
                           " --arena-size 4MiB --metrics-address none 2>&1"},
                      &out);
    EXPECT_EQ(code, 1) << out;
    EXPECT_NE(out.find("runtime dir " + locked + " is not writable"), std::string::npos) << out;
    rmdir(locked.c_str());
  }
  unlink(file.c_str());
  rmdir(scratch);
}

TEST(Lifecycle, BadFlagsExitNonZeroWithOneLine) {
  int out = -1;
  pid_t p = Spawn({BinDir() + "/memoffloadd", "--arena-size=lots"}, &out);
  int status = WaitFor(p, 10000);
  close(out);
  ASSERT_NE(status, -1);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
}

TEST(Lifecycle, MetricsEndpointReportsArenaAndRequests) {
  std::string error;
  DaemonProcess::Options options;
  options.metrics_address = "127.0.0.1:0";
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string addr = daemon->Status().metrics_address();
  ASSERT_FALSE(addr.empty());
  const int port = std::stoi(addr.substr(addr.rfind(':') + 1));
  client::AttachOptions attach;
  attach.runtime_dir = daemon->runtime_dir();
  attach.job_id = "lifecycle";
  attach.rank = 3;
  auto c = client::Client::Attach(attach);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Reserve(1, 1 << 20).ok());
  EXPECT_EQ((*c)->Reserve(1, 1 << 20).status().code(), StatusCode::kFailedPrecondition);
  // Counted under the session's job and rank (the series the session holds).
  ASSERT_TRUE((*c)->Reserve(2, 8192).ok());
  ASSERT_TRUE((*c)->Commit(2, 5000).ok());
  ASSERT_TRUE((*c)->Prefetch(2).ok());
  ASSERT_TRUE((*c)->Release(2).ok());
  const std::string metrics = HttpGet(port, "/metrics");
  EXPECT_NE(metrics.find("\nmemoffload_rank_offload_bytes_total{job_id=\"lifecycle\",rank=\"3\"} "
                         "5000\n"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("\nmemoffload_rank_prefetch_bytes_total{job_id=\"lifecycle\",rank=\"3\"} "
                         "5000\n"),
            std::string::npos);
  EXPECT_NE(metrics.find("\nmemoffload_internal_errors_total{where=\"session_table_free\"} 0\n"),
            std::string::npos);
  EXPECT_NE(metrics.find("memoffload_arena_capacity_bytes 268435456"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("memoffload_arena_bytes{state=\"reserved\"} 1048576"), std::string::npos);
  EXPECT_NE(metrics.find("memoffload_sessions 1"), std::string::npos);
  EXPECT_NE(metrics.find("memoffload_requests_total{code=\"OK\",method=\"Reserve\"} 2"),
            std::string::npos);
  EXPECT_NE(
      metrics.find("memoffload_requests_total{code=\"FAILED_PRECONDITION\",method=\"Reserve\"} 1"),
      std::string::npos);  // One tenant, nothing changed hands: exported, and zero.
  EXPECT_NE(metrics.find("\nmemoffload_chunk_backings_replaced_total 0\n"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("\nmemoffload_stale_backing_bytes 0\n"), std::string::npos);
}

// Issue 29: /metrics is not behind the access list (any local user can read
// it) and its per-rank series carry the job id each client named.
// metrics.job_labels = hash shows the first 12 hex digits of the job id's
// SHA-256 instead (what `sha256sum` prints, so an operator can match it),
// none no per-rank series at all; the node totals count either way.
TEST(Lifecycle, MetricsJobLabelsHashOrNoneKeepJobIdsOffTheScrape) {
  const std::string job = "secret-job-29";
  std::string digest;
  ASSERT_EQ(RunCapture({"/bin/sh", "-c", "printf %s '" + job + "' | sha256sum"}, &digest), 0);
  ASSERT_GE(digest.size(), 64u) << digest;
  const std::string hashed = digest.substr(0, 12);
  for (const std::string mode : {"hash", "none"}) {
    SCOPED_TRACE(mode);
    std::string error;
    DaemonProcess::Options options;
    options.metrics_address = "127.0.0.1:0";
    options.extra_args = {"--metrics-job-labels=" + mode};
    auto daemon = DaemonProcess::Start(options, &error);
    ASSERT_NE(daemon, nullptr) << error;
    const std::string addr = daemon->Status().metrics_address();
    ASSERT_FALSE(addr.empty());
    client::AttachOptions attach;
    attach.runtime_dir = daemon->runtime_dir();
    attach.job_id = job;
    attach.rank = 3;
    auto c = client::Client::Attach(attach);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE((*c)->Reserve(1, 8192).ok());
    ASSERT_TRUE((*c)->Commit(1, 5000).ok());
    const std::string metrics = HttpGet(std::stoi(addr.substr(addr.rfind(':') + 1)), "/metrics");
    ASSERT_NE(metrics.find("\nmemoffload_offload_bytes_total 5000\n"), std::string::npos)
        << metrics;
    EXPECT_EQ(metrics.find(job), std::string::npos) << metrics;
    const std::string ranked =
        "\nmemoffload_rank_offload_bytes_total{job_id=\"" + hashed + "\",rank=\"3\"} 5000\n";
    if (mode == "hash") {
      EXPECT_NE(metrics.find(ranked), std::string::npos) << metrics;
    } else {
      EXPECT_EQ(metrics.find("memoffload_rank_"), std::string::npos) << metrics;
    }
  }
}

// The value of the first sample line starting with `series` (-1 if none).
double Sample(const std::string& metrics, const std::string& series) {
  size_t at = metrics.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(metrics.substr(at + series.size() + 2));
}

TEST(Lifecycle, RefusedAttachIsCountedByReason) {
  std::string error;
  DaemonProcess::Options options;
  options.metrics_address = "127.0.0.1:0";
  options.open_permissions = true;
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string addr = daemon->Status().metrics_address();
  const int port = std::stoi(addr.substr(addr.rfind(':') + 1));
  const std::string series = "memoffload_attach_refusals_total{reason=\"access_denied\"}";
  const double before = Sample(HttpGet(port, "/metrics"), series);
  EXPECT_EQ(before, 0) << HttpGet(port, "/metrics");
  for (int i = 0; i < 2; ++i) {
    std::string out;
    EXPECT_EQ(
        RunCapture({BinDir() + "/offload_worker", "attach-as", daemon->runtime_dir(), "65534"},
                   &out),
        1)
        << out;
  }
  EXPECT_EQ(Sample(HttpGet(port, "/metrics"), series), before + 2);
}

}  // namespace
}  // namespace memoffload::testing
