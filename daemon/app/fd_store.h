// FdStore: where the daemon's memfds (arena chunks, the state journal and
// snapshot) outlive its process, so that a restart takes them back.
//
// - systemd's file-descriptor store (FDSTORE=1 with FDNAME=; the unit sets
//   FileDescriptorStoreMax=). systemd hands the fds back to the next start
//   as LISTEN_FDS with LISTEN_FDNAMES, for a restart (also an automatic one
//   after a crash) but not after a full `systemctl stop`: systemd 252 has no
//   FileDescriptorStorePreserve=.
// - the keeper: `memoffloadd keeper`, a small process of the same uid that
//   holds them (for containers without systemd: a second container of the
//   daemon's pod, sharing the runtime dir). It listens on
//   <runtime dir>/keeper.sock (lifecycle.keeper_socket), mode 0600; each side checks the other's
//   SO_PEERCRED uid is its own. Frames (fd_passing.h): "put <name>" with one
//   fd, "del <name>", "take" (answered by "fd <name>" frames, one fd each,
//   then "end").
//
// Names are at most kMaxFdName printable ASCII characters without ':' or
// space (systemd's rule). An fd put under a name that is already there
// replaces it (the keeper), or is added beside it (systemd, which removes
// by name only): callers Remove first.
#ifndef MEMOFFLOAD_DAEMON_FD_STORE_H_
#define MEMOFFLOAD_DAEMON_FD_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload::daemon {

inline constexpr size_t kMaxFdName = 255;
// The most fds a keeper holds: one per chunk (up to 65536) and a few more.
inline constexpr size_t kMaxKeptFds = 65536 + 64;

struct StoredFd {
  std::string name;
  int fd = -1;  // owned by whoever holds the StoredFd
};
void CloseStored(std::vector<StoredFd>* fds);

class FdStore {
 public:
  virtual ~FdStore() = default;
  // "systemd's fd store", "the keeper at <path>".
  virtual std::string Describe() const = 0;
  // "systemd" or "keeper" (the metrics' label).
  virtual std::string Kind() const = 0;
  // The fds kept for this daemon; called once, at start. The caller owns them.
  virtual Result<std::vector<StoredFd>> Take() = 0;
  // Keeps a duplicate of `fd` (still the caller's) under `name`.
  virtual Status Put(const std::string& name, int fd) = 0;
  virtual Status Remove(const std::string& name) = 0;
};

// systemd's store (NOTIFY_SOCKET must be set).
std::unique_ptr<FdStore> SystemdFdStore();
// Connects to the keeper at `socket_path`: the socket must be the daemon
// uid's, mode 0600, and the listening process of the same uid.
Result<std::unique_ptr<FdStore>> ConnectKeeper(const std::string& socket_path);

// Connects to the Unix socket at `socket_path`, which must be this uid's,
// mode 0600, with a listening process of this uid (`what` names it in
// errors: "keeper", "serving daemon"). Returns the connected socket.
Result<int> ConnectOwnSocket(const std::string& socket_path, const std::string& what);

// `memoffloadd keeper`: keeps fds for the daemon, listening at
// `socket_path` (lifecycle.keeper_socket; its lock is `socket_path`.lock),
// until SIGTERM or SIGINT; it removes both as it stops. Returns an error
// when it cannot start.
Status RunKeeper(const std::string& socket_path);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_FD_STORE_H_
