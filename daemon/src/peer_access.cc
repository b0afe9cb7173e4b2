#include "memoffload/daemon/peer_access.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace memoffload::daemon {

std::string AccessDenied(const Policy& policy, const PeerCredentials& peer) {
  if (peer.uid == 0 || peer.uid == geteuid()) return "";
  const auto& uids = policy.allowed_uids;
  const auto& gids = policy.allowed_gids;
  if (std::find(uids.begin(), uids.end(), peer.uid) != uids.end()) return "";
  if (std::find(gids.begin(), gids.end(), peer.gid) != gids.end()) return "";
  return "uid " + std::to_string(peer.uid) + " (gid " + std::to_string(peer.gid) +
         ") may not use this daemon: allowed are root, the daemon's uid " +
         std::to_string(geteuid()) +
         " and access.allowed_uids / access.allowed_gids in the daemon's config";
}

Result<PeerCredentials> PeerOf(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoStatus("reading SO_PEERCRED of the peer", errno);
  }
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

std::string ConnectionLimits::Admit(uid_t uid) {
  if (total_ >= max_total_) {
    return "the socket holds " + std::to_string(total_) +
           " connections, the limit (server.max_connections)";
  }
  size_t& mine = per_uid_[uid];
  if (mine >= max_per_uid_) {
    return "uid " + std::to_string(uid) + " holds " + std::to_string(mine) +
           " connections, the limit (server.max_connections_per_uid)";
  }
  ++mine;
  ++total_;
  return "";
}

void ConnectionLimits::Release(uid_t uid) {
  auto it = per_uid_.find(uid);
  if (it == per_uid_.end() || it->second == 0) return;
  if (--it->second == 0) per_uid_.erase(it);
  --total_;
}

bool ConnectionLimits::Full(uid_t uid) const {
  return total_ >= max_total_ || of_uid(uid) >= max_per_uid_;
}

size_t ConnectionLimits::of_uid(uid_t uid) const {
  auto it = per_uid_.find(uid);
  return it == per_uid_.end() ? 0 : it->second;
}

}  // namespace memoffload::daemon
