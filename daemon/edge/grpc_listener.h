// GrpcListener: accepts on the gRPC Unix socket itself and hands each
// admitted connection to the gRPC server (grpc::AddInsecureChannelFromFd),
// so that the daemon, not gRPC, decides who may connect and what happens when
// accept fails.
//
//  - Access: the peer's uid/gid (SO_PEERCRED) must pass the same policy as
//    the broker (peer_access.h); a refused peer's connection is closed before
//    gRPC sees a byte, so it cannot list sessions or call anything.
//  - Limits: server.max_connections in total and server.max_connections_per_uid
//    per uid; a connection counts until the relay sees it closed.
//  - What a peer may send: every admitted connection goes through the
//    EdgeRelay (edge_relay.h), which passes gRPC only whole HTTP/2 frames
//    that keep the H2Guard's rules and closes a connection that breaks one.
//    The uid of such a peer then has its new connections refused for a
//    while: 1 s, doubling with each strike within a minute, at most 30 s.
//  - Exhaustion: when accept fails (EMFILE, ENFILE, ENOMEM...), the listener
//    backs off (10 ms doubling to 1 s) and retries until accept works again;
//    meanwhile Problem() says why the data plane does not serve, and /readyz
//    reports it.
//
// Runs on the io_context's thread; not otherwise thread-safe.
#ifndef MEMOFFLOAD_DAEMON_GRPC_LISTENER_H_
#define MEMOFFLOAD_DAEMON_GRPC_LISTENER_H_

#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <string>
#include <unordered_map>

#include "config/config.h"
#include "edge/edge_relay.h"
#include "edge/peer_access.h"

namespace grpc {
class Server;
}

namespace memoffload::daemon {

class GrpcListener {
 public:
  GrpcListener(boost::asio::io_context& io, Policy policy, size_t max_total, size_t max_per_uid);
  ~GrpcListener();
  GrpcListener(const GrpcListener&) = delete;
  GrpcListener& operator=(const GrpcListener&) = delete;

  // Takes ownership of `listen_fd` (a listening Unix stream socket; closed
  // with the listener). Connections wait in its backlog until Start.
  Status Adopt(int listen_fd);
  // Starts handing accepted connections to `server`, which must outlive
  // Stop().
  void Start(grpc::Server* server);
  // Closes the listening socket; admitted connections keep being served
  // (through the relay) until the listener is destroyed.
  void Stop();
  // Stops accepting and gives up the listening socket, still open with its
  // backlog (a take-over hands it on); -1 when there is none.
  int ReleaseListener();
  // Called (on the event loop's thread) for each connection the relay
  // closed because its peer broke an HTTP/2 rule (the daemon counts them).
  void OnViolation(std::function<void(H2Violation)> count) { count_violation_ = std::move(count); }
  // Replaces the access policy for future connections (SIGHUP).
  void SetPolicy(const Policy& policy) { policy_ = policy; }
  // Empty while accepting works; else why the data plane cannot accept.
  const std::string& Problem() const { return problem_; }
  // Admitted connections still open.
  size_t connection_count() const { return limits_.total(); }

 private:
  void WaitForConnection();
  void AcceptPending();
  // False when the daemon ran out of descriptors handling `fd` (the caller
  // backs off as if accept had failed).
  bool OnAccepted(int fd);
  void BackOff(int error);
  // Accepting works again: clears the problem BackOff set (logged once) and
  // the back-off.
  void Accepting();
  void Penalize(uid_t uid, H2Violation why);
  // Empty when `uid` may connect now; else why not.
  std::string Penalized(uid_t uid);

  boost::asio::io_context& io_;
  Policy policy_;
  ConnectionLimits limits_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  boost::asio::steady_timer retry_;
  std::chrono::milliseconds backoff_{0};
  grpc::Server* server_ = nullptr;
  std::string problem_;
  bool stopped_ = false;
  struct Penalty {
    int strikes = 0;
    std::chrono::steady_clock::time_point last_strike;
    std::chrono::steady_clock::time_point until;
  };
  std::unordered_map<uid_t, Penalty> penalties_;
  std::function<void(H2Violation)> count_violation_;
  // Last: stopped (its connections closed) before the members above go.
  EdgeRelay relay_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_GRPC_LISTENER_H_
