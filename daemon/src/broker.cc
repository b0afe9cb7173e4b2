#include "memoffload/daemon/broker.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>

#include "memoffload/daemon/log.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/fd_passing.h"

namespace memoffload::daemon {

namespace asio = boost::asio;
using boost::system::error_code;
using Socket = asio::local::stream_protocol::socket;

// One attached (or attaching) client. Lives in Broker::connections_ until its
// socket closes.
class Broker::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Broker* broker, uint64_t id, Socket socket)
      : broker_(broker),
        id_(id),
        socket_(std::move(socket)),
        timer_(broker->io_),
        pidfd_(broker->io_) {}

  void Start() {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(socket_.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      Refuse("peer_credentials", Internal("cannot read SO_PEERCRED of the peer"));
      return;
    }
    peer_ = PeerCredentials{cred.pid, cred.uid, cred.gid};
    timer_.expires_after(std::chrono::milliseconds(broker_->options_.hello_timeout_ms));
    auto self = shared_from_this();
    timer_.async_wait([self](error_code ec) {
      if (!ec && self->session_id_ == 0) {
        MO_LOG_WARN("attach from pid %d: no hello within %d ms; dropping", self->peer_.pid,
                    self->broker_->options_.hello_timeout_ms);
        self->broker_->metrics_->AttachRefused("hello_timeout");
        self->Shutdown();
      }
    });
    asio::async_read(socket_, asio::buffer(header_),
                     [self](error_code ec, size_t) { self->OnHeader(ec); });
  }

  void Shutdown() {
    error_code ignored;
    timer_.cancel();
    pidfd_.close(ignored);
    socket_.shutdown(Socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  void CloseSession(CloseReason reason) {
    if (session_id_ == 0) return;
    Result<uint64_t> reclaimed = broker_->table_->Close(session_id_, reason);
    if (reclaimed.ok()) {
      broker_->metrics_->SessionClosed(reason, *reclaimed);
      MO_LOG_INFO("session %lu (pid %d, job '%s', rank %d) closed (%s); reclaimed %lu bytes",
                  static_cast<unsigned long>(session_id_), peer_.pid, hello_.job_id.c_str(),
                  hello_.rank, CloseReasonName(reason), static_cast<unsigned long>(*reclaimed));
    }
    session_id_ = 0;
  }

 private:
  void OnHeader(error_code ec) {
    if (ec) return Finish();
    uint32_t len = 0;
    for (int i = 0; i < 4; ++i) len |= static_cast<uint32_t>(header_[i]) << (8 * i);
    if (len > 64 * 1024) {
      return Refuse("bad_hello",
                    InvalidArgument("hello of " + std::to_string(len) + " bytes is too large"));
    }
    payload_.assign(len, '\0');
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(payload_),
                     [self](error_code ec2, size_t) { self->OnHello(ec2); });
  }

  void OnHello(error_code ec) {
    if (ec) return Finish();
    timer_.cancel();
    // Access is decided after the hello so the client, which writes its hello
    // first, always reads the reason instead of a broken pipe.
    if (std::string denied = broker_->AccessDenied(peer_); !denied.empty()) {
      return Refuse("access_denied", PermissionDenied(denied));
    }
    Result<Hello> hello = DecodeHello(payload_);
    if (!hello.ok()) return Refuse("bad_hello", hello.status());
    hello_ = *hello;
    Result<SessionGrant> grant = broker_->table_->Open(hello_, peer_);
    if (!grant.ok()) {
      return Refuse(
          grant.status().code() == StatusCode::kUnavailable ? "draining" : "session_error",
          grant.status());
    }
    session_id_ = grant->session_id;
    if (Status st = SendGrant(*grant); !st.ok()) {
      MO_LOG_WARN("attach of pid %d failed while sending the chunk table: %s", peer_.pid,
                  st.ToString().c_str());
      CloseSession(CloseReason::kLifelineClosed);
      return Finish();
    }
    broker_->metrics_->SessionOpened();
    MO_LOG_INFO(
        "session %lu attached: pid %d uid %u job '%s' rank %d local_rank %d (instance %016lx)",
        static_cast<unsigned long>(session_id_), peer_.pid, peer_.uid, hello_.job_id.c_str(),
        hello_.rank, hello_.local_rank, static_cast<unsigned long>(broker_->options_.instance_id));
    WatchLifeline();
    WatchProcess();
  }

  // Closes the session when the peer process exits, even if a child it
  // forked keeps the connection open. Skipped where the pid is not visible.
  void WatchProcess() {
    if (peer_.pid <= 0) return;
    const int fd = static_cast<int>(syscall(SYS_pidfd_open, peer_.pid, 0));
    if (fd < 0) return;
    pidfd_.assign(fd);
    auto self = shared_from_this();
    pidfd_.async_wait(asio::posix::stream_descriptor::wait_read, [self](error_code ec) {
      if (ec || self->session_id_ == 0) return;
      // A process closes its fds before its pidfd turns readable: a hung-up
      // socket means the ordinary lifeline case, an open one means a child
      // still holds it.
      pollfd p{self->socket_.native_handle(), POLLIN | POLLRDHUP, 0};
      const bool hung_up = poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP));
      self->CloseSession(hung_up ? CloseReason::kLifelineClosed : CloseReason::kProcessExited);
      self->Finish();
    });
  }

  Status SendGrant(const SessionGrant& grant) {
    const Arena& arena = *broker_->arena_;
    Result<std::vector<ChunkGrant>> granted = broker_->table_->AttachChunks(grant.session_id);
    if (!granted.ok()) return granted.status();
    AttachReply reply;
    reply.session_id = grant.session_id;
    reply.session_token = grant.token;
    reply.grpc_socket = broker_->options_.grpc_socket_path;
    reply.page_bytes = arena.page_bytes();
    reply.session_limit_bytes = grant.limit_bytes;
    reply.instance_id = broker_->options_.instance_id;
    for (uint32_t i = 0; i < arena.chunk_count(); ++i) {
      reply.chunks.push_back({i, arena.chunk_bytes(i)});
    }
    reply.fd_frames =
        static_cast<uint32_t>((granted->size() + kMaxFdsPerFrame - 1) / kMaxFdsPerFrame);
    const int fd = socket_.native_handle();
    MEMOFFLOAD_RETURN_IF_ERROR(SendFrame(fd, EncodeAttachReply(reply)));
    for (size_t first = 0; first < granted->size(); first += kMaxFdsPerFrame) {
      ChunkFdBatch batch;
      std::vector<int> fds;
      for (size_t i = first; i < granted->size() && i < first + kMaxFdsPerFrame; ++i) {
        batch.chunk_indexes.push_back((*granted)[i].index);
        batch.generations.push_back((*granted)[i].generation);
        fds.push_back((*granted)[i].backing->fd());
      }
      MEMOFFLOAD_RETURN_IF_ERROR(SendFrame(fd, EncodeChunkFdBatch(batch), fds));
    }
    return Status::Ok();
  }

  // Serves chunk requests until the peer closes: the connection is the
  // session's lifeline.
  void WatchLifeline() {
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(header_), [self](error_code ec, size_t) {
      if (ec) return self->Finish();
      uint32_t len = 0;
      for (int i = 0; i < 4; ++i) len |= static_cast<uint32_t>(self->header_[i]) << (8 * i);
      if (len > 64 * 1024) {
        MO_LOG_WARN("session %lu sent a %u-byte frame on its broker connection; closing it",
                    static_cast<unsigned long>(self->session_id_), len);
        return self->Finish();
      }
      self->payload_.assign(len, '\0');
      asio::async_read(self->socket_, asio::buffer(self->payload_), [self](error_code ec2, size_t) {
        if (ec2) return self->Finish();
        self->ServeChunkRequest();
        self->WatchLifeline();
      });
    });
  }

  void ServeChunkRequest() {
    ChunkReply reply;
    std::vector<int> fds;
    Result<ChunkRequest> request = DecodeChunkRequest(payload_);
    Status st = request.ok() ? Status::Ok() : request.status();
    if (st.ok() && request->chunk_indexes.size() > kMaxFdsPerFrame) {
      st = InvalidArgument("at most " + std::to_string(kMaxFdsPerFrame) + " chunks per request");
    }
    Result<std::vector<ChunkGrant>> grants = InvalidArgument("no chunks");
    if (st.ok()) {
      grants = broker_->table_->GrantChunks(session_id_, request->chunk_indexes);
      st = grants.status();
    }
    if (st.ok()) {
      for (const ChunkGrant& g : *grants) {
        reply.chunk_indexes.push_back(g.index);
        reply.generations.push_back(g.generation);
        fds.push_back(g.backing->fd());
      }
    } else {
      reply.code = st.code();
      reply.message = st.message();
      MO_LOG_WARN("session %lu (pid %d): chunk request refused: %s",
                  static_cast<unsigned long>(session_id_), peer_.pid, st.ToString().c_str());
    }
    if (Status sent = SendFrame(socket_.native_handle(), EncodeChunkReply(reply), fds);
        !sent.ok()) {
      MO_LOG_WARN("session %lu: sending chunk fds failed: %s",
                  static_cast<unsigned long>(session_id_), sent.ToString().c_str());
    }
  }

  void Refuse(const std::string& reason, const Status& status) {
    broker_->metrics_->AttachRefused(reason);
    MO_LOG_WARN("attach refused (pid %d uid %u): %s", peer_.pid, peer_.uid,
                status.ToString().c_str());
    AttachReply reply;
    reply.code = status.code();
    reply.message = status.message();
    Status ignored = SendFrame(socket_.native_handle(), EncodeAttachReply(reply));
    (void)ignored;
    Finish();
  }

  // The connection is over: reclaim and forget it.
  void Finish() {
    CloseSession(CloseReason::kLifelineClosed);
    Shutdown();
    broker_->OnClosed(id_);
  }

  Broker* broker_;
  const uint64_t id_;
  Socket socket_;
  asio::steady_timer timer_;
  asio::posix::stream_descriptor pidfd_;
  PeerCredentials peer_;
  Hello hello_;
  uint64_t session_id_ = 0;
  std::array<unsigned char, 4> header_{};
  std::string payload_;
};

Broker::Broker(asio::io_context& io, const Arena* arena, SessionTable* table, Metrics* metrics,
               BrokerOptions options, Policy policy)

    : io_(io),
      arena_(arena),
      table_(table),
      metrics_(metrics),
      options_(std::move(options)),
      policy_(std::move(policy)),
      acceptor_(io) {}

Broker::~Broker() { CloseAll(); }

std::string Broker::AccessDenied(const PeerCredentials& peer) const {
  if (peer.uid == 0 || peer.uid == geteuid()) return "";
  const auto& uids = policy_.allowed_uids;
  const auto& gids = policy_.allowed_gids;
  if (std::find(uids.begin(), uids.end(), peer.uid) != uids.end()) return "";
  if (std::find(gids.begin(), gids.end(), peer.gid) != gids.end()) return "";
  return "uid " + std::to_string(peer.uid) + " (gid " + std::to_string(peer.gid) +
         ") may not attach: allowed are root, the daemon's uid " + std::to_string(geteuid()) +
         " and access.allowed_uids / access.allowed_gids in the daemon's config";
}

Status Broker::Start() {
  unlink(options_.socket_path.c_str());
  error_code ec;
  asio::local::stream_protocol::endpoint endpoint(options_.socket_path);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (ec) {
    return Unavailable("cannot bind broker socket " + options_.socket_path + ": " + ec.message());
  }
  if (chmod(options_.socket_path.c_str(), options_.socket_mode) != 0) {
    return ErrnoStatus("chmod " + options_.socket_path, errno);
  }
  if (options_.socket_gid != static_cast<gid_t>(-1) &&
      chown(options_.socket_path.c_str(), static_cast<uid_t>(-1), options_.socket_gid) != 0) {
    return ErrnoStatus("chown " + options_.socket_path + " to the socket group", errno);
  }
  acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Unavailable("cannot listen on " + options_.socket_path + ": " + ec.message());
  Accept();
  return Status::Ok();
}

void Broker::Accept() {
  acceptor_.async_accept([this](error_code ec, Socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (!ec) {
      const uint64_t id = next_connection_id_++;
      auto conn = std::make_shared<Connection>(this, id, std::move(socket));
      connections_.emplace(id, conn);
      conn->Start();
    } else {
      MO_LOG_WARN("broker accept failed: %s", ec.message().c_str());
    }
    Accept();
  });
}

void Broker::OnClosed(uint64_t connection_id) { connections_.erase(connection_id); }

void Broker::StopAccepting() {
  if (!acceptor_.is_open()) return;
  error_code ignored;
  acceptor_.close(ignored);
  unlink(options_.socket_path.c_str());
}

void Broker::CloseAll() {
  auto connections = std::move(connections_);
  connections_.clear();
  for (auto& [id, conn] : connections) {
    conn->CloseSession(CloseReason::kShutdown);
    conn->Shutdown();
  }
}

}  // namespace memoffload::daemon
