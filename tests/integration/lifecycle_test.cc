// Session lifeline, shutdown, and start-up refusals of the real daemon.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include "daemon_process.h"
#include "memoffload/client/client.h"

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
  Result<client::Reservation> refused = client.Reserve(2, 4096);
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("draining"), std::string::npos);
  auto late = client::Client::Attach(options);
  EXPECT_EQ(late.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(late.status().message().find("draining"), std::string::npos);
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

TEST(Lifecycle, BadFlagsExitNonZeroWithOneLine) {
  int out = -1;
  pid_t p = Spawn({BinDir() + "/memoffloadd", "--arena-size=lots"}, &out);
  int status = WaitFor(p, 10000);
  close(out);
  ASSERT_NE(status, -1);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
}

// Fetches /metrics over plain HTTP on loopback.
std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  if (write(fd, req.data(), req.size()) < 0) return "";
  std::string body;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) body.append(buf, n);
  close(fd);
  return body;
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
  auto c = client::Client::Attach(attach);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Reserve(1, 1 << 20).ok());
  EXPECT_EQ((*c)->Reserve(1, 1 << 20).status().code(), StatusCode::kFailedPrecondition);
  const std::string metrics = HttpGet(port, "/metrics");
  EXPECT_NE(metrics.find("memoffload_arena_capacity_bytes 268435456"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("memoffload_arena_bytes{state=\"reserved\"} 1048576"), std::string::npos);
  EXPECT_NE(metrics.find("memoffload_sessions 1"), std::string::npos);
  EXPECT_NE(metrics.find("memoffload_requests_total{code=\"OK\",method=\"Reserve\"} 1"),
            std::string::npos);
  EXPECT_NE(
      metrics.find("memoffload_requests_total{code=\"FAILED_PRECONDITION\",method=\"Reserve\"} 1"),
      std::string::npos);  // One tenant, nothing changed hands: exported, and zero.
  EXPECT_NE(metrics.find("\nmemoffload_chunks_zeroed_total 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nmemoffload_chunk_zeroing_seconds_total 0\n"), std::string::npos);
}

}  // namespace
}  // namespace memoffload::testing
