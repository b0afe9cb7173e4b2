// LinkListener and LinkExchange (link.h): the exchange's whole (its start,
// deadline and end); its halves are link_receive.cc and link_send.cc.
#include "memoffload/client/link.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <set>

#include "link_exchange.h"

namespace memoffload::client {
namespace link_internal {

Result<asio::ip::address> ParseAddress(const std::string& host) {
  ErrorCode ec;
  asio::ip::address address = asio::ip::make_address(host, ec);
  if (!ec) return address;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) {
    return InvalidArgument("cannot resolve replication address " + host);
  }
  char text[NI_MAXHOST];
  const int rc = getnameinfo(found->ai_addr, found->ai_addrlen, text, sizeof(text), nullptr, 0,
                             NI_NUMERICHOST);
  freeaddrinfo(found);
  if (rc != 0) return InvalidArgument("cannot resolve replication address " + host);
  address = asio::ip::make_address(text, ec);
  if (ec) return InvalidArgument("cannot resolve replication address " + host);
  return address;
}

std::string Why(const ErrorCode& ec) { return ec.message(); }

Result<LinkResult> Exchange::Run() {
  if (!outs_.empty()) {
    Result<std::unique_ptr<LinkTlsContext>> client =
        LinkTlsContext::Make(LinkTlsContext::Role::kClient, {options_.keys.front()});
    if (!client.ok()) return client.status();
    client_ = std::move(client).value();
  }
  if (!ins_.empty()) {
    Result<std::unique_ptr<LinkTlsContext>> server =
        LinkTlsContext::Make(LinkTlsContext::Role::kServer, options_.keys);
    if (!server.ok()) return server.status();
    server_ = std::move(server).value();
    for (const auto& [rank, in] : ins_) {
      Result<asio::ip::address> a = ParseAddress(in->spec->peer.host);
      if (!a.ok()) return a.status();
      allowed_.insert(*a);
      if (rank == options_.rank) return InvalidArgument("a rank does not receive from itself");
    }
    MEMOFFLOAD_RETURN_IF_ERROR(StartAccepting());
  }
  Result<asio::ip::address> local = ParseAddress(listener_->address());
  if (!local.ok()) return local.status();
  local_ = *local;
  for (auto& out : outs_) Connect(out.get());
  deadline_.expires_after(std::chrono::milliseconds(options_.io_timeout_ms));
  deadline_.async_wait([this](const ErrorCode& ec) {
    if (!ec) TimedOut();
  });
  MaybeFinished();
  io_.run();
  return std::move(result_);
}

void Exchange::TimedOut() {
  const LinkDropped& d = listener_->dropped();
  const std::string dropped =
      " (connections dropped meanwhile: " + std::to_string(d.not_a_peer) + " not a peer's, " +
      std::to_string(d.busy) + " while " + std::to_string(options_.max_pending_handshakes) +
      " others were in their handshake, " + std::to_string(d.handshake) +
      " without the job's key, " + std::to_string(d.bad_hello) + " without a hello expected)";
  const std::string why = "timed out after " + std::to_string(options_.io_timeout_ms) + " ms";
  for (auto& out : outs_) {
    if (!out->done) {
      FailOut(out.get(),
              why + (out->failure.empty() ? "" : " (last: " + out->failure + ")") + dropped);
    }
  }
  for (auto& [rank, in] : ins_) {
    if (!in->done) {
      FailIn(in.get(), (in->connected ? why : why + " waiting for its connection") + dropped);
    }
  }
  Finish();
}

void Exchange::MaybeFinished() {
  for (auto& out : outs_) {
    if (!out->done) return;
  }
  for (auto& [rank, in] : ins_) {
    if (!in->done) return;
  }
  Finish();
}

void Exchange::Finish() {
  if (finished_) return;
  finished_ = true;
  ErrorCode ignored;
  deadline_.cancel();
  acceptor_.close(ignored);
  if (accept_retry_) accept_retry_->cancel();
  for (auto& out : outs_) {
    if (out->retry) out->retry->cancel();
    if (out->stream) out->stream->lowest_layer().close(ignored);
  }
  for (auto& [rank, in] : ins_) {
    if (in->stream) in->stream->lowest_layer().close(ignored);
  }
  io_.stop();  // the pending handshakes' handlers are dropped with the io_context
}

}  // namespace link_internal

using link_internal::ParseAddress;
namespace asio = boost::asio;
using tcp = asio::ip::tcp;

Result<std::unique_ptr<LinkListener>> LinkListener::Listen(const std::string& address,
                                                           const LinkOptions& options) {
  if (options.keys.empty()) return InvalidArgument("the link needs the job's key");
  if (options.piece_bytes == 0 || options.piece_bytes > kLinkMaxPieceBytes) {
    return InvalidArgument("piece_bytes must be 1 .. 64 MiB");
  }
  Result<asio::ip::address> a = ParseAddress(address);
  if (!a.ok()) return a.status();
  std::unique_ptr<LinkListener> listener(new LinkListener());
  listener->options_ = options;
  listener->address_ = a->to_string();
  const int family = a->is_v6() ? AF_INET6 : AF_INET;
  const int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket", errno);
  listener->fd_ = fd;
  const tcp::endpoint endpoint(*a, 0);
  if (bind(fd, endpoint.data(), static_cast<socklen_t>(endpoint.size())) != 0) {
    return ErrnoStatus("cannot listen on replication address " + listener->address_, errno);
  }
  if (listen(fd, 64) != 0) return ErrnoStatus("listen", errno);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return ErrnoStatus("getsockname", errno);
  }
  listener->port_ = ntohs(family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return listener;
}

LinkListener::~LinkListener() {
  if (fd_ >= 0) close(fd_);
}

Result<LinkResult> LinkExchange(LinkListener* listener, uint32_t seq, RegionStore* source,
                                const std::vector<LinkSend>& sends,
                                const std::vector<LinkReceive>& receives, const LinkSink& sink) {
  if (listener == nullptr) return InvalidArgument("no listener");
  std::set<int32_t> ranks;
  for (const LinkReceive& r : receives) {
    if (!ranks.insert(r.peer.rank).second) {
      return InvalidArgument("two streams from rank " + std::to_string(r.peer.rank));
    }
  }
  link_internal::Exchange exchange(listener, seq, source, sends, receives, sink);
  return exchange.Run();
}

}  // namespace memoffload::client
