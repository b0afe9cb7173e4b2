// Stop 28's adversarial run: a raw HTTP/2 peer on memoffload.sock that
// keeps its flow-control window at 0 never lets the daemon send a reply
// body, so each of its calls stays open until the peer goes. Calls on gRPC's
// synchronous pool held a daemon thread each: 8 connections of 250 calls to
// GetStatus made 2,023 threads, and under a task limit `memoffloadctl
// status` failed. Now every method of the service and health use the
// callback API (no thread per call; the region calls since issue 38), the
// synchronous pool (reflection's) is bounded, and so are the calls one
// connection may have open.
#include <grp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "daemon_process.h"

namespace memoffload::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::string H2Frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
  std::string f(9, '\0');
  const uint32_t len = static_cast<uint32_t>(payload.size());
  f[0] = static_cast<char>(len >> 16);
  f[1] = static_cast<char>(len >> 8);
  f[2] = static_cast<char>(len);
  f[3] = static_cast<char>(type);
  f[4] = static_cast<char>(flags);
  f[5] = static_cast<char>((stream >> 24) & 0x7f);
  f[6] = static_cast<char>(stream >> 16);
  f[7] = static_cast<char>(stream >> 8);
  f[8] = static_cast<char>(stream);
  return f + payload;
}

// An HPACK header field, literal without indexing, new name.
std::string Header(const std::string& name, const std::string& value) {
  return std::string(1, '\0') + static_cast<char>(name.size()) + name +
         static_cast<char>(value.size()) + value;
}

// Opens a connection that announces an initial window of 0 and starts
// `calls` unary calls to `method` (an empty request each), then reads and
// acknowledges nothing (`method` a name of memoffload.v1.Offload, or a
// whole path). Returns the socket, or -1.
int StallCalls(const std::string& socket_path, const std::string& method, int calls) {
  const int fd = ConnectUnix(socket_path);
  if (fd < 0) return -1;
  const std::string window_zero = std::string{0x00, 0x04, 0x00, 0x00, 0x00, 0x00};
  std::string out = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + H2Frame(4, 0, 0, window_zero);
  const std::string headers =
      Header(":method", "POST") + Header(":scheme", "http") +
      Header(":path", method[0] == '/' ? method : "/memoffload.v1.Offload/" + method) +
      Header(":authority", "localhost") + Header("content-type", "application/grpc") +
      Header("te", "trailers");
  for (int i = 0; i < calls; ++i) {
    const uint32_t stream = 1 + 2 * static_cast<uint32_t>(i);
    out += H2Frame(1, 0x4, stream, headers);               // HEADERS, END_HEADERS
    out += H2Frame(0, 0x1, stream, std::string(5, '\0'));  // an empty message, END_STREAM
  }
  for (size_t off = 0; off < out.size();) {
    const ssize_t n = send(fd, out.data() + off, out.size() - off, MSG_NOSIGNAL);
    if (n <= 0) {
      close(fd);
      return -1;
    }
    off += static_cast<size_t>(n);
  }
  return fd;
}

TEST(StalledStreams, CallsWhoseRepliesAreNeverTakenHoldBoundedThreads) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string sock = daemon->runtime_dir() + "/memoffload.sock";
  const int before = ThreadCount(daemon->pid());
  ASSERT_GT(before, 0);
  std::vector<int> held;
  for (const char* method :
       {"GetStatus", "GetStatus", "ListSessions", "ListRegions", "ListRegions"}) {
    held.push_back(StallCalls(sock, method, 100));
    ASSERT_GE(held.back(), 0) << method;
  }
  // Give the daemon time to take every call; watch its thread count.
  int most = before;
  const auto until = Clock::now() + std::chrono::seconds(2);
  while (Clock::now() < until) {
    most = std::max(most, ThreadCount(daemon->pid()));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // 500 stalled calls add none (every method is a callback since issue 38;
  // a few of gRPC's own threads may come and go).
  EXPECT_LE(most - before, 8) << "threads " << before << " -> " << most;
  // The daemon answers as usual meanwhile.
  const auto start = Clock::now();
  EXPECT_GT(daemon->Status().capacity_bytes(), 0u);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(1));
  for (int fd : held) close(fd);
}

// Issue 38: the region calls were still on the synchronous pool. A uid
// that kept its window at 0 and sent region calls (ListRegions needs no
// session) held all 64 of its threads: every other uid's CreateRegion failed
// with "Server Threadpool Exhausted" (RESOURCE_EXHAUSTED, so the writer did
// not even fall back to files). Now they are callbacks: uid 65534 holds 200
// stalled region calls while root saves a checkpoint, and the daemon's
// threads stay where they were.
TEST(StalledStreams, StalledRegionCallsOfOneUidLeaveAnotherUidsSaveWorking) {
  std::string error;
  auto daemon = DaemonProcess::Start(TwoTenantOptions("64MiB", "16MiB"), &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string sock = daemon->runtime_dir() + "/memoffload.sock";
  const int before = ThreadCount(daemon->pid());
  ASSERT_GT(before, 0);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t stalling = fork();
  ASSERT_GE(stalling, 0);
  if (stalling == 0) {  // uid 65534: 200 region calls and 50 health checks, never read
    close(ready[0]);
    if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    const int a = StallCalls(sock, "ListRegions", 100);
    const int b = StallCalls(sock, "CreateRegion", 100);
    const int c = StallCalls(sock, "/grpc.health.v1.Health/Check", 50);  // a callback too
    const char ok = (a >= 0 && b >= 0 && c >= 0) ? '1' : '0';
    if (write(ready[1], &ok, 1) != 1) _exit(3);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char ok = 0;
  ASSERT_EQ(read(ready[0], &ok, 1), 1);
  close(ready[0]);
  EXPECT_EQ(ok, '1') << "uid 65534 could not open its stalled calls";
  int most = before;
  const auto until = Clock::now() + std::chrono::seconds(2);
  while (Clock::now() < until) {
    most = std::max(most, ThreadCount(daemon->pid()));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // Root saves a checkpoint region meanwhile: create, write, commit, read.
  for (const char* name : {"step-1/__0_0.distcp", "step-1/.metadata"}) {
    std::string out;
    const auto start = Clock::now();
    EXPECT_EQ(RunCapture({BinDir() + "/region_worker", "write", daemon->runtime_dir(), "train",
                          name, std::to_string(1 << 20), "commit"},
                         &out),
              0)
        << out;
    EXPECT_EQ(out, "OK\n") << name;
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5)) << name;
    most = std::max(most, ThreadCount(daemon->pid()));
  }
  // 200 stalled region calls hold no thread (a few of gRPC's own may come
  // and go); on the synchronous pool they took 64.
  EXPECT_LE(most - before, 8) << "threads " << before << " -> " << most;
  kill(stalling, SIGKILL);
  WaitFor(stalling, 5000);
}

}  // namespace
}  // namespace memoffload::testing
