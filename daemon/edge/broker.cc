#include "edge/broker.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "base/log.h"
#include "edge/broker_connection.h"
#include "memoffload/shared_mem/attach_wire.h"

namespace memoffload::daemon {
namespace {

constexpr std::chrono::milliseconds kFirstBackoff{10};
constexpr std::chrono::milliseconds kMaxBackoff{1000};

}  // namespace

Broker::Broker(asio::io_context& io, const Arena* arena, SessionTable* table, Metrics* metrics,
               BrokerOptions options, Policy policy)
    : io_(io),
      arena_(arena),
      table_(table),
      metrics_(metrics),
      options_(std::move(options)),
      policy_(std::move(policy)),
      acceptor_(io),
      accept_retry_(io),
      limits_(options_.max_connections, options_.max_connections_per_uid),
      linger_timer_(io) {}

Broker::~Broker() { CloseAll(); }

Status Broker::Start(int listen_fd) {
  error_code ec;
  acceptor_.assign(asio::local::stream_protocol(), listen_fd, ec);
  if (ec) {
    close(listen_fd);
    return Unavailable("cannot watch broker socket " + options_.socket_path + ": " + ec.message());
  }
  Accept();
  return Status::Ok();
}

void Broker::Accept() {
  acceptor_.async_accept([this](error_code ec, Socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (ec) return AcceptFailed(ec);
    accept_backoff_ = std::chrono::milliseconds(0);
    Result<PeerCredentials> peer = PeerOf(socket.native_handle());
    if (!peer.ok()) {
      metrics_->AttachRefused("peer_credentials");
      MO_LOG_WARN_LIMITED("broker: dropping a connection: %s", peer.status().ToString().c_str());
    } else if (std::string full = limits_.Admit(peer->uid); !full.empty()) {
      metrics_->AttachRefused("connection_limit");
      MO_LOG_WARN_LIMITED("attach refused (pid %d uid %u): %s", peer->pid, peer->uid, full.c_str());
      // Best effort, never waiting: the reason, then close.
      AttachReply reply;
      reply.code = StatusCode::kResourceExhausted;
      reply.message = full;
      const std::string payload = EncodeAttachReply(reply);
      const std::string bytes = EncodeFrameHeader(static_cast<uint32_t>(payload.size())) + payload;
      const ssize_t ignored =
          send(socket.native_handle(), bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      (void)ignored;  // a peer that cannot take it just sees the close
    } else {
      const uint64_t id = next_connection_id_++;
      auto conn = std::make_shared<Connection>(this, id, std::move(socket), *peer);
      connections_.emplace(id, conn);
      conn->Start();
    }
    Accept();
  });
}

void Broker::AcceptFailed(const error_code& ec) {
  // EMFILE and friends: back off instead of spinning (and logging) at full
  // speed; the pending connection stays queued until a fd is free.
  accept_backoff_ =
      accept_backoff_.count() == 0 ? kFirstBackoff : std::min(accept_backoff_ * 2, kMaxBackoff);
  MO_LOG_WARN_LIMITED("broker accept failed: %s; retrying in %lld ms", ec.message().c_str(),
                      static_cast<long long>(accept_backoff_.count()));
  accept_retry_.expires_after(accept_backoff_);
  accept_retry_.async_wait([this](error_code wait_ec) {
    if (!wait_ec && acceptor_.is_open()) Accept();
  });
}

void Broker::OnClosed(uint64_t connection_id, uid_t uid, bool release_slot) {
  if (connections_.erase(connection_id) != 0 && release_slot) limits_.Release(uid);
}

void Broker::Linger(Socket socket, const PeerCredentials& peer) {
  lingering_.push_back({std::move(socket), peer});
  if (lingering_.size() == 1) ScheduleLingerSweep();
}

void Broker::ScheduleLingerSweep() {
  linger_timer_.expires_after(kLingerSweep);
  linger_timer_.async_wait([this](error_code ec) {
    if (ec) return;
    for (auto it = lingering_.begin(); it != lingering_.end();) {
      if (UnreadBytes(it->socket.native_handle()) > 0) {
        if (!it->told) {
          it->told = true;
          MO_LOG_WARN_LIMITED(
              "broker: pid %d uid %u has not read what the daemon sent before its connection "
              "ended; its connection slot stays taken until it reads or closes it (chunk fds in "
              "it count against the daemon)",
              it->peer.pid, it->peer.uid);
        }
        ++it;
        continue;
      }
      error_code ignored;
      it->socket.close(ignored);
      limits_.Release(it->peer.uid);
      it = lingering_.erase(it);
    }
    if (!lingering_.empty()) ScheduleLingerSweep();
  });
}

void Broker::StopAccepting() {
  if (!acceptor_.is_open()) return;
  error_code ignored;
  accept_retry_.cancel();
  acceptor_.close(ignored);
}

int Broker::ReleaseListener() {
  if (!acceptor_.is_open()) return -1;
  accept_retry_.cancel();
  error_code ignored;
  acceptor_.cancel(ignored);
  return acceptor_.release(ignored);
}

void Broker::AskToLeave(const std::string& why) {
  for (auto& [id, conn] : connections_) conn->AskToLeave(why);
}

void Broker::NoticeResume(const std::string& why) {
  for (auto& [id, conn] : connections_) conn->NoticeResume(why);
}

bool Broker::Flushed() const {
  for (const auto& [id, conn] : connections_) {
    if (!conn->Flushed()) return false;
  }
  return true;
}

void Broker::CloseAll() {
  linger_timer_.cancel();
  for (Lingering& l : lingering_) {
    error_code ignored;
    l.socket.close(ignored);
    limits_.Release(l.peer.uid);
  }
  lingering_.clear();
  auto connections = std::move(connections_);
  connections_.clear();
  for (auto& [id, conn] : connections) {
    conn->CloseSession(CloseReason::kShutdown);
    conn->MarkClosed();
    conn->Shutdown();
    limits_.Release(conn->uid());
  }
}

}  // namespace memoffload::daemon
