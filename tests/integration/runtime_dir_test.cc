// Issue 13, item 6: the runtime dir and the daemon's lifecycle. A dir another
// user can tamper with is refused; one daemon per dir (the second is told
// who holds it); an exiting daemon removes only its own files; a failed
// start leaves nothing behind and is found before the arena is built.
#include <arpa/inet.h>
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
#include <string>
#include <thread>

#include "daemon_process.h"
#include "memoffload/client/client.h"

namespace memoffload::testing {
namespace {

using Clock = std::chrono::steady_clock;

// A scratch dir (0700, root's) removed with the object.
class Scratch {
 public:
  Scratch() {
    char name[] = "/tmp/memoffload-rtdir-XXXXXX";
    path_ = mkdtemp(name);
  }
  ~Scratch() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Runs memoffloadd to its exit; returns the exit code and stderr+stdout.
int RunDaemonToExit(const std::string& args, std::string* out, int timeout_ms = 10000) {
  // timeout(1): a daemon that wrongly starts must not hang the test, which
  // reads its output to the end.
  return RunCapture({"/bin/sh", "-c",
                     "exec timeout -s KILL " + std::to_string(timeout_ms / 1000) + " " + BinDir() +
                         "/memoffloadd " + args + " 2>&1"},
                    out, timeout_ms + 5000);
}

ino_t Inode(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

TEST(RuntimeDir, DirOfAnotherUserOrWritableByOthersIsRefused) {
  Scratch scratch;
  const std::string theirs = scratch.path() + "/theirs";
  ASSERT_EQ(mkdir(theirs.c_str(), 0755), 0);
  ASSERT_EQ(chown(theirs.c_str(), 65534, 65534), 0);
  std::string out;
  EXPECT_EQ(RunDaemonToExit("--runtime-dir " + theirs + " --arena-size 4MiB --metrics-address none",
                            &out),
            1)
      << out;
  EXPECT_NE(out.find("runtime dir " + theirs + " belongs to uid 65534"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;

  const std::string open_dir = scratch.path() + "/open";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0755), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0777), 0);
  EXPECT_EQ(RunDaemonToExit(
                "--runtime-dir " + open_dir + " --arena-size 4MiB --metrics-address none", &out),
            1)
      << out;
  EXPECT_NE(out.find("runtime dir " + open_dir + " has mode 0777"), std::string::npos) << out;
  // Nothing was created in either.
  EXPECT_TRUE(std::filesystem::is_empty(theirs));
  EXPECT_TRUE(std::filesystem::is_empty(open_dir));
}

TEST(RuntimeDir, SecondDaemonIsToldTheHolderAndTheFirstKeepsItsSockets) {
  std::string error;
  auto first = DaemonProcess::Start({}, &error);
  ASSERT_NE(first, nullptr) << error;
  const std::string dir = first->runtime_dir();
  const ino_t broker = Inode(dir + "/broker.sock");
  const ino_t grpc = Inode(dir + "/memoffload.sock");
  std::string out;
  const auto start = Clock::now();
  EXPECT_EQ(
      RunDaemonToExit("--runtime-dir " + dir + " --arena-size 8MiB --metrics-address none", &out),
      1)
      << out;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_NE(out.find("another memoffloadd (pid " + std::to_string(first->pid()) + ")"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("building arena"), std::string::npos) << out;
  EXPECT_EQ(Inode(dir + "/broker.sock"), broker);
  EXPECT_EQ(Inode(dir + "/memoffload.sock"), grpc);
  EXPECT_GT(first->Status().capacity_bytes(), 0u);
  client::AttachOptions options;
  options.runtime_dir = dir;
  EXPECT_TRUE(client::Client::Attach(options).ok());
}

// An exiting daemon removed the sockets of a daemon started on the same dir
// right after it (3 of 5 tries). Now the new one cannot start until the old
// one is gone, and the old one removes only its own files.
TEST(RuntimeDir, ExitingDaemonLeavesItsSuccessorsSocketsAlone) {
  Scratch scratch;
  const std::string dir = scratch.path() + "/run";
  for (int round = 0; round < 5; ++round) {
    pid_t old_daemon = Spawn({BinDir() + "/memoffloadd", "--runtime-dir=" + dir,
                              "--arena-size=8MiB", "--metrics-address=none", "--drain-timeout=1s"},
                             nullptr);
    const auto up = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < up && !std::filesystem::exists(dir + "/broker.sock")) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(std::filesystem::exists(dir + "/broker.sock"));
    // Keep the old daemon busy while it stops: one client holds the whole
    // arena, another waits for space in a Reserve that is in flight when the
    // SIGINT comes (gRPC shutdown then waits for it before the old daemon
    // removes its files).
    client::AttachOptions attach;
    attach.runtime_dir = dir;
    auto holder = client::Client::Attach(attach);
    ASSERT_TRUE(holder.ok()) << holder.status().ToString();
    ASSERT_TRUE((*holder)->Reserve(1, 8 << 20).ok());
    auto waiter = client::Client::Attach(attach);
    ASSERT_TRUE(waiter.ok());
    std::thread waiting([&] {
      client::ReserveOptions wait;
      wait.wait_for_space = true;
      wait.wait_timeout_ms = 5000;
      // Refused or cancelled when the daemon stops, never granted.
      EXPECT_FALSE((*waiter)->Reserve(1, 4 << 20, wait).ok());
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the Reserve is in flight
    kill(old_daemon, round % 2 == 0 ? SIGINT : SIGTERM);
    pid_t new_daemon = -1;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < deadline) {
      pid_t attempt = Spawn({BinDir() + "/memoffloadd", "--runtime-dir=" + dir, "--arena-size=8MiB",
                             "--metrics-address=none"},
                            nullptr);
      // A refused start exits at once; a started one keeps running.
      const int status = WaitFor(attempt, 2000);
      if (status == -1) {
        new_daemon = attempt;
        break;
      }
    }
    waiting.join();
    ASSERT_GT(new_daemon, 0);
    ASSERT_NE(WaitFor(old_daemon, 10000), -1);
    // The old daemon is gone; the new one's sockets are there and serve.
    const auto ready = Clock::now() + std::chrono::seconds(10);
    bool served = false;
    while (Clock::now() < ready && !served) {
      client::AttachOptions options;
      options.runtime_dir = dir;
      served = client::Client::Attach(options).ok();
      if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_TRUE(served) << "round " << round;
    EXPECT_TRUE(std::filesystem::exists(dir + "/broker.sock")) << "round " << round;
    EXPECT_TRUE(std::filesystem::exists(dir + "/memoffload.sock")) << "round " << round;
    kill(new_daemon, SIGTERM);
    ASSERT_NE(WaitFor(new_daemon, 10000), -1);
  }
}

// A listening socket on a free loopback port (the caller closes it; a
// daemon started later does not inherit it).
int HoldLoopbackPort(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 1) != 0) {
    close(fd);
    return -1;
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

// Any local user could keep the daemon from starting by binding its metrics
// port first (it exited 1 in 10 ms). Now it serves without metrics, says so
// (log, /readyz "degraded"), and takes the port once it is free.
TEST(RuntimeDir, ATakenMetricsPortDoesNotStopTheDaemonWhichBindsItOnceFree) {
  int port = 0, health_port = 0;
  const int squatter = HoldLoopbackPort(&port);
  ASSERT_GE(squatter, 0);
  const int health_probe = HoldLoopbackPort(&health_port);
  ASSERT_GE(health_probe, 0);
  close(health_probe);  // free again: the daemon's health endpoint takes it
  const std::string address = "127.0.0.1:" + std::to_string(port);
  DaemonProcess::Options options;
  options.metrics_address = address;
  options.extra_args = {"--health-address=127.0.0.1:" + std::to_string(health_port)};
  std::string error;
  auto daemon = DaemonProcess::Start(options, &error);
  if (daemon == nullptr) close(squatter);
  ASSERT_NE(daemon, nullptr) << error;

  const std::string log = daemon->Log();
  EXPECT_NE(log.find("cannot listen for metrics on " + address), std::string::npos) << log;
  EXPECT_NE(log.find("serving without metrics"), std::string::npos) << log;
  EXPECT_NE(log.find("metrics not served: metrics port " + address + " is taken"),
            std::string::npos)
      << log;
  std::string ready = HttpGet(health_port, "/readyz");
  EXPECT_NE(ready.find(" 200 "), std::string::npos) << ready;
  EXPECT_NE(ready.find("degraded: metrics port " + address + " is taken"), std::string::npos)
      << ready;
  EXPECT_EQ(daemon->Status().metrics_address(), "");

  close(squatter);
  std::string metrics;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (metrics.find("memoffload_arena_capacity_bytes") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    metrics = HttpGet(port, "/metrics");
  }
  EXPECT_NE(metrics.find("memoffload_arena_capacity_bytes"), std::string::npos)
      << "metrics never served on " << address << ": " << metrics << "\n"
      << daemon->Log();
  ready = HttpGet(health_port, "/readyz");
  EXPECT_NE(ready.find("\r\n\r\nok\n"), std::string::npos) << ready;
  EXPECT_EQ(daemon->Status().metrics_address(), address);
  EXPECT_NE(daemon->Log().find("metrics: bound " + address), std::string::npos) << daemon->Log();
}

}  // namespace
}  // namespace memoffload::testing
