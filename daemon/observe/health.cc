#include "observe/health.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/write.hpp>
#include <chrono>

#include "base/log.h"

namespace memoffload::daemon {

namespace asio = boost::asio;
using boost::system::error_code;
using Tcp = asio::ip::tcp;

namespace {

std::string Reply(int code, const char* reason, const std::string& body, bool head_only) {
  std::string out = "HTTP/1.1 " + std::to_string(code) + " " + reason +
                    "\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: " +
                    std::to_string(body.size()) +
                    "\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n";
  if (!head_only) out += body;
  return out;
}

std::string BadRequest() { return Reply(400, "Bad Request", "bad request\n", false); }

// Where the request head ends (just past the blank line), or npos.
size_t HeadEnd(const std::string& data) {
  const size_t crlf = data.find("\r\n\r\n");
  const size_t lf = data.find("\n\n");
  if (crlf == std::string::npos && lf == std::string::npos) return std::string::npos;
  if (lf == std::string::npos || (crlf != std::string::npos && crlf < lf)) return crlf + 4;
  return lf + 2;
}

}  // namespace

std::string HealthResponse(const std::string& request_head, bool draining,
                           const std::string& not_ready, const std::string& degraded) {
  const size_t eol = request_head.find('\n');
  if (eol == std::string::npos) return BadRequest();
  std::string line = request_head.substr(0, eol);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  // "METHOD SP TARGET SP HTTP/1.x", printable ASCII only.
  for (char c : line) {
    if (c < 0x20 || c > 0x7e) return BadRequest();
  }
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == 0 || sp2 == std::string::npos || sp2 == sp1 + 1 ||
      line.find(' ', sp2 + 1) != std::string::npos) {
    return BadRequest();
  }
  const std::string method = line.substr(0, sp1);
  std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string version = line.substr(sp2 + 1);
  if (version != "HTTP/1.0" && version != "HTTP/1.1") return BadRequest();
  if (target.empty() || target[0] != '/') return BadRequest();
  target = target.substr(0, target.find('?'));
  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) {
    return Reply(405, "Method Not Allowed", "only GET and HEAD\n", false);
  }
  if (target == "/livez") return Reply(200, "OK", draining ? "draining\n" : "ok\n", head_only);
  if (target == "/readyz" || target == "/healthz") {
    if (draining) return Reply(503, "Service Unavailable", "draining\n", head_only);
    if (!not_ready.empty()) {
      return Reply(503, "Service Unavailable", "not ready: " + not_ready + "\n", head_only);
    }
    if (!degraded.empty()) return Reply(200, "OK", "degraded: " + degraded + "\n", head_only);
    return Reply(200, "OK", "ok\n", head_only);
  }
  return Reply(404, "Not Found", "not found: try /livez, /readyz or /healthz\n", head_only);
}

// One probe: read a request head, write one response, close. Lives in
// HealthServer::connections_ until it closes.
class HealthServer::Connection : public std::enable_shared_from_this<Connection> {
 public:
  // `fd_exhausted`: accepted with the spare descriptor (readiness says so).
  Connection(HealthServer* server, uint64_t id, Tcp::socket socket, bool fd_exhausted)
      : server_(server),
        id_(id),
        socket_(std::move(socket)),
        timer_(server->io_),
        fd_exhausted_(fd_exhausted) {}

  void Start() {
    auto self = shared_from_this();
    timer_.expires_after(std::chrono::milliseconds(kRequestTimeoutMs));
    timer_.async_wait([self](error_code ec) {
      if (!ec) self->Close();
    });
    Read();
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    error_code ignored;
    timer_.cancel();
    socket_.shutdown(Tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    server_->OnClosed(id_);  // may destroy the last owner but `self` of a handler
  }

 private:
  void Read() {
    auto self = shared_from_this();
    socket_.async_read_some(asio::buffer(buf_), [self](error_code ec, size_t n) {
      if (self->closed_) return;
      if (ec) return self->Close();  // EOF before a full head: nothing to answer
      self->request_.append(self->buf_.data(), n);
      const size_t end = HeadEnd(self->request_);
      if (end != std::string::npos) {
        HealthState state = self->server_->state_();
        if (self->fd_exhausted_ && state.not_ready.empty()) {
          state.not_ready = "file descriptors exhausted";
        }
        self->Respond(HealthResponse(self->request_.substr(0, end), state.draining, state.not_ready,
                                     state.degraded));
      } else if (self->request_.size() >= kMaxRequestBytes) {
        self->Respond(BadRequest());
      } else {
        self->Read();
      }
    });
  }

  void Respond(std::string response) {
    response_ = std::move(response);
    auto self = shared_from_this();
    asio::async_write(socket_, asio::buffer(response_), [self](error_code ec, size_t) {
      if (ec || self->closed_) return self->Close();
      // Lingering close: send FIN, then discard what the client still sends
      // until it closes (or the timer fires), so that closing with unread
      // bytes does not reset the connection before the client read the answer.
      error_code ignored;
      self->socket_.shutdown(Tcp::socket::shutdown_send, ignored);
      self->Discard();
    });
  }

  void Discard() {
    auto self = shared_from_this();
    socket_.async_read_some(asio::buffer(buf_), [self](error_code ec, size_t) {
      if (self->closed_) return;
      if (ec) return self->Close();
      self->Discard();
    });
  }

  HealthServer* server_;
  const uint64_t id_;
  Tcp::socket socket_;
  asio::steady_timer timer_;
  std::array<char, 512> buf_{};
  std::string request_;
  std::string response_;
  const bool fd_exhausted_;
  bool closed_ = false;
};

HealthServer::HealthServer(asio::io_context& io, std::function<HealthState()> state)
    : io_(io), state_(std::move(state)), acceptor_(io), accept_retry_(io) {}

HealthServer::~HealthServer() { Stop(); }

Result<std::string> HealthServer::Start(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return InvalidArgument("health address '" + address + "' is not IP:PORT");
  }
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  error_code ec;
  const asio::ip::address ip = asio::ip::make_address(host, ec);
  if (ec) return InvalidArgument("health address '" + address + "': '" + host + "' is not an IP");
  const unsigned long port = std::strtoul(address.c_str() + colon + 1, nullptr, 10);
  if (port > 65535) return InvalidArgument("health address '" + address + "': port > 65535");
  const Tcp::endpoint endpoint(ip, static_cast<uint16_t>(port));
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    error_code ignored;
    acceptor_.close(ignored);
    return Unavailable("cannot listen for health probes on " + address + ": " + ec.message());
  }
  const Tcp::endpoint bound = acceptor_.local_endpoint(ec);
  acceptor_.non_blocking(true, ec);
  TakeSpare();
  Accept();
  const std::string bound_host =
      ip.is_v6() ? "[" + bound.address().to_string() + "]" : bound.address().to_string();
  return bound_host + ":" + std::to_string(bound.port());
}

void HealthServer::Accept() {
  acceptor_.async_accept([this](error_code ec, Tcp::socket socket) {
    if (stopped_ || ec == asio::error::operation_aborted) return;
    if ((ec == asio::error::no_descriptors || ec.value() == ENFILE) && spare_fd_ >= 0) {
      AcceptWithSpare();
      return;
    }
    if (ec) {
      // Out of fds or similar: try again shortly instead of spinning.
      MO_LOG_WARN_LIMITED("health listener: accept failed: %s", ec.message().c_str());
      accept_retry_.expires_after(std::chrono::milliseconds(100));
      accept_retry_.async_wait([this](error_code wait_ec) {
        if (!wait_ec && !stopped_) Accept();
      });
      return;
    }
    Admit(std::move(socket), false);
    Accept();
  });
}

void HealthServer::Admit(Tcp::socket socket, bool fd_exhausted) {
  {
    if (connections_.size() >= kMaxConnections) {
      // Full of clients that have not finished: the oldest goes, so a flood
      // of idle connections delays a real probe by at most its own arrival.
      std::shared_ptr<Connection> oldest = connections_.begin()->second;
      oldest->Close();
    }
    const uint64_t id = next_id_++;
    auto connection = std::make_shared<Connection>(this, id, std::move(socket), fd_exhausted);
    connections_.emplace(id, connection);
    connection->Start();
  }
}

void HealthServer::AcceptWithSpare() {
  close(spare_fd_);
  spare_fd_ = -1;
  error_code ec;
  Tcp::socket socket(io_);
  acceptor_.accept(socket, ec);
  if (!ec) {
    Admit(std::move(socket), true);
  } else {
    TakeSpare();
  }
  // Wait a little before the next try: descriptors are short right now.
  accept_retry_.expires_after(std::chrono::milliseconds(100));
  accept_retry_.async_wait([this](error_code wait_ec) {
    if (!wait_ec && !stopped_) Accept();
  });
}

void HealthServer::TakeSpare() {
  if (spare_fd_ < 0) spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

void HealthServer::OnClosed(uint64_t id) {
  connections_.erase(id);
  TakeSpare();
}

void HealthServer::Stop() {
  if (stopped_) return;
  stopped_ = true;
  error_code ignored;
  accept_retry_.cancel();
  acceptor_.close(ignored);
  if (spare_fd_ >= 0) close(spare_fd_);
  spare_fd_ = -1;
  // Close() erases from connections_: iterate over a copy.
  auto open = connections_;
  for (auto& [id, connection] : open) connection->Close();
  connections_.clear();
}

}  // namespace memoffload::daemon
