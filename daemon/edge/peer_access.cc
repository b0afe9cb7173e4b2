#include "edge/peer_access.h"

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
  auto allowed_gid = [&](gid_t g) {
    return (policy.socket_gid >= 0 && g == static_cast<gid_t>(policy.socket_gid)) ||
           std::find(gids.begin(), gids.end(), g) != gids.end();
  };
  if (allowed_gid(peer.gid)) return "";
  for (gid_t g : peer.groups) {
    if (allowed_gid(g)) return "";
  }
  std::string groups;
  for (gid_t g : peer.groups) groups += (groups.empty() ? "" : ",") + std::to_string(g);
  return "uid " + std::to_string(peer.uid) + " (gid " + std::to_string(peer.gid) +
         (groups.empty() ? "" : ", groups " + groups) +
         ") may not use this daemon: allowed are root, the daemon's uid " +
         std::to_string(geteuid()) +
         (policy.socket_gid >= 0
              ? ", members of the socket group " + std::to_string(policy.socket_gid)
              : std::string()) +
         " and access.allowed_uids / access.allowed_gids in the daemon's config";
}

Result<PeerCredentials> PeerOf(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoStatus("reading SO_PEERCRED of the peer", errno);
  }
  PeerCredentials peer{cred.pid, cred.uid, cred.gid, {}};
  // The supplementary groups the peer had when it connected: a trainer that
  // joined the socket group (usermod -aG) has it there, not as its primary.
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 4; ++attempt) {
    socklen_t bytes = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &bytes) == 0) {
      groups.resize(bytes / sizeof(gid_t));
      peer.groups = std::move(groups);
      return peer;
    }
    if (errno != ERANGE) return ErrnoStatus("reading SO_PEERGROUPS of the peer", errno);
    groups.resize(bytes / sizeof(gid_t) + 1);  // the kernel said how many
  }
  return Internal("reading SO_PEERGROUPS of the peer: its group list kept growing");
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
