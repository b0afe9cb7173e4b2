// Who may talk to the daemon's Unix sockets, and how many connections each
// peer may hold. The broker and the gRPC listener apply the same rules, by
// the peer credentials the kernel reports (SO_PEERCRED), at accept.
#ifndef MEMOFFLOAD_DAEMON_PEER_ACCESS_H_
#define MEMOFFLOAD_DAEMON_PEER_ACCESS_H_

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <unordered_map>

#include "config/config.h"
#include "core/session_table.h"
#include "memoffload/common/status.h"

namespace memoffload::daemon {

// Empty when the peer may use the daemon, else why not. Allowed: root, the
// daemon's uid, Policy::allowed_uids, and a primary or supplementary gid
// that is the socket group (Policy::socket_gid) or in Policy::allowed_gids.
std::string AccessDenied(const Policy& policy, const PeerCredentials& peer);

// The credentials of the peer of a connected Unix socket, supplementary
// groups included.
Result<PeerCredentials> PeerOf(int fd);

// Open connections on one socket, per peer uid and in total. Not
// thread-safe: one owner (the event loop's thread) calls it.
class ConnectionLimits {
 public:
  ConnectionLimits(size_t max_total, size_t max_per_uid)
      : max_total_(max_total), max_per_uid_(max_per_uid) {}

  // Empty and counted when a new connection of `uid` fits both limits;
  // else why not (nothing is counted).
  std::string Admit(uid_t uid);
  // Forgets one connection of `uid` admitted before.
  void Release(uid_t uid);
  // True when a connection of `uid` would be refused right now.
  bool Full(uid_t uid) const;

  size_t total() const { return total_; }
  size_t of_uid(uid_t uid) const;

 private:
  const size_t max_total_;
  const size_t max_per_uid_;
  size_t total_ = 0;
  std::unordered_map<uid_t, size_t> per_uid_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_PEER_ACCESS_H_
