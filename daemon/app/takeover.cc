#include "app/takeover.h"

#include <absl/strings/match.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdlib>
#include <cstring>

#include "app/fd_store.h"
#include "app/state_store.h"
#include "base/log.h"
#include "memoffload/shared_mem/fd_passing.h"

namespace memoffload::daemon {
namespace {

// How long the new daemon may take to build its arena from the chunks (the
// serving daemon is frozen meanwhile: clients wait as long, no longer).
constexpr int kReadyWaitSeconds = kTakeoverPauseMaxMs / 1000;

void SetWait(int sock, long seconds) {
  timeval t{seconds, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof t);
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &t, sizeof t);
}

// The path a listening Unix socket is bound to, "" if it is not one.
std::string ListeningPath(int fd) {
  int listening = 0;
  socklen_t len = sizeof listening;
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) return "";
  sockaddr_un addr{};
  len = sizeof addr;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      addr.sun_family != AF_UNIX) {
    return "";
  }
  return std::string(addr.sun_path, strnlen(addr.sun_path, sizeof addr.sun_path));
}

// Whether two paths name the same file: their dirs resolved ("/run/x/" and
// "/run/x" alike), their names equal.
bool SamePath(const std::string& a, const std::string& b) {
  auto split = [](const std::string& p) {
    const size_t slash = p.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : p.substr(0, slash + 1);
    char* real = realpath(dir.c_str(), nullptr);
    std::string out = real != nullptr ? std::string(real) : dir;
    std::free(real);
    return out + "/" + (slash == std::string::npos ? p : p.substr(slash + 1));
  };
  return !a.empty() && split(a) == split(b);
}

// Waits until `sock` is readable or `stop` is (true only for the first).
bool WaitReadable(int sock, int stop, int seconds) {
  pollfd fds[2] = {{sock, POLLIN, 0}, {stop, POLLIN, 0}};
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < until) {
    const int n = poll(fds, 2, 200);
    if (n < 0 && errno != EINTR) return false;
    if (n > 0) return fds[1].revents == 0 && fds[0].revents != 0;
  }
  return false;
}

// Whether the peer of `sock` hung up (it sends nothing during a drain).
bool HungUp(int sock) {
  char c;
  const ssize_t n = recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

bool SameFile(int fd, const std::string& path) {
  struct stat a {
  }, b{};
  return fstat(fd, &a) == 0 && lstat(path.c_str(), &b) == 0 && S_ISREG(b.st_mode) &&
         a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

}  // namespace

// ---- the serving daemon ----

TakeoverServer::TakeoverServer(int listen_fd, TakeoverHost* host)
    : listen_fd_(listen_fd), host_(host) {
  if (pipe2(stop_pipe_, O_CLOEXEC) != 0) stop_pipe_[0] = stop_pipe_[1] = -1;
  thread_ = std::thread([this] { Run(); });
}

TakeoverServer::~TakeoverServer() {
  if (stop_pipe_[1] >= 0) {
    const char c = 0;
    (void)!write(stop_pipe_[1], &c, 1);
  }
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  for (int fd : stop_pipe_) {
    if (fd >= 0) close(fd);
  }
}

void TakeoverServer::Run() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_pipe_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    const int sock = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (sock < 0) continue;
    ucred peer{};
    socklen_t len = sizeof peer;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0 || peer.uid != geteuid()) {
      MO_LOG_WARN(
          "take-over: refused a request from uid %d pid %d: only this daemon's uid (%u) "
          "may take it over",
          static_cast<int>(peer.uid), static_cast<int>(peer.pid), geteuid());
      close(sock);
      continue;
    }
    const bool handed = Converse(sock, peer.pid);
    close(sock);
    if (handed) return;
  }
}

bool TakeoverServer::Converse(int sock, pid_t pid) {
  SetWait(sock, 10);
  std::string payload;
  std::vector<int> fds;
  if (!WaitReadable(sock, stop_pipe_[0], 10) || !RecvFrame(sock, &payload, &fds).ok() ||
      !fds.empty() || payload.rfind("takeover ", 0) != 0) {
    CloseFds(&fds);
    MO_LOG_WARN("take-over: pid %d sent no valid request; serving on", static_cast<int>(pid));
    return false;
  }
  const uint32_t reads = static_cast<uint32_t>(std::strtoul(payload.c_str() + 9, nullptr, 10));
  std::string why;
  if (std::getenv("NOTIFY_SOCKET") != nullptr) {
    why =
        "this daemon runs under systemd: restart the unit instead (its fd store keeps the "
        "checkpoint regions; the unit would stop when this process exits)";
  } else if (reads < 1) {
    why = "it names no state format it reads";
  }
  if (!why.empty()) {
    (void)!SendFrame(sock, "refused " + why).ok();
    MO_LOG_WARN("take-over by pid %d refused: %s; serving on", static_cast<int>(pid), why.c_str());
    return false;
  }
  // A daemon that reads v2 takes the sessions too; an older one gets the
  // regions, after a drain.
  const bool keep_sessions = reads >= 2;
  MO_LOG_INFO("take-over requested by pid %d: %s, then handing on the arena", static_cast<int>(pid),
              keep_sessions ? "pausing the sessions" : "draining (it cannot resume sessions)");
  const int stop = stop_pipe_[0];
  if (!host_->PauseForTakeover(pid, keep_sessions, [sock, stop] {
        pollfd p{stop, POLLIN, 0};
        return HungUp(sock) || poll(&p, 1, 0) == 1;
      })) {
    host_->ServeOn("the new daemon went away during the drain");
    return false;
  }
  Result<HandoffState> state = host_->Freeze();
  if (!state.ok()) {
    host_->ServeOn("cannot hand on the state: " + state.status().message());
    return false;
  }
  Result<int> snapshot = SealedMemfd("memoffload-handoff", state->snapshot);
  Status sent = snapshot.status();
  if (sent.ok()) {
    char head[96];
    // " tenants": a newer daemon reads it (an older one ignores the rest).
    std::snprintf(head, sizeof head, "state %016" PRIx64 " %zu%s", state->instance_id,
                  state->chunks.size(), state->tenants ? " tenants" : "");
    sent = SendFrame(sock, head, {*snapshot});
    close(*snapshot);
  }
  for (size_t i = 0; sent.ok() && i < state->chunks.size(); ++i) {
    const HandoffState::Chunk& c = state->chunks[i];
    sent = SendFrame(sock,
                     "chunk " + std::to_string(c.index) + " " + std::to_string(c.uid) + " " +
                         (c.tenant.empty() ? "-" : c.tenant),
                     {c.fd});
  }
  if (sent.ok()) sent = SendFrame(sock, "end");
  SetWait(sock, kReadyWaitSeconds);
  if (sent.ok() && !WaitReadable(sock, stop_pipe_[0], kReadyWaitSeconds)) {
    sent = Unavailable("no answer within " + std::to_string(kReadyWaitSeconds) +
                       " s, or this daemon is stopping");
  }
  if (sent.ok()) sent = RecvFrame(sock, &payload, &fds);
  CloseFds(&fds);
  if (!sent.ok() || payload != "ready") {
    host_->ServeOn(!sent.ok() ? "the new daemon went away (" + sent.message() + ")"
                   : payload.rfind("refuse ", 0) == 0
                       ? "the new daemon refused the state: " + payload.substr(7)
                       : "the new daemon answered nonsense");
    return false;
  }
  Result<HandoffListeners> listeners = host_->Release();
  if (!listeners.ok()) {
    host_->ServeOn("cannot release the listeners: " + listeners.status().message());
    return false;
  }
  // From here the node is the new daemon's, whatever happens to this one.
  if (Status st = SendFrame(sock, "listeners",
                            {listeners->broker_fd, listeners->grpc_fd, listeners->lock_fd});
      !st.ok()) {
    MO_LOG_ERROR("take-over: cannot send the listeners: %s; exiting anyway", st.ToString().c_str());
  }
  // Released by their owners: this process keeps no listener (one that
  // waits after the hand-over would hold connections of a later start).
  for (int fd : {listeners->broker_fd, listeners->grpc_fd}) {
    if (fd >= 0) close(fd);
  }
  MO_LOG_INFO("take-over: the node is pid %d's now", static_cast<int>(pid));
  host_->Exit();
  return true;
}

// ---- the new daemon ----

Result<std::unique_ptr<TakeoverClient>> TakeoverClient::Request(const std::string& runtime_dir,
                                                                uint64_t wait_ms) {
  Result<int> sock =
      ConnectOwnSocket(runtime_dir + "/" + kTakeoverSocketName, "serving daemon's take-over");
  if (!sock.ok()) return sock.status();
  std::unique_ptr<TakeoverClient> c(new TakeoverClient(*sock));
  MEMOFFLOAD_RETURN_IF_ERROR(
      SendFrame(c->sock_, "takeover " + std::to_string(kStateFormatVersion)));
  SetWait(c->sock_, static_cast<long>(wait_ms / 1000 + 60));
  std::string payload;
  std::vector<int> fds;
  if (Status st = RecvFrame(c->sock_, &payload, &fds); !st.ok()) {
    return Unavailable("the serving daemon did not hand on its state: " + st.message());
  }
  if (payload.rfind("refused ", 0) == 0) {
    return FailedPrecondition("the serving daemon refused the take-over: " + payload.substr(8));
  }
  uint64_t instance = 0;
  size_t chunks = 0;
  if (std::sscanf(payload.c_str(), "state %" SCNx64 " %zu", &instance, &chunks) != 2 ||
      fds.size() != 1 || chunks > (1u << 20)) {
    CloseFds(&fds);
    return DataLoss("the serving daemon's answer is malformed");
  }
  c->instance_id_ = instance;
  c->owners_complete_ = absl::EndsWith(payload, " tenants");
  Result<SnapshotContents> snapshot = DecodeSnapshotFd(fds[0]);
  const std::string why = MemfdProblem(fds[0], 0, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE);
  CloseFds(&fds);
  if (!why.empty() || !snapshot.ok()) {
    const std::string problem =
        !why.empty() ? "the snapshot is " + why : snapshot.status().message();
    c->Refuse(problem);
    return Status(snapshot.ok() ? StatusCode::kDataLoss : snapshot.status().code(),
                  "refused the serving daemon's state: " + problem);
  }
  c->snapshot_ = std::move(snapshot).value();
  const ArenaLayout& layout = c->snapshot_.layout;
  c->chunk_fds_.assign(layout.chunk_count(), -1);
  for (size_t i = 0; i <= chunks; ++i) {
    if (Status st = RecvFrame(c->sock_, &payload, &fds); !st.ok()) {
      return Unavailable("the serving daemon stopped handing on its chunks: " + st.message());
    }
    if (payload == "end" && fds.empty() && i == chunks) break;
    uint64_t index = UINT64_MAX;
    uint64_t uid = 0;
    int tenant_at = -1;
    std::string tenant;
    if (std::sscanf(payload.c_str(), "chunk %" SCNu64 " %" SCNu64 " %n", &index, &uid,
                    &tenant_at) == 2 &&
        tenant_at > 0 && static_cast<size_t>(tenant_at) < payload.size()) {
      tenant = payload.substr(static_cast<size_t>(tenant_at));
    }
    if (tenant.empty() || fds.size() != 1 || index >= c->chunk_fds_.size() ||
        c->chunk_fds_[index] >= 0 || uid > UINT32_MAX) {
      CloseFds(&fds);
      c->Refuse("malformed chunk frame");
      return DataLoss("the serving daemon sent a malformed chunk frame");
    }
    const uint64_t size =
        std::min(layout.chunk_bytes, layout.capacity_bytes - index * layout.chunk_bytes);
    if (std::string bad = MemfdProblem(fds[0], size, F_SEAL_SHRINK | F_SEAL_GROW); !bad.empty()) {
      CloseFds(&fds);
      c->Refuse("chunk " + std::to_string(index) + " " + bad);
      return DataLoss("refused the serving daemon's chunk " + std::to_string(index) + ": " + bad);
    }
    c->chunk_fds_[index] = fds[0];
    fds.clear();
    if (tenant != "-") {
      c->owners_.push_back(
          SessionTable::ChunkOwner{static_cast<uint32_t>(index), tenant, static_cast<uid_t>(uid)});
    }
  }
  return c;
}

TakeoverClient::~TakeoverClient() {
  for (int fd : chunk_fds_) {
    if (fd >= 0) close(fd);
  }
  close(sock_);
}

void TakeoverClient::Refuse(const std::string& why) {
  (void)!SendFrame(sock_, "refuse " + why).ok();
}

Result<HandoffListeners> TakeoverClient::Ready(const std::string& broker_path,
                                               const std::string& grpc_path,
                                               const std::string& lock_path) {
  MEMOFFLOAD_RETURN_IF_ERROR(SendFrame(sock_, "ready"));
  std::string payload;
  std::vector<int> fds;
  if (Status st = RecvFrame(sock_, &payload, &fds); !st.ok()) {
    return Unavailable("the serving daemon did not hand on its listeners: " + st.message());
  }
  if (payload != "listeners" || fds.size() != 3 || !SamePath(ListeningPath(fds[0]), broker_path) ||
      !SamePath(ListeningPath(fds[1]), grpc_path) || !SameFile(fds[2], lock_path)) {
    CloseFds(&fds);
    return DataLoss("the serving daemon handed on listeners that are not " + broker_path + ", " +
                    grpc_path + " and " + lock_path);
  }
  return HandoffListeners{fds[0], fds[1], fds[2]};
}

}  // namespace memoffload::daemon
