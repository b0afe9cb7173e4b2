#include "memoffload/daemon/broker.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

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
      : broker_(broker), id_(id), socket_(std::move(socket)), timer_(broker->io_) {}

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
    Result<Hello> hello = DecodeHello(payload_);
    if (!hello.ok()) return Refuse("bad_hello", hello.status());
    hello_ = *hello;
    Result<SessionGrant> grant = broker_->table_->Open(hello_, peer_);
    if (!grant.ok()) return Refuse("session_error", grant.status());
    session_id_ = grant->session_id;
    if (Status st = SendGrant(*grant); !st.ok()) {
      MO_LOG_WARN("attach of pid %d failed while sending the chunk table: %s", peer_.pid,
                  st.ToString().c_str());
      CloseSession(CloseReason::kLifelineClosed);
      return Finish();
    }
    broker_->metrics_->SessionOpened();
    MO_LOG_INFO("session %lu attached: pid %d uid %u job '%s' rank %d local_rank %d",
                static_cast<unsigned long>(session_id_), peer_.pid, peer_.uid,
                hello_.job_id.c_str(), hello_.rank, hello_.local_rank);
    WatchLifeline();
  }

  Status SendGrant(const SessionGrant& grant) {
    const Arena& arena = *broker_->arena_;
    AttachReply reply;
    reply.session_id = grant.session_id;
    reply.session_token = grant.token;
    reply.grpc_socket = broker_->options_.grpc_socket_path;
    reply.page_bytes = arena.page_bytes();
    reply.session_limit_bytes = grant.limit_bytes;
    for (uint32_t i = 0; i < arena.chunk_count(); ++i) {
      reply.chunks.push_back({i, arena.chunk(i).size_bytes()});
    }
    reply.fd_frames =
        static_cast<uint32_t>((arena.chunk_count() + kMaxFdsPerFrame - 1) / kMaxFdsPerFrame);
    const int fd = socket_.native_handle();
    MEMOFFLOAD_RETURN_IF_ERROR(SendFrame(fd, EncodeAttachReply(reply)));
    for (uint32_t first = 0; first < arena.chunk_count(); first += kMaxFdsPerFrame) {
      ChunkFdBatch batch;
      std::vector<int> fds;
      for (uint32_t i = first; i < arena.chunk_count() && i < first + kMaxFdsPerFrame; ++i) {
        batch.chunk_indexes.push_back(i);
        fds.push_back(arena.chunk(i).fd());
      }
      MEMOFFLOAD_RETURN_IF_ERROR(SendFrame(fd, EncodeChunkFdBatch(batch), fds));
    }
    return Status::Ok();
  }

  // Reads (and discards) until the peer closes: that is the lifeline.
  void WatchLifeline() {
    auto self = shared_from_this();
    socket_.async_read_some(asio::buffer(drain_), [self](error_code ec, size_t) {
      if (ec) return self->Finish();
      self->WatchLifeline();
    });
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
  PeerCredentials peer_;
  Hello hello_;
  uint64_t session_id_ = 0;
  std::array<unsigned char, 4> header_{};
  std::string payload_;
  std::array<char, 256> drain_{};
};

Broker::Broker(asio::io_context& io, const Arena* arena, SessionTable* table, Metrics* metrics,
               BrokerOptions options)
    : io_(io),
      arena_(arena),
      table_(table),
      metrics_(metrics),
      options_(std::move(options)),
      acceptor_(io) {}

Broker::~Broker() { CloseAll(); }

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
