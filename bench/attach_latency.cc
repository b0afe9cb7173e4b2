// Attach latency for memoffload-bench attach: a client's connect to its first
// writable extent, next to a raw Unix-socket floor measured in the same run.
//
// One sample of each, interleaved so that load from other processes hits both
// alike:
//  - attach: Client::Attach (broker connect, hello, attach reply with the
//    chunk fds, gRPC channel), a first Reserve of 1 MiB, and one byte written
//    into its first extent; then Release and the client's end. The attach
//    reply carries everything the client needs: no second channel, no
//    GetStatus.
//  - floor: socket + connect to a Unix socket served by a thread of this
//    process, sendmsg of a hello-sized message, recvmsg of a reply carrying
//    one fd (as the attach reply does), close. No daemon logic at all.
#include "attach_latency.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "memoffload/common/units.h"
#include "memoffload/shared_mem/fd_passing.h"

namespace memoffload::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kHelloBytes = 64;

double MillisecondsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  return v[i];
}

sockaddr_un AddressOf(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  return addr;
}

// The floor's server: answers every connection's one message with one fd.
class FloorServer {
 public:
  ~FloorServer() { Stop(); }

  Status Start(const std::string& path) {
    path_ = path;
    listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_un addr = AddressOf(path);
    if (listen_fd_ < 0 ||
        bind(listen_fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(listen_fd_, 64) != 0) {
      return Internal("floor socket " + path + ": " + std::strerror(errno));
    }
    memfd_ = memfd_create("memoffload-attach-floor", MFD_CLOEXEC);
    if (memfd_ < 0) return Internal(std::string("memfd_create: ") + std::strerror(errno));
    thread_ = std::thread([this] { Serve(); });
    return Status::Ok();
  }

  void Stop() {
    if (thread_.joinable()) {
      stop_.store(true);
      shutdown(listen_fd_, SHUT_RDWR);
      thread_.join();
    }
    if (listen_fd_ >= 0) close(listen_fd_);
    if (memfd_ >= 0) close(memfd_);
    listen_fd_ = memfd_ = -1;
    if (!path_.empty()) unlink(path_.c_str());
  }

 private:
  void Serve() {
    while (!stop_.load()) {
      const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      char buf[kHelloBytes];
      if (recv(conn, buf, sizeof(buf), 0) > 0) {
        if (Status st = SendFrame(conn, "reply", {memfd_}); !st.ok()) {
          std::fprintf(stderr, "attach: floor reply: %s\n", st.ToString().c_str());
        }
      }
      close(conn);
    }
  }

  std::string path_;
  int listen_fd_ = -1;
  int memfd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

Result<double> OneFloorSample(const std::string& path) {
  const auto start = Clock::now();
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const sockaddr_un addr = AddressOf(path);
  if (fd < 0 || connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) close(fd);
    return Internal("floor connect: " + std::string(std::strerror(errno)));
  }
  char hello[kHelloBytes] = {1};
  iovec iov{hello, sizeof(hello)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (sendmsg(fd, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(hello))) {
    close(fd);
    return Internal("floor sendmsg: " + std::string(std::strerror(errno)));
  }
  std::string payload;
  std::vector<int> fds;
  Status st = RecvFrame(fd, &payload, &fds);
  const double ms = MillisecondsSince(start);
  CloseFds(&fds);
  close(fd);
  if (!st.ok()) return st;
  return ms;
}

// {Attach returned, first extent written}, in ms from the start.
Result<std::pair<double, double>> OneAttachSample(const client::AttachOptions& options) {
  const auto start = Clock::now();
  Result<std::unique_ptr<client::Client>> c = client::Client::Attach(options);
  if (!c.ok()) return c.status();
  const double attached = MillisecondsSince(start);
  Result<client::Reservation> r = (*c)->Reserve(1, kMiB);
  if (!r.ok()) return r.status();
  uint8_t* first = (*c)->Address(r->extents.at(0));
  if (first == nullptr) return Internal("the first extent is not mapped");
  *first = 1;  // writable
  const double ms = MillisecondsSince(start);
  MEMOFFLOAD_RETURN_IF_ERROR((*c)->Release(1));
  return std::make_pair(attached, ms);
}

}  // namespace

Result<AttachLatency> MeasureAttachLatency(const client::AttachOptions& options,
                                           const std::string& scratch_dir, int samples) {
  FloorServer floor;
  const std::string floor_path = scratch_dir + "/floor.sock";
  MEMOFFLOAD_RETURN_IF_ERROR(floor.Start(floor_path));
  std::vector<double> attach, call, raw;
  for (int i = 0; i < samples; ++i) {
    Result<std::pair<double, double>> a = OneAttachSample(options);
    if (!a.ok()) return a.status();
    Result<double> f = OneFloorSample(floor_path);
    if (!f.ok()) return f.status();
    call.push_back(a->first);
    attach.push_back(a->second);
    raw.push_back(*f);
  }
  AttachLatency out;
  out.samples = samples;
  out.p50_ms = Percentile(attach, 0.50);
  out.p99_ms = Percentile(attach, 0.99);
  out.call_p50_ms = Percentile(call, 0.50);
  out.floor_p50_ms = Percentile(raw, 0.50);
  out.floor_p99_ms = Percentile(raw, 0.99);
  return out;
}

}  // namespace memoffload::bench
