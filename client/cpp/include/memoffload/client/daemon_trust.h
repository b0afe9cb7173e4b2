// The client's check of its daemon, done before it sends a byte of data
// (docs/security.md, "Which daemon a trainer trusts").
//
// VerifyRuntimeDir checks a discovered runtime dir and every directory above
// it; VerifySocket the sockets in it; VerifyPeer the process that answers on
// a connected socket (SO_PEERCRED). A dir, socket or peer that is not there
// is UNAVAILABLE (no daemon); one that is there but could belong to another
// user is PERMISSION_DENIED, with a message that says what was wrong and how
// to fix it.
#ifndef MEMOFFLOAD_CLIENT_DAEMON_TRUST_H_
#define MEMOFFLOAD_CLIENT_DAEMON_TRUST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/common/runtime_dir.h"
#include "memoffload/common/status.h"

namespace memoffload::client {

// Names a non-root daemon uid (a number or a user name) that the client
// trusts besides root and itself, e.g. the `memoffload` user of a unit whose
// runtime dir is not /run/memoffload.
inline constexpr const char kDaemonUidEnv[] = "MEMOFFLOAD_DAEMON_UID";

// A runtime dir that passed VerifyRuntimeDir.
struct TrustedRuntimeDir {
  RuntimeDirChoice choice;     // how it was found (to verify it again)
  std::string path;            // as discovered (what messages name)
  std::string resolved;        // without symlinks: what sockets are reached by
  uint32_t owner_uid = 0;      // the dir's owner
  std::vector<uint32_t> uids;  // who may own its sockets and answer on them
};

// Rules, by how the dir was found:
//  - kPerUser: owned by the user (effective uid) and mode 0700;
//  - kSystem, or an explicit dir that resolves to /run/memoffload (which
//    only root can make): any owner, not writable by group or others;
//  - kExplicit: owned by root, the user or the named daemon uid, not writable
//    by group or others.
// The path is resolved one component at a time, and every directory it
// passes through on the way (those above a symlink included, not only those
// above where it leads) is owned by root, the user or the named daemon uid
// and not writable by group or others unless sticky (/tmp); every symlink on
// the way is owned by one of those. So nobody else can change where the path
// leads, and sockets are reached by the resolved path (`resolved`), never by
// the path as given. The trusted uids are root, the user, the dir's owner
// and the named uid.
Result<TrustedRuntimeDir> VerifyRuntimeDir(const RuntimeDirChoice& choice);

// `dir.resolved`/`name` is a socket (not a symlink) owned by one of
// `dir.uids`.
Status VerifySocket(const TrustedRuntimeDir& dir, const std::string& name);

// A connected, blocking socket (SOCK_CLOEXEC) to `dir.resolved`/`name`
// after VerifySocket, whose peer passed VerifyPeer: the only way the client
// reaches its daemon, for the broker and for every gRPC (re)connection. A
// daemon whose queue is full (stopped, overloaded) is tried again until
// `timeout_ms`, then UNAVAILABLE. A path longer than a socket address holds
// is reached through a descriptor of its dir.
Result<int> ConnectVerified(const TrustedRuntimeDir& dir, const std::string& name,
                            int timeout_ms = 2000);

// The peer of connected Unix socket `fd` (reached at `path`) runs as one of
// `dir.uids`.
Status VerifyPeer(const TrustedRuntimeDir& dir, int fd, const std::string& path);

// Discovery then VerifyRuntimeDir and VerifySocket(`socket_name`).
Result<TrustedRuntimeDir> DiscoverTrustedRuntimeDir(const std::string& explicit_dir,
                                                    const std::string& socket_name);

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_DAEMON_TRUST_H_
