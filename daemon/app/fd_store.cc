#include "app/fd_store.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>

#include "app/process_setup.h"
#include "base/log.h"
#include "memoffload/common/trusted_path.h"
#include "memoffload/shared_mem/fd_passing.h"

namespace memoffload::daemon {
namespace {

Status Errno(const std::string& what) {
  const int e = errno;
  return Status(
      e == EACCES || e == EPERM ? StatusCode::kPermissionDenied : StatusCode::kUnavailable,
      what + ": " + std::strerror(e));
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > kMaxFdName) return false;
  for (char c : name) {
    if (c < 0x21 || c > 0x7e || c == ':') return false;
  }
  return true;
}

Status CheckName(const std::string& name) {
  if (ValidName(name)) return Status::Ok();
  return InvalidArgument("fd store name '" + name +
                         "' is not 1-255 printable characters without ':'");
}

// The uid of the process at the other end of `sock`.
Result<ucred> PeerOf(int sock) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Errno("SO_PEERCRED");
  }
  return cred;
}

class Systemd : public FdStore {
 public:
  std::string Describe() const override { return "systemd's fd store"; }
  std::string Kind() const override { return "systemd"; }
  Result<std::vector<StoredFd>> Take() override {
    char** names = nullptr;
    const int n = sd_listen_fds_with_names(/*unset_environment=*/1, &names);
    if (n < 0) return Internal(std::string("sd_listen_fds_with_names: ") + std::strerror(-n));
    std::vector<StoredFd> out;
    for (int i = 0; i < n; ++i) {
      const int fd = SD_LISTEN_FDS_START + i;
      fcntl(fd, F_SETFD, FD_CLOEXEC);
      out.push_back(StoredFd{names != nullptr && names[i] != nullptr ? names[i] : "", fd});
    }
    if (names != nullptr) {
      for (int i = 0; i < n; ++i) std::free(names[i]);
      std::free(names);
    }
    return out;
  }
  Status Put(const std::string& name, int fd) override {
    MEMOFFLOAD_RETURN_IF_ERROR(CheckName(name));
    const std::string state = "FDSTORE=1\nFDNAME=" + name;
    const int r = sd_pid_notify_with_fds(0, 0, state.c_str(), &fd, 1);
    if (r <= 0) {
      return Unavailable("cannot put " + name + " in systemd's fd store: " +
                         (r == 0 ? std::string("NOTIFY_SOCKET is not set") : std::strerror(-r)));
    }
    return Status::Ok();
  }
  Status Remove(const std::string& name) override {
    MEMOFFLOAD_RETURN_IF_ERROR(CheckName(name));
    const std::string state = "FDSTOREREMOVE=1\nFDNAME=" + name;
    const int r = sd_notify(0, state.c_str());
    if (r <= 0) {
      return Unavailable("cannot remove " + name + " from systemd's fd store: " +
                         (r == 0 ? std::string("NOTIFY_SOCKET is not set") : std::strerror(-r)));
    }
    return Status::Ok();
  }
};

class KeeperClient : public FdStore {
 public:
  // A keeper that stops reading holds a put at most this long (the calls
  // come under the session table's lock); after one such failure the store
  // is given up (every later call fails at once, and says so).
  static constexpr long kSendWaitSeconds = 2;
  static constexpr long kTakeWaitSeconds = 10;
  KeeperClient(std::string path, int sock) : path_(std::move(path)), sock_(sock) {
    timeval send{kSendWaitSeconds, 0}, recv{kTakeWaitSeconds, 0};
    setsockopt(sock_, SOL_SOCKET, SO_SNDTIMEO, &send, sizeof send);
    setsockopt(sock_, SOL_SOCKET, SO_RCVTIMEO, &recv, sizeof recv);
  }
  ~KeeperClient() override { close(sock_); }
  std::string Describe() const override { return "the keeper at " + path_; }
  std::string Kind() const override { return "keeper"; }
  Result<std::vector<StoredFd>> Take() override {
    MEMOFFLOAD_RETURN_IF_ERROR(SendFrame(sock_, "take"));
    std::vector<StoredFd> out;
    while (true) {
      std::string payload;
      std::vector<int> fds;
      if (Status st = RecvFrame(sock_, &payload, &fds); !st.ok()) {
        CloseFds(&fds);
        CloseStored(&out);
        return Unavailable("the keeper at " + path_ + " stopped answering: " + st.message());
      }
      if (payload == "end" && fds.empty()) return out;
      if (payload.rfind("fd ", 0) != 0 || fds.size() != 1 || !ValidName(payload.substr(3))) {
        CloseFds(&fds);
        CloseStored(&out);
        return DataLoss("the keeper at " + path_ + " sent a malformed answer");
      }
      out.push_back(StoredFd{payload.substr(3), fds[0]});
      if (out.size() > kMaxKeptFds) {
        CloseStored(&out);
        return DataLoss("the keeper at " + path_ + " sent more fds than it may hold");
      }
    }
  }
  Status Put(const std::string& name, int fd) override {
    MEMOFFLOAD_RETURN_IF_ERROR(CheckName(name));
    return Send("put " + name, {fd});
  }
  Status Remove(const std::string& name) override {
    MEMOFFLOAD_RETURN_IF_ERROR(CheckName(name));
    return Send("del " + name, {});
  }

 private:
  Status Send(const std::string& frame, const std::vector<int>& fds) {
    if (broken_) return Unavailable("the keeper at " + path_ + " stopped taking fds earlier");
    Status st = SendFrame(sock_, frame, fds);
    if (!st.ok()) {
      broken_ = true;
      return Unavailable("the keeper at " + path_ + " does not take fds (" + st.message() +
                         "): the node's state is no longer kept");
    }
    return st;
  }
  const std::string path_;
  const int sock_;
  bool broken_ = false;  // under the caller's lock (the state store's)
};

// ---- the keeper process ----

volatile sig_atomic_t g_keeper_stop = 0;
void OnKeeperSignal(int) { g_keeper_stop = 1; }

// The dir must be the keeper uid's (or root's) and writable by nobody else.
Status TrustKeeperDir(const std::string& dir) {
  const uid_t me = geteuid();
  if (mkdir(dir.c_str(), me == 0 ? 0755 : 0700) != 0 && errno != EEXIST) {
    return Errno("cannot create the runtime dir " + dir);
  }
  TrustedPathProblem problem;
  const std::string resolved = ResolveTrustedPath(dir, {0, me}, &problem);
  struct stat st {};
  if (resolved.empty() || lstat(resolved.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return PermissionDenied("the runtime dir " + dir +
                            " is not a directory only this user or root can change (" + problem.at +
                            ")");
  }
  if (std::string why = TrustedDirProblem(st.st_uid, st.st_mode, {me}); !why.empty()) {
    return PermissionDenied("the runtime dir " + dir + " " + why +
                            ": another user could replace the keeper's socket");
  }
  // Not even sticky: another user could take the lock's or the socket's name.
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return PermissionDenied("the runtime dir " + dir +
                            " is writable by its group or others: another user could take the "
                            "keeper's socket or lock name first");
  }
  return Status::Ok();
}

// Answers one frame of a connection; false when the connection ends.
bool Serve(int sock, std::map<std::string, int>* kept) {
  std::string payload;
  std::vector<int> fds;
  if (!RecvFrame(sock, &payload, &fds).ok()) {
    CloseFds(&fds);  // those of a frame cut short
    return false;
  }
  bool ok = true;
  if (payload.rfind("put ", 0) == 0 && fds.size() == 1 && ValidName(payload.substr(4))) {
    const std::string name = payload.substr(4);
    auto it = kept->find(name);
    if (it != kept->end()) {
      close(it->second);
      it->second = fds[0];
    } else if (kept->size() < kMaxKeptFds) {
      kept->emplace(name, fds[0]);
    } else {
      MO_LOG_WARN("keeper: full (%zu fds); %s not kept", kept->size(), name.c_str());
      close(fds[0]);
    }
    fds.clear();
  } else if (payload.rfind("del ", 0) == 0 && fds.empty()) {
    auto it = kept->find(payload.substr(4));
    if (it != kept->end()) {
      close(it->second);
      kept->erase(it);
    }
  } else if (payload == "take" && fds.empty()) {
    for (const auto& [name, fd] : *kept) {
      if (!SendFrame(sock, "fd " + name, {fd}).ok()) return false;
    }
    ok = SendFrame(sock, "end").ok();
  } else {
    MO_LOG_WARN("keeper: malformed request; connection closed");
    ok = false;
  }
  CloseFds(&fds);
  return ok;
}

}  // namespace

void CloseStored(std::vector<StoredFd>* fds) {
  for (StoredFd& f : *fds) {
    if (f.fd >= 0) close(f.fd);
  }
  fds->clear();
}

std::unique_ptr<FdStore> SystemdFdStore() { return std::make_unique<Systemd>(); }

Result<int> ConnectOwnSocket(const std::string& socket_path, const std::string& what) {
  struct stat st {};
  if (lstat(socket_path.c_str(), &st) != 0) return Errno("no " + what + " at " + socket_path);
  if (!S_ISSOCK(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 0077) != 0) {
    return PermissionDenied("refusing the " + what + " socket " + socket_path +
                            ": it must be a socket of this user (uid " + std::to_string(geteuid()) +
                            "), mode 0600");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof addr.sun_path) {
    return InvalidArgument(what + " socket path too long: " + socket_path);
  }
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return Errno("socket");
  if (connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    Status st = Errno("cannot connect to the " + what + " at " + socket_path);
    close(sock);
    return st;
  }
  Result<ucred> peer = PeerOf(sock);
  if (!peer.ok() || peer->uid != geteuid()) {
    close(sock);
    return PermissionDenied("the " + what + " at " + socket_path + " runs as uid " +
                            (peer.ok() ? std::to_string(peer->uid) : "?") +
                            ", not this daemon's uid " + std::to_string(geteuid()));
  }
  return sock;
}

Result<std::unique_ptr<FdStore>> ConnectKeeper(const std::string& socket_path) {
  Result<int> sock = ConnectOwnSocket(socket_path, "keeper");
  if (!sock.ok()) return sock.status();
  return std::unique_ptr<FdStore>(std::make_unique<KeeperClient>(socket_path, *sock));
}

Status RunKeeper(const std::string& path) {
  RaiseSoftDescriptorLimit();  // one fd per arena chunk
  const std::string dir = path.substr(0, path.rfind('/'));
  MEMOFFLOAD_RETURN_IF_ERROR(TrustKeeperDir(dir.empty() ? "/" : dir));
  // One lock per socket path: pods that share the runtime dir each run a
  // keeper of their own (lifecycle.keeper_socket).
  const std::string lock_path = path + ".lock";
  int lock = -1;
  for (int attempt = 0;; ++attempt) {
    lock = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (lock < 0) return Errno("cannot open " + lock_path);
    if (flock(lock, LOCK_EX | LOCK_NB) != 0) {
      close(lock);
      return FailedPrecondition("another keeper holds " + lock_path);
    }
    // A keeper that stopped meanwhile removed the file this lock is on.
    struct stat held {
    }, named{};
    if (fstat(lock, &held) == 0 && stat(lock_path.c_str(), &named) == 0 &&
        held.st_ino == named.st_ino && held.st_dev == named.st_dev) {
      break;
    }
    close(lock);
    if (attempt == 3) return Unavailable("the keeper lock " + lock_path + " keeps changing");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return InvalidArgument("socket path too long: " + path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  // Stale (one killed leaves its socket) unless something still listens: a
  // keeper of an earlier version, whose lock had another name.
  struct stat old {};
  if (lstat(path.c_str(), &old) == 0) {
    if (!S_ISSOCK(old.st_mode)) {
      close(lock);
      return FailedPrecondition(path + " is there and is not a socket: remove it");
    }
    const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool live = connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    close(probe);
    if (live) {
      close(lock);
      return FailedPrecondition("a keeper already listens at " + path);
    }
    unlink(path.c_str());
  }
  const int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const mode_t old_umask = umask(0177);
  const bool bound = bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  umask(old_umask);
  if (!bound || chmod(path.c_str(), 0600) != 0 || listen(listener, 8) != 0) {
    Status st = Errno("cannot listen on " + path);
    close(listener);
    return st;
  }
  struct sigaction sa {};
  sa.sa_handler = OnKeeperSignal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  MO_LOG_INFO("keeper: holding the daemon's memfds at %s (uid %u only)", path.c_str(), geteuid());
  std::map<std::string, int> kept;
  std::vector<int> conns;
  // Same-uid peers only; a daemon keeps one open for its life.
  constexpr size_t kMaxConnections = 64;
  while (!g_keeper_stop) {
    std::vector<pollfd> fds{{listener, POLLIN, 0}};
    for (int c : conns) fds.push_back({c, POLLIN, 0});
    if (poll(fds.data(), fds.size(), 1000) < 0) continue;  // EINTR: look at the flag
    // Oldest connection first, each read to its last frame: what a daemon
    // that died sent before its successor asks to take is done first.
    std::vector<int> closed;
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      bool open = (fds[i].revents & POLLIN) != 0;
      while (open) {
        open = Serve(fds[i].fd, &kept);
        pollfd more{fds[i].fd, POLLIN, 0};
        if (open && (poll(&more, 1, 0) != 1 || (more.revents & POLLIN) == 0)) break;
      }
      if (!open) closed.push_back(fds[i].fd);
    }
    for (int c : closed) {
      close(c);
      conns.erase(std::find(conns.begin(), conns.end(), c));
    }
    if ((fds[0].revents & POLLIN) != 0) {
      const int c = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      Result<ucred> peer = PeerOf(c);
      if (!peer.ok() || peer->uid != geteuid() || conns.size() >= kMaxConnections) {
        MO_LOG_WARN("keeper: refused a connection from uid %d pid %d (%s)",
                    peer.ok() ? static_cast<int>(peer->uid) : -1,
                    peer.ok() ? static_cast<int>(peer->pid) : -1,
                    peer.ok() && peer->uid == geteuid() ? "too many connections"
                                                        : "only this user may connect");
        close(c);
        continue;
      }
      // A peer that stops mid-frame holds the keeper this long at most.
      timeval timeout{5, 0};
      setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
      setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
      conns.push_back(c);
    }
  }
  MO_LOG_INFO("keeper: stopping; releasing %zu fds", kept.size());
  for (int c : conns) close(c);
  for (auto& [name, fd] : kept) close(fd);
  close(listener);
  // Nothing stale is left in a runtime dir that pods come and go in.
  unlink(path.c_str());
  unlink(lock_path.c_str());
  close(lock);
  return Status::Ok();
}

}  // namespace memoffload::daemon
