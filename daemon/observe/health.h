// HealthServer: a tiny HTTP/1.x endpoint for Kubernetes (or any) probes,
// served on the daemon's event loop (the io_context RunDaemon runs).
//
//   GET /livez    200 "ok" (or "draining"): the event loop runs. Stays 200
//                 while draining: restarting a draining daemon drops sessions.
//   GET /readyz   200 "ok" while serving (200 "degraded: <why>" while it
//                 serves without a part that is not the data plane, e.g. its
//                 metrics port is taken); 503 "draining" while the daemon
//                 drains (SIGTERM or memoffloadctl drain), so traffic stops;
//                 503 "not ready: <why>" while the data plane cannot serve
//                 (the gRPC socket cannot accept, e.g. out of descriptors).
//   GET /healthz  the same as /readyz.
// HEAD is answered like GET without a body. Other paths get 404, other
// methods 405, anything malformed (or a request head over kMaxRequestBytes)
// 400. Every connection gets one response and is closed. A connection is
// closed kRequestTimeoutMs after accept, answered or not; past
// kMaxConnections open connections, the oldest is closed to admit a new one.
// A client can make the server answer 400 or nothing, never stop the daemon.
// The server keeps one spare descriptor: when accept fails for lack of
// descriptors, it gives the spare up to answer that one probe (/readyz then
// says 503 "not ready: file descriptors exhausted"), and takes it back after.
//
// Not thread-safe: call every method from the io_context's thread (or
// before it runs). `state` may be called there at any time.
#ifndef MEMOFFLOAD_DAEMON_HEALTH_H_
#define MEMOFFLOAD_DAEMON_HEALTH_H_

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "memoffload/common/status.h"

namespace memoffload::daemon {

// The full HTTP response (status line, headers, body) to one request head
// (the bytes up to and including the blank line), by the rules above.
// `not_ready` is empty while the data plane serves, else why it does not.
// `degraded` is empty, or why the daemon serves without some part.
std::string HealthResponse(const std::string& request_head, bool draining,
                           const std::string& not_ready = "", const std::string& degraded = "");

// What the probes report: draining, why the data plane cannot serve ("" when
// it can), and what it serves without ("" when nothing).
struct HealthState {
  bool draining = false;
  std::string not_ready;
  std::string degraded;  // serves, but without this part (e.g. metrics)
};

class HealthServer {
 public:
  static constexpr size_t kMaxRequestBytes = 2048;
  static constexpr int kRequestTimeoutMs = 2000;
  static constexpr size_t kMaxConnections = 32;

  // `state` tells whether the daemon drains and whether it can serve.
  HealthServer(boost::asio::io_context& io, std::function<HealthState()> state);
  ~HealthServer();
  HealthServer(const HealthServer&) = delete;
  HealthServer& operator=(const HealthServer&) = delete;

  // Binds "IP:PORT" ("[IPv6]:PORT"; port 0 picks a free one), listens and
  // starts accepting (answers flow once the io_context runs). Returns the
  // bound "IP:PORT".
  Result<std::string> Start(const std::string& address);
  // Closes the listener and every open connection. Idempotent.
  void Stop();

  size_t connection_count() const { return connections_.size(); }

 private:
  class Connection;
  void Accept();
  void Admit(boost::asio::ip::tcp::socket socket, bool fd_exhausted);
  void OnClosed(uint64_t id);

  boost::asio::io_context& io_;
  // Serves one probe with the spare descriptor after accept found none.
  void AcceptWithSpare();
  void TakeSpare();

  std::function<HealthState()> state_;
  int spare_fd_ = -1;  // /dev/null, given up to answer a probe at EMFILE
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer accept_retry_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<Connection>> connections_;
  bool stopped_ = false;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_HEALTH_H_
