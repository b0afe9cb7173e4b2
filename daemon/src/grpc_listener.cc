#include "memoffload/daemon/grpc_listener.h"

#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "memoffload/daemon/log.h"

namespace memoffload::daemon {

namespace asio = boost::asio;
using boost::system::error_code;

namespace {
constexpr std::chrono::milliseconds kFirstBackoff{10};
constexpr std::chrono::milliseconds kMaxBackoff{1000};
// Accepts per wake-up, so that a flood cannot keep the event loop to itself.
constexpr int kAcceptsPerRound = 64;
}  // namespace

GrpcListener::GrpcListener(asio::io_context& io, Policy policy, size_t max_total,
                           size_t max_per_uid)
    : io_(io),
      policy_(std::move(policy)),
      limits_(max_total, max_per_uid),
      acceptor_(io),
      retry_(io) {}

GrpcListener::~GrpcListener() { Stop(); }

Status GrpcListener::Adopt(int listen_fd) {
  error_code ec;
  acceptor_.assign(asio::local::stream_protocol(), listen_fd, ec);
  if (!ec) acceptor_.non_blocking(true, ec);
  if (ec) {
    if (!acceptor_.is_open()) close(listen_fd);
    return Internal("cannot watch the gRPC socket: " + ec.message());
  }
  return Status::Ok();
}

void GrpcListener::Start(grpc::Server* server) {
  server_ = server;
  WaitForConnection();
}

void GrpcListener::Stop() {
  if (stopped_) return;
  stopped_ = true;
  retry_.cancel();
  error_code ignored;
  acceptor_.close(ignored);
}

void GrpcListener::WaitForConnection() {
  acceptor_.async_wait(asio::socket_base::wait_read, [this](error_code ec) {
    if (stopped_ || ec == asio::error::operation_aborted) return;
    if (ec) {
      MO_LOG_WARN_LIMITED("gRPC listener: waiting for connections failed: %s",
                          ec.message().c_str());
      return BackOff(ec.value());
    }
    AcceptPending();
  });
}

void GrpcListener::AcceptPending() {
  for (int i = 0; i < kAcceptsPerRound; ++i) {
    const int fd =
        accept4(acceptor_.native_handle(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      OnAccepted(fd);
      continue;
    }
    const int error = errno;
    if (error == EINTR || error == ECONNABORTED || error == EPROTO) continue;
    if (error == EAGAIN || error == EWOULDBLOCK) {
      // Accept works (a fd was available): the data plane serves again.
      if (!problem_.empty()) {
        MO_LOG_INFO("gRPC listener: accepting again (was: %s)", problem_.c_str());
        problem_.clear();
      }
      backoff_ = std::chrono::milliseconds(0);
      return WaitForConnection();
    }
    return BackOff(error);
  }
  // More may be pending: go round the event loop first.
  asio::post(io_, [this] {
    if (!stopped_) AcceptPending();
  });
}

void GrpcListener::BackOff(int error) {
  problem_ = std::string("gRPC socket cannot accept: ") + std::strerror(error);
  backoff_ = backoff_.count() == 0 ? kFirstBackoff : std::min(backoff_ * 2, kMaxBackoff);
  MO_LOG_WARN_LIMITED("%s; retrying in %lld ms", problem_.c_str(),
                      static_cast<long long>(backoff_.count()));
  retry_.expires_after(backoff_);
  retry_.async_wait([this](error_code ec) {
    if (!ec && !stopped_) AcceptPending();
  });
}

void GrpcListener::OnAccepted(int fd) {
  if (problem_.rfind("gRPC socket cannot accept", 0) == 0) {
    MO_LOG_INFO("gRPC listener: accepting again (was: %s)", problem_.c_str());
    problem_.clear();
  }
  backoff_ = std::chrono::milliseconds(0);
  Result<PeerCredentials> peer = PeerOf(fd);
  struct stat st;
  if (!peer.ok() || fstat(fd, &st) != 0) {
    MO_LOG_WARN_LIMITED("gRPC connection dropped: cannot read its peer credentials");
    close(fd);
    return;
  }
  if (std::string denied = AccessDenied(policy_, *peer); !denied.empty()) {
    MO_LOG_WARN_LIMITED("gRPC connection from pid %d refused: %s", peer->pid, denied.c_str());
    close(fd);
    return;
  }
  // A fd number gRPC closed may come back from accept: forget the old one.
  if (auto old = handed_.find(fd); old != handed_.end()) {
    limits_.Release(old->second.uid);
    handed_.erase(old);
  }
  if (limits_.Full(peer->uid)) Sweep();
  if (std::string full = limits_.Admit(peer->uid); !full.empty()) {
    MO_LOG_WARN_LIMITED("gRPC connection from pid %d uid %u refused: %s", peer->pid, peer->uid,
                        full.c_str());
    close(fd);
    return;
  }
  handed_[fd] = Handed{st.st_dev, st.st_ino, peer->uid};
  grpc::AddInsecureChannelFromFd(server_, fd);
}

void GrpcListener::Sweep() {
  for (auto it = handed_.begin(); it != handed_.end();) {
    struct stat st;
    const bool same =
        fstat(it->first, &st) == 0 && st.st_dev == it->second.dev && st.st_ino == it->second.ino;
    if (same) {
      ++it;
      continue;
    }
    limits_.Release(it->second.uid);
    it = handed_.erase(it);
  }
}

size_t GrpcListener::connection_count() {
  Sweep();
  return limits_.total();
}

}  // namespace memoffload::daemon
