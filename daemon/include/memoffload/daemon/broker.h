// Broker: the attach socket. Accepts clients on a Unix stream socket, reads
// their hello and SO_PEERCRED, opens a session and hands out the chunk fds
// (attach_wire.h). The connection then is the session's lifeline: when it
// closes (the process exited or died), the session is closed and everything
// it holds returns to the pool at once. Where the peer's pid is visible, a
// pidfd watch backs this up: it catches a peer that died while a child it
// forked still holds the connection open.
//
// Access: a peer may attach when its uid is root, the daemon's uid, or in
// Policy::allowed_uids, or its primary gid is in Policy::allowed_gids.
// Refusals carry the reason and are counted.
//
// All methods run on the io_context's thread; the broker is not otherwise
// thread-safe.
#ifndef MEMOFFLOAD_DAEMON_BROKER_H_
#define MEMOFFLOAD_DAEMON_BROKER_H_

#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <memory>
#include <string>
#include <unordered_map>

#include "memoffload/daemon/arena.h"
#include "memoffload/daemon/metrics.h"
#include "memoffload/daemon/session_table.h"

namespace memoffload::daemon {

struct BrokerOptions {
  std::string socket_path;       // where to listen
  std::string grpc_socket_path;  // told to clients in the attach reply
  uint32_t socket_mode = 0660;
  gid_t socket_gid = static_cast<gid_t>(-1);  // -1: keep the daemon's group
  int hello_timeout_ms = 10000;               // a client that sends nothing is dropped
  uint64_t instance_id = 0;                   // random per daemon start, in every attach reply
};

class Broker {
 public:
  Broker(boost::asio::io_context& io, const Arena* arena, SessionTable* table, Metrics* metrics,
         BrokerOptions options, Policy policy);

  ~Broker();

  // Binds and listens (replacing a stale socket file), then accepts.
  Status Start();
  // Stops accepting and removes the socket file; sessions stay.
  void StopAccepting();
  // Closes every connection and its session (reason kShutdown).
  void CloseAll();
  // Replaces the access policy for future attaches (SIGHUP).
  void SetPolicy(const Policy& policy) { policy_ = policy; }
  size_t connection_count() const { return connections_.size(); }

 private:
  class Connection;
  void Accept();
  // Empty when the peer may attach, else why not.
  std::string AccessDenied(const PeerCredentials& peer) const;
  void OnClosed(uint64_t connection_id);

  boost::asio::io_context& io_;
  const Arena* arena_;
  SessionTable* table_;
  Metrics* metrics_;
  const BrokerOptions options_;
  Policy policy_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  uint64_t next_connection_id_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<Connection>> connections_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_BROKER_H_
