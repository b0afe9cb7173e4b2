// The HTTP health listener (server.health_address) of the real daemon:
// readiness and liveness across drain, malformed and stalled clients, and
// shutdown.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

using Clock = std::chrono::steady_clock;

// A loopback TCP port that was free a moment ago.
int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Sends `request` raw and returns the whole response ("" when refused).
std::string Send(int port, const std::string& request) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return "";
  if (!request.empty() && write(fd, request.data(), request.size()) < 0) {
    close(fd);
    return "";
  }
  std::string out = ReadUntilClosed(fd);
  close(fd);
  return out;
}

std::string Get(int port, const std::string& path) {
  return Send(port,
              "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nUser-Agent: kube-probe\r\n\r\n");
}

std::string StatusLine(const std::string& response) {
  return response.substr(0, response.find("\r\n"));
}
std::string Body(const std::string& response) {
  const size_t end = response.find("\r\n\r\n");
  return end == std::string::npos ? "" : response.substr(end + 4);
}

class HealthTest : public ::testing::Test {
 protected:
  void StartDaemon(const std::string& drain_timeout = "3s") {
    port_ = FreePort();
    DaemonProcess::Options options;
    options.drain_timeout = drain_timeout;
    options.extra_args = {"--health-address=127.0.0.1:" + std::to_string(port_)};
    std::string error;
    daemon_ = DaemonProcess::Start(options, &error);
    ASSERT_NE(daemon_, nullptr) << error;
  }
  void ExpectServing() {
    for (const char* path : {"/healthz", "/readyz", "/livez"}) {
      const std::string r = Get(port_, path);
      EXPECT_EQ(StatusLine(r), "HTTP/1.1 200 OK") << path << "\n" << r << daemon_->Log();
      EXPECT_EQ(Body(r), "ok\n") << path;
    }
  }
  void ExpectDraining() {
    for (const char* path : {"/healthz", "/readyz"}) {
      const std::string r = Get(port_, path);
      EXPECT_EQ(StatusLine(r), "HTTP/1.1 503 Service Unavailable") << path << "\n" << r;
      EXPECT_EQ(Body(r), "draining\n") << path;
    }
    // Liveness stays up: restarting a draining daemon would drop its sessions.
    const std::string live = Get(port_, "/livez");
    EXPECT_EQ(StatusLine(live), "HTTP/1.1 200 OK") << live;
    EXPECT_EQ(Body(live), "draining\n");
  }
  int Ctl(const std::string& command) {
    std::string out;
    return RunCapture(
        {BinDir() + "/memoffloadctl", "--runtime-dir", daemon_->runtime_dir(), command}, &out);
  }

  int port_ = 0;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(HealthTest, ServingAfterReadyNotReadyWhileDrainingAgainAfterUndrain) {
  StartDaemon();
  ExpectServing();
  client::AttachOptions options;
  options.runtime_dir = daemon_->runtime_dir();
  auto c = client::Client::Attach(options);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Reserve(1, 1 << 20).ok());
  ASSERT_EQ(Ctl("drain"), 0);
  ExpectDraining();
  ASSERT_EQ(Ctl("undrain"), 0);
  ExpectServing();
}

TEST_F(HealthTest, SigtermDrainIsNotReadyThenTheListenerCloses) {
  StartDaemon("20s");
  client::AttachOptions options;
  options.runtime_dir = daemon_->runtime_dir();
  auto c = client::Client::Attach(options);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Reserve(1, 1 << 20).ok());
  kill(daemon_->pid(), SIGTERM);
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (StatusLine(Get(port_, "/readyz")) == "HTTP/1.1 200 OK" && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ExpectDraining();
  ASSERT_TRUE((*c)->Commit(1, 1 << 20).ok());
  ASSERT_TRUE((*c)->Prefetch(1).ok());
  ASSERT_TRUE((*c)->Release(1).ok());
  const int status = daemon_->Wait(5000);
  ASSERT_NE(status, -1) << daemon_->Log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << daemon_->Log();
  EXPECT_EQ(ConnectLoopback(port_), -1) << "the health port still accepts after the daemon stopped";
}

TEST_F(HealthTest, MalformedRequestsGet400AndTheDaemonKeepsServing) {
  StartDaemon();
  const std::vector<std::string> garbage = {
      "\r\n\r\n",
      "GARBAGE\r\n\r\n",
      "GET /readyz\r\n\r\n",
      "GET /readyz HTTP/9.9\r\n\r\n",
      std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 15),  // TLS-ish
      std::string(4096, 'A'),  // no line end, over the 2 KiB limit
      "GET /" + std::string(8192, 'x') + " HTTP/1.1\r\n\r\n",
  };
  for (const std::string& request : garbage) {
    const std::string r = Send(port_, request);
    EXPECT_EQ(StatusLine(r), "HTTP/1.1 400 Bad Request") << request.substr(0, 40) << "\n" << r;
  }
  EXPECT_EQ(StatusLine(Get(port_, "/nope")), "HTTP/1.1 404 Not Found");
  EXPECT_EQ(StatusLine(Send(port_, "DELETE /readyz HTTP/1.1\r\n\r\n")),
            "HTTP/1.1 405 Method Not Allowed");
  const std::string head = Send(port_, "HEAD /readyz HTTP/1.0\r\n\r\n");
  EXPECT_EQ(StatusLine(head), "HTTP/1.1 200 OK");
  EXPECT_EQ(Body(head), "");
  ExpectServing();
  EXPECT_GT(daemon_->Status().capacity_bytes(), 0u);
}

TEST_F(HealthTest, StalledAndFloodingClientsCannotHangTheDaemon) {
  StartDaemon();
  // Half a request, then silence: closed after the request timeout (2 s).
  const int stalled = ConnectLoopback(port_);
  ASSERT_GE(stalled, 0);
  ASSERT_EQ(write(stalled, "GET /rea", 8), 8);
  const auto start = Clock::now();
  EXPECT_EQ(ReadUntilClosed(stalled, 10000), "");  // closed without an answer
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(waited, 4.0) << "a stalled probe connection stayed open";
  close(stalled);
  // More idle connections than the server keeps: probes, the broker and
  // gRPC are still answered at once.
  std::vector<int> idle;
  for (int i = 0; i < 100; ++i) idle.push_back(ConnectLoopback(port_));
  ExpectServing();
  EXPECT_GT(daemon_->Status().capacity_bytes(), 0u);
  client::AttachOptions options;
  options.runtime_dir = daemon_->runtime_dir();
  EXPECT_TRUE(client::Client::Attach(options).ok());
  // A client that vanishes mid-request.
  for (int i = 0; i < 20; ++i) {
    const int fd = ConnectLoopback(port_);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(write(fd, "GET /readyz HTT", 15), 15);
    close(fd);
  }
  ExpectServing();
  for (int fd : idle) {
    if (fd >= 0) close(fd);
  }
  ExpectServing();
  EXPECT_EQ(daemon_->Stop(SIGTERM, 10000) != -1, true) << daemon_->Log();
}

TEST(HealthConfig, PrintConfigShowsTheSettingAndABusyPortIsOneClearError) {
  std::string out;
  ASSERT_EQ(RunCapture({BinDir() + "/memoffloadd", "--print-config"}, &out), 0) << out;
  EXPECT_NE(out.find("health_address = \"none\"  # default"), std::string::npos) << out;
  ASSERT_EQ(
      RunCapture({BinDir() + "/memoffloadd", "--health-address=0.0.0.0:9478", "--print-config"},
                 &out),
      0)
      << out;
  EXPECT_NE(out.find("health_address = \"0.0.0.0:9478\"  # flag"), std::string::npos) << out;

  // The port is taken: the daemon refuses to start, naming the address.
  const int port = FreePort();
  int holder = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(holder, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(holder, 1), 0);
  char dir[] = "/tmp/memoffload-health-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const int code = RunCapture({"/bin/sh", "-c",
                               BinDir() + "/memoffloadd --runtime-dir " + dir +
                                   "/rt --arena-size 8MiB --metrics-address none "
                                   "--health-address " +
                                   address + " 2>&1"},
                              &out);
  close(holder);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("cannot listen for health probes on " + address), std::string::npos) << out;
  RunCapture({"/bin/rm", "-rf", dir}, &out);
}

}  // namespace
}  // namespace memoffload::testing
