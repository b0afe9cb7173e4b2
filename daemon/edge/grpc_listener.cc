#include "edge/grpc_listener.h"

#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstring>

#include "base/log.h"

namespace memoffload::daemon {

namespace asio = boost::asio;
using boost::system::error_code;

namespace {
constexpr std::chrono::milliseconds kFirstBackoff{10};
constexpr std::chrono::milliseconds kMaxBackoff{1000};
// Accepts per wake-up, so that a flood cannot keep the event loop to itself.
constexpr int kAcceptsPerRound = 64;
// A uid whose connection broke the HTTP/2 rules waits before it may connect
// again: 1 s, doubled for each strike within kStrikesForget, at most 30 s.
constexpr std::chrono::seconds kStrikesForget{60};
constexpr int kMaxPenaltyShift = 5;  // 2^5 s > 30 s
constexpr std::chrono::seconds kMaxPenalty{30};
}  // namespace

GrpcListener::GrpcListener(asio::io_context& io, Policy policy, size_t max_total,
                           size_t max_per_uid)
    : io_(io),
      policy_(std::move(policy)),
      limits_(max_total, max_per_uid),
      acceptor_(io),
      retry_(io),
      relay_(H2Limits{}) {}

GrpcListener::~GrpcListener() {
  Stop();
  relay_.Stop();
}

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

int GrpcListener::ReleaseListener() {
  if (stopped_ || !acceptor_.is_open()) return -1;
  stopped_ = true;
  retry_.cancel();
  error_code ignored;
  acceptor_.cancel(ignored);
  return acceptor_.release(ignored);
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
      if (OnAccepted(fd)) continue;
      // The relay's socket pair found no descriptors: as bad as accept's
      // EMFILE, though accept itself got one (the free count was 1 or 2).
      return BackOff(EMFILE);
    }
    const int error = errno;
    if (error == EINTR || error == ECONNABORTED || error == EPROTO) continue;
    if (error == EAGAIN || error == EWOULDBLOCK) {
      // Accept works (a fd was available): the data plane serves again.
      Accepting();
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

bool GrpcListener::OnAccepted(int fd) {
  Result<PeerCredentials> peer = PeerOf(fd);
  if (!peer.ok()) {
    MO_LOG_WARN_LIMITED("gRPC connection dropped: cannot read its peer credentials");
    close(fd);
    return true;
  }
  if (std::string denied = AccessDenied(policy_, *peer); !denied.empty()) {
    MO_LOG_WARN_LIMITED("gRPC connection from pid %d refused: %s", peer->pid, denied.c_str());
    close(fd);
    return true;
  }
  if (std::string wait = Penalized(peer->uid); !wait.empty()) {
    MO_LOG_WARN_LIMITED("gRPC connection from pid %d uid %u refused: %s", peer->pid, peer->uid,
                        wait.c_str());
    close(fd);
    return true;
  }
  if (std::string full = limits_.Admit(peer->uid); !full.empty()) {
    MO_LOG_WARN_LIMITED("gRPC connection from pid %d uid %u refused: %s", peer->pid, peer->uid,
                        full.c_str());
    close(fd);
    return true;
  }
  const uid_t uid = peer->uid;
  Result<int> grpc_end = relay_.Relay(fd, peer->pid, uid, [this, uid](H2Violation why) {
    // On the relay's thread: the counts belong to the event loop's.
    asio::post(io_, [this, uid, why] {
      limits_.Release(uid);
      if (why == H2Violation::kNone) return;
      Penalize(uid, why);
      if (count_violation_) count_violation_(why);
    });
  });
  if (!grpc_end.ok()) {
    limits_.Release(uid);
    if (grpc_end.status().code() == StatusCode::kResourceExhausted) return false;
    MO_LOG_WARN_LIMITED("gRPC connection from pid %d dropped: %s", peer->pid,
                        grpc_end.status().message().c_str());
    return true;
  }
  grpc::AddInsecureChannelFromFd(server_, *grpc_end);
  Accepting();
  return true;
}

void GrpcListener::Accepting() {
  if (!problem_.empty()) {
    MO_LOG_INFO("gRPC listener: accepting again (was: %s)", problem_.c_str());
    problem_.clear();
  }
  backoff_ = std::chrono::milliseconds(0);
}

void GrpcListener::Penalize(uid_t uid, H2Violation why) {
  const auto now = std::chrono::steady_clock::now();
  Penalty& p = penalties_[uid];
  p.strikes = now - p.last_strike > kStrikesForget ? 1 : p.strikes + 1;
  p.last_strike = now;
  const auto wait = std::min<std::chrono::steady_clock::duration>(
      std::chrono::seconds(1LL << std::min(p.strikes - 1, kMaxPenaltyShift)), kMaxPenalty);
  p.until = now + wait;
  MO_LOG_WARN_LIMITED(
      "gRPC: uid %u broke the HTTP/2 rules (%s, strike %d): its new connections "
      "are refused for %lld ms",
      uid, H2ViolationName(why), p.strikes,
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(wait).count()));
}

std::string GrpcListener::Penalized(uid_t uid) {
  auto it = penalties_.find(uid);
  if (it == penalties_.end()) return "";
  const auto now = std::chrono::steady_clock::now();
  if (now >= it->second.until) {
    if (now - it->second.last_strike > kStrikesForget) penalties_.erase(it);
    return "";
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(it->second.until - now);
  return "a connection of this uid broke the HTTP/2 rules; refused for " +
         std::to_string(left.count()) + " ms more";
}

}  // namespace memoffload::daemon
