// Take-over: a new memoffloadd (`--take-over`) takes the node from the one
// serving it, without a window in which the node has no daemon and without
// building a second arena (docs/restarts.md, "Take-over").
//
// The serving daemon listens on <runtime dir>/takeover.sock, mode 0600; each
// side checks the other's SO_PEERCRED uid is its own. Frames (fd_passing.h):
//
//   new -> old  "takeover <version>"   the newest state format it reads
//   old         v2 and later: freezes its table (every session's call is
//               answered UNAVAILABLE kTakeoverPause, which clients retry);
//               the sessions go with the state and resume on the new one.
//               v1: drains as for SIGTERM (placed state is asked to leave,
//               groups are waited for up to lifecycle.drain_timeout), then
//               closes every session
//   old -> new  "state <instance id> <chunks>" + the snapshot memfd (v2 with
//               the sessions when the new one reads v2)
//               "chunk <index> <uid> <tenant or ->" + the chunk's memfd, each
//               (the tenant last: a job id may hold spaces)
//               "end"
//   new -> old  "ready" once its arena and table are built from them, or
//               "refuse <why>": the old one undrains and serves on
//   old -> new  "listeners" + the broker's and gRPC's listening sockets and
//               the instance lock; it stops its metrics and health ports
//               first, and exits without removing a file the new one uses.
//
// A requester that hangs up during the drain ends it: the old daemon
// undrains (to the drain state it had) and keeps its sessions. A daemon run
// by systemd refuses to be taken over, and `--take-over` refuses to run
// under systemd: there the unit's restart keeps the regions (fd store), and
// the unit would stop when its main process exits.
//
// Every fd the new daemon receives is checked (a memfd of its chunk's size
// and seals, sockets listening at their paths, the lock the runtime dir's)
// and the snapshot decoded before it answers "ready".
#ifndef MEMOFFLOAD_DAEMON_TAKEOVER_H_
#define MEMOFFLOAD_DAEMON_TAKEOVER_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/session_table.h"
#include "core/state_format.h"
#include "memoffload/common/status.h"

namespace memoffload::daemon {

inline constexpr char kTakeoverSocketName[] = "takeover.sock";
// How long a handed session waits for its process to resume it on the new
// daemon before it is closed (its process ended during the take-over).
inline constexpr std::chrono::seconds kResumeWithin{30};

// What the serving daemon hands on.
struct HandoffState {
  uint64_t instance_id = 0;
  std::string snapshot;  // EncodeSnapshot of its committed regions
  struct Chunk {
    uint32_t index = 0;
    int fd = -1;  // not owned
    std::string tenant;
    uid_t uid = 0;
  };
  std::vector<Chunk> chunks;
  // Chunks have tenants (tenant mode is not "none"): one handed on with no
  // tenant was never handed to a process.
  bool tenants = true;
};
struct HandoffListeners {
  int broker_fd = -1;
  int grpc_fd = -1;
  int lock_fd = -1;
};

// The serving daemon's part, called on the take-over's own thread; each
// call returns once the daemon's event loop has done it.
class TakeoverHost {
 public:
  virtual ~TakeoverHost() = default;
  // Stops the node for a take-over by `pid`: with `keep_sessions` it
  // freezes the table at once (sessions go with the state); without, it
  // drains until no group is held or the deadline, then closes every
  // session and freezes the table, unless `gone()` says the requester hung
  // up: then it returns false, having closed nothing (the caller then calls
  // ServeOn).
  virtual bool PauseForTakeover(pid_t pid, bool keep_sessions,
                                const std::function<bool()>& gone) = 0;
  // The state to hand on (valid until Release or ServeOn): the sessions too
  // when they were kept.
  virtual Result<HandoffState> Freeze() = 0;
  // The new daemon refused (or went away): undrain and serve on.
  virtual void ServeOn(const std::string& why) = 0;
  // Stops the metrics and health ports and gives up the listeners (the
  // caller sends them, then calls Exit).
  virtual Result<HandoffListeners> Release() = 0;
  virtual void Exit() = 0;
};

// Accepts take-over requests on a listening socket (the serving daemon).
class TakeoverServer {
 public:
  // Takes `listen_fd`; runs its own thread.
  TakeoverServer(int listen_fd, TakeoverHost* host);
  ~TakeoverServer();
  TakeoverServer(const TakeoverServer&) = delete;
  TakeoverServer& operator=(const TakeoverServer&) = delete;

 private:
  void Run();
  // One conversation; true when the node was handed on.
  bool Converse(int sock, pid_t pid);

  const int listen_fd_;
  TakeoverHost* const host_;
  int stop_pipe_[2] = {-1, -1};
  std::thread thread_;
};

// The new daemon's part.
class TakeoverClient {
 public:
  // Connects to the daemon serving `runtime_dir` and asks for the node;
  // returns once it has handed its state (after its drain): the snapshot is
  // decoded, every chunk fd checked. A state this daemon cannot read is
  // refused here (the old one serves on) and returned as the error.
  static Result<std::unique_ptr<TakeoverClient>> Request(const std::string& runtime_dir,
                                                         uint64_t wait_ms);
  ~TakeoverClient();

  uint64_t instance_id() const { return instance_id_; }
  const SnapshotContents& snapshot() const { return snapshot_; }
  // By chunk index (the caller takes them: Arena::Build's adopt_fds).
  std::vector<int>& chunk_fds() { return chunk_fds_; }
  const std::vector<SessionTable::ChunkOwner>& owners() const { return owners_; }
  // The serving daemon keeps chunk tenants (HandoffState::tenants): a chunk
  // not in owners() was never handed to a process. False from a daemon that
  // does not say so.
  bool owners_complete() const { return owners_complete_; }
  // Says "ready" and receives the listeners (the caller owns them); the old
  // daemon then exits.
  Result<HandoffListeners> Ready(const std::string& broker_path, const std::string& grpc_path,
                                 const std::string& lock_path);
  // Says "refuse <why>": the old daemon serves on.
  void Refuse(const std::string& why);

 private:
  explicit TakeoverClient(int sock) : sock_(sock) {}
  const int sock_;
  uint64_t instance_id_ = 0;
  SnapshotContents snapshot_;
  std::vector<int> chunk_fds_;
  std::vector<SessionTable::ChunkOwner> owners_;
  bool owners_complete_ = false;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_TAKEOVER_H_
