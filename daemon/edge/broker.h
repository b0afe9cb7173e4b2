// Broker: the attach socket. Accepts clients on a Unix stream socket, reads
// their hello and SO_PEERCRED, opens a session and hands out the chunk fds
// (attach_wire.h). The connection then is the session's lifeline: when it
// closes (the process exited or died), the session is closed and everything
// it holds returns to the pool at once. Where the peer's pid is visible, a
// pidfd watch backs this up: it catches a peer that died while a child it
// forked still holds the connection open.
//
// Access: a peer may attach when it passes AccessDenied (peer_access.h):
// root, the daemon's uid, Policy::allowed_uids or a primary gid in
// Policy::allowed_gids. Refusals carry the reason and are counted.
//
// No client can stall the broker (it has one thread, shared with the health
// probes and the signal handlers):
//  - Connections are bounded per uid and in total (server.max_connections*);
//    one past a limit gets a RESOURCE_EXHAUSTED reply and is closed.
//  - Frames are read as their bytes arrive: a length prefix alone allocates
//    nothing. A hello over 64 KiB is refused.
//  - Replies are written without blocking. A connection holds at most one
//    reply (it is not read while its reply is unsent), and a peer that has
//    not taken its reply within kReplyTimeoutMs is dropped (slow reader).
//  - Chunk fds in replies a peer has not read count against the daemon's
//    uid (RLIMIT_NOFILE) until it reads or closes them. So a chunk request
//    that comes while the last reply is unread ends the connection, a
//    request names each chunk once, and a closed connection whose peer
//    still has replies unread keeps its socket and its slot (lingers) until
//    the peer reads or closes them: one uid holds at most
//    max_connections_per_uid replies' fds in flight. Should the kernel still
//    refuse to pass fds (ETOOMANYREFS), a chunk request is refused with
//    RESOURCE_EXHAUSTED and the session goes on.
//  - A failing accept (EMFILE...) backs off, 10 ms doubling to 1 s.
//  - Log lines a peer can cause are rate-limited (MO_LOG_WARN_LIMITED).
//
// An attached session may also ask, on its lifeline, for its job's
// replication keys (LinkKeyRequest): derived for the connection's uid
// (SO_PEERCRED, never a token) and its hello's job id (link_keys.h).
//
// All methods run on the io_context's thread; the broker is not otherwise
// thread-safe.
#ifndef MEMOFFLOAD_DAEMON_BROKER_H_
#define MEMOFFLOAD_DAEMON_BROKER_H_

#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/link_keys.h"
#include "core/session_table.h"
#include "edge/peer_access.h"
#include "memory/arena.h"
#include "observe/metrics.h"

namespace memoffload::daemon {

struct BrokerOptions {
  std::string socket_path;       // where to listen
  std::string grpc_socket_path;  // told to clients in the attach reply
  uint32_t socket_mode = 0660;
  gid_t socket_gid = static_cast<gid_t>(-1);  // -1: keep the daemon's group
  int hello_timeout_ms = 10000;               // a client that sends nothing is dropped
  uint64_t instance_id = 0;                   // random per daemon start, in every attach reply
  size_t max_connections = 1024;              // open connections in total
  size_t max_connections_per_uid = 256;       // open connections of one uid
  // Replication keys served to attached sessions (LinkKeyRequest); null:
  // none (NOT_FOUND). Outlives the broker.
  const LinkKeys* link_keys = nullptr;
};

class Broker {
 public:
  Broker(boost::asio::io_context& io, const Arena* arena, SessionTable* table, Metrics* metrics,
         BrokerOptions options, Policy policy);

  ~Broker();

  // A peer that has not read its reply within this time is dropped.
  static constexpr int kReplyTimeoutMs = 5000;

  // Adopts `listen_fd` (a bound, listening Unix stream socket at
  // options.socket_path) and starts accepting.
  Status Start(int listen_fd);
  // Stops accepting; the socket file is the caller's. Sessions stay.
  void StopAccepting();
  // Stops accepting and gives up the listening socket, still open with its
  // backlog (a take-over hands it on); -1 when there is none.
  int ReleaseListener();
  // Closes every connection and its session (reason kShutdown).
  void CloseAll();
  // Asks every state session to leave (the daemon drains: `why`): each is
  // sent a Notice on its lifeline, once (attach_wire.h).
  void AskToLeave(const std::string& why);
  // Tells every session that the daemon exits keeping it (NoticeResume);
  // Flushed once each notice is written.
  void NoticeResume(const std::string& why);
  bool Flushed() const;
  // Replaces the access policy for future attaches (SIGHUP).
  void SetPolicy(const Policy& policy) { policy_ = policy; }
  size_t connection_count() const { return connections_.size(); }

 private:
  class Connection;
  using Socket = boost::asio::local::stream_protocol::socket;
  // How often lingering sockets are checked.
  static constexpr std::chrono::milliseconds kLingerSweep{250};
  void Accept();
  void AcceptFailed(const boost::system::error_code& ec);
  void OnClosed(uint64_t connection_id, uid_t uid, bool release_slot = true);
  // Keeps `socket` (its connection closed, its peer still holding unread
  // replies) and its uid's connection slot until the peer has read or
  // closed them. An ordinary client reads what it was sent at once (a
  // refusal while draining, say): only a peer that still has not after a
  // sweep is logged (a WARN, rate-limited), once.
  void Linger(Socket socket, const PeerCredentials& peer);
  void ScheduleLingerSweep();

  boost::asio::io_context& io_;
  const Arena* arena_;
  SessionTable* table_;
  Metrics* metrics_;
  const BrokerOptions options_;
  Policy policy_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  boost::asio::steady_timer accept_retry_;
  std::chrono::milliseconds accept_backoff_{0};
  ConnectionLimits limits_;
  uint64_t next_connection_id_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<Connection>> connections_;
  struct Lingering {
    Socket socket;
    PeerCredentials peer;
    bool told = false;  // logged already
  };
  std::vector<Lingering> lingering_;
  boost::asio::steady_timer linger_timer_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_BROKER_H_
