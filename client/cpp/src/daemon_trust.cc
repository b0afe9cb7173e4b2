#include "memoffload/client/daemon_trust.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "memoffload/common/trusted_path.h"

namespace memoffload::client {
namespace {

constexpr uint32_t kNoUid = UINT32_MAX;

std::string Octal(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

std::string Uid(uint32_t uid) { return "uid " + std::to_string(uid); }

// The uid $MEMOFFLOAD_DAEMON_UID names (a number or a user name), kNoUid when
// it is unset.
Result<uint32_t> NamedDaemonUid() {
  const char* value = std::getenv(kDaemonUidEnv);
  if (value == nullptr || value[0] == '\0') return kNoUid;
  char* end = nullptr;
  errno = 0;
  const unsigned long uid = std::strtoul(value, &end, 10);
  if (errno == 0 && end != value && *end == '\0' && uid < kNoUid) {
    return static_cast<uint32_t>(uid);
  }
  passwd pw;
  passwd* found = nullptr;
  char buf[4096];
  if (getpwnam_r(value, &pw, buf, sizeof(buf), &found) == 0 && found != nullptr) {
    return static_cast<uint32_t>(found->pw_uid);
  }
  return InvalidArgument(std::string("$") + kDaemonUidEnv + "=" + value +
                         " is neither a uid nor a known user name");
}

std::string Refused(const std::string& what) {
  return "refusing the memoffload daemon: " + what + "; nothing was sent to it";
}

// Trusting a uid lets it replace the daemon: the hint says so, so that
// nobody names a stranger's uid to make a refusal go away.
std::string UidHint(uint32_t uid) {
  return " (only if uid " + std::to_string(uid) +
         " runs your daemon, and you trust it: " + kDaemonUidEnv + "=" + std::to_string(uid) + ")";
}

// Why a directory owned by `st.st_uid` with `st.st_mode` is not one that
// only root, the user or the named uid can change ("" when it is).
std::string DirProblem(const struct stat& st, uint32_t named) {
  const uint32_t me = geteuid();
  if (TrustedDirProblem(st.st_uid, st.st_mode, {0, me, named}).empty()) return "";
  if (st.st_uid != 0 && st.st_uid != me && st.st_uid != named) {
    return "belongs to " + Uid(st.st_uid) + ", who could replace what is below it" +
           UidHint(st.st_uid);
  }
  return "has mode " + Octal(st.st_mode) + ": its group or others could replace what is below it";
}

// Resolves `shown` with ResolveTrustedPath (common/trusted_path.h): every
// directory on the way, and every symlink followed, is root's, the user's or
// the named uid's, and no directory is writable by group or others unless
// sticky. The last component's own rules are VerifyRuntimeDir's. Returns
// the path with no symlink, "." or "..": what the client connects by.
Result<std::string> ResolveTrusted(const std::string& shown, uint32_t named) {
  TrustedPathProblem p;
  const std::string resolved = ResolveTrustedPath(shown, {0, geteuid(), named}, &p);
  if (p.kind == TrustedPathProblem::Kind::kNone) return resolved;
  auto refuse = [&](const std::string& why) {
    return PermissionDenied(Refused("runtime dir " + shown + ": " + why + "; use a runtime dir " +
                                    "reached only through directories of root's or yours (set " +
                                    kRuntimeDirEnv + ")"));
  };
  using Kind = TrustedPathProblem::Kind;
  switch (p.kind) {
    case Kind::kMissing:
      // Name the component that is missing only when it is not the dir itself.
      return Unavailable("runtime dir " + shown + ": " + (p.at == shown ? "" : p.at + ": ") +
                         std::strerror(p.error));
    case Kind::kNotDirectory:
      return Unavailable("runtime dir " + shown + ": " + p.at + " is not a directory");
    case Kind::kTooManyLinks:
      return refuse("too many symlinks");
    case Kind::kUntrustedLink:
      return refuse("symlink " + p.at + " in " + p.parent + " belongs to " + Uid(p.uid) +
                    ", who could change where it leads" + UidHint(p.uid));
    case Kind::kUntrustedDir: {
      struct stat st {};
      st.st_uid = p.uid;
      st.st_mode = p.mode;
      return refuse("directory " + p.at + (p.at == "/" ? " " : " on its way ") +
                    DirProblem(st, named));
    }
    default:
      return ErrnoStatus("resolving runtime dir " + shown + " at " + p.at, p.error);
  }
}

}  // namespace

Result<TrustedRuntimeDir> VerifyRuntimeDir(const RuntimeDirChoice& choice) {
  Result<uint32_t> named = NamedDaemonUid();
  if (!named.ok()) return named.status();
  const std::string& shown = choice.path;
  Result<std::string> walked = ResolveTrusted(shown, *named);
  if (!walked.ok()) return walked.status();
  const std::string& resolved = *walked;
  struct stat st;
  if (lstat(resolved.c_str(), &st) != 0) return ErrnoStatus("stat " + resolved, errno);
  if (!S_ISDIR(st.st_mode)) {
    return Unavailable("runtime dir " + shown + " is not a directory");
  }
  const uid_t me = geteuid();
  const std::string where =
      std::string("runtime dir ") + shown + (shown == resolved ? "" : " (" + resolved + ")");
  if (choice.source == RuntimeDirSource::kPerUser) {
    if (st.st_uid != me) {
      return PermissionDenied(
          Refused(where + " belongs to " + Uid(st.st_uid) + ", not to you (" + Uid(me) +
                  "): another user may have made it to pose as your daemon. Remove it (ask root if "
                  "you cannot) and start your daemon again, or set " +
                  kRuntimeDirEnv + " to a dir of your own"));
    }
    if ((st.st_mode & 077) != 0) {
      return PermissionDenied(Refused(where + " has mode " + Octal(st.st_mode) +
                                      ": a per-user runtime dir must be 0700 (chmod 0700 " + shown +
                                      ")"));
    }
  } else {
    // /run/memoffload, however it was named, can only have been made by root:
    // its owner (root or the unit's user) is the daemon's.
    // Not by how it was found: /run/memoffload made a symlink to a dir of
    // someone else's is that dir, under the explicit rules.
    const bool system = resolved == kSystemRuntimeDir;
    if (!system && st.st_uid != 0 && st.st_uid != me && st.st_uid != *named) {
      return PermissionDenied(Refused(where + " belongs to " + Uid(st.st_uid) +
                                      ", neither root nor you (" + Uid(me) + ")" +
                                      UidHint(st.st_uid)));
    }
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
      return PermissionDenied(Refused(where + " has mode " + Octal(st.st_mode) +
                                      ": its group or others could replace the sockets "
                                      "(chmod go-w " +
                                      shown + ")"));
    }
  }
  TrustedRuntimeDir dir;
  dir.choice = choice;
  if (!shown.empty() && shown[0] != '/') {
    // Verified again later from the same place, whatever the cwd is then.
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof(cwd)) != nullptr) dir.choice.path = std::string(cwd) + "/" + shown;
  }
  dir.path = shown;
  dir.resolved = resolved;
  dir.owner_uid = st.st_uid;
  dir.uids = {0, static_cast<uint32_t>(me), static_cast<uint32_t>(st.st_uid)};
  if (*named != kNoUid) dir.uids.push_back(*named);
  return dir;
}

Status VerifySocket(const TrustedRuntimeDir& dir, const std::string& name) {
  const std::string path = dir.resolved + "/" + name;
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    const int err = errno;
    return Unavailable("cannot reach memoffloadd at unix:" + path + ": " + std::strerror(err) +
                       " (is the daemon running? set " + kRuntimeDirEnv + " to its runtime dir)");
  }
  if (!S_ISSOCK(st.st_mode)) {
    return PermissionDenied(Refused(path + " is not a socket" +
                                    (S_ISLNK(st.st_mode) ? std::string(" (a symlink)") : "")));
  }
  if (std::find(dir.uids.begin(), dir.uids.end(), st.st_uid) == dir.uids.end()) {
    return PermissionDenied(Refused(path + " belongs to " + Uid(st.st_uid) +
                                    ", neither root, you nor the runtime dir's owner (" +
                                    Uid(dir.owner_uid) + ")" + UidHint(st.st_uid)));
  }
  return Status::Ok();
}

Status VerifyPeer(const TrustedRuntimeDir& dir, int fd, const std::string& path) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoStatus("SO_PEERCRED of " + path, errno);
  }
  const uint32_t uid = static_cast<uint32_t>(cred.uid);
  if (std::find(dir.uids.begin(), dir.uids.end(), uid) == dir.uids.end()) {
    return PermissionDenied(
        Refused("the process answering on " + path + " (pid " + std::to_string(cred.pid) +
                ") runs as " + Uid(uid) + ", neither root, you (" + Uid(geteuid()) +
                ") nor the runtime dir's owner (" + Uid(dir.owner_uid) + ")" + UidHint(uid)));
  }
  return Status::Ok();
}

Result<int> ConnectVerified(const TrustedRuntimeDir& dir, const std::string& name, int timeout_ms) {
  MEMOFFLOAD_RETURN_IF_ERROR(VerifySocket(dir, name));
  const std::string path = dir.resolved + "/" + name;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // A resolved path longer than sun_path is reached through a descriptor of
  // its dir (/proc/self/fd/N/NAME), opened without following a symlink.
  int dir_fd = -1;
  std::string target = path;
  if (path.size() >= sizeof(addr.sun_path)) {
    dir_fd = open(dir.resolved.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir_fd < 0) return ErrnoStatus("open " + dir.resolved, errno);
    target = "/proc/self/fd/" + std::to_string(dir_fd) + "/" + name;
    if (target.size() >= sizeof(addr.sun_path)) {
      close(dir_fd);
      return InvalidArgument("socket name " + name + " is too long");
    }
  }
  std::memcpy(addr.sun_path, target.c_str(), target.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    const int err = errno;
    if (dir_fd >= 0) close(dir_fd);
    return ErrnoStatus("socket", err);
  }
  // Non-blocking: a daemon that is stopped or overloaded (its listen queue
  // full: EAGAIN) is tried again until the deadline, never waited on for
  // ever with the client's lock held.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 1));
  int err = 0;
  int backoff_us = 1000;
  while (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    err = errno;
    if (err == EINTR) continue;
    if (err != EAGAIN || std::chrono::steady_clock::now() >= deadline) break;
    usleep(static_cast<useconds_t>(backoff_us));
    backoff_us = std::min(backoff_us * 2, 50000);
    err = 0;
  }
  if (dir_fd >= 0) close(dir_fd);
  if (err != 0) {
    close(fd);
    if (err == EAGAIN) {
      return Unavailable("memoffloadd at unix:" + path + " did not accept a connection within " +
                         std::to_string(timeout_ms) +
                         " ms (its queue is full: is it stopped or overloaded?)");
    }
    return Unavailable("cannot reach memoffloadd at unix:" + path + ": " + std::strerror(err) +
                       " (is the daemon running? set " + kRuntimeDirEnv + " to its runtime dir)");
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int e = errno;
    close(fd);
    return ErrnoStatus("fcntl", e);
  }
  if (Status peer = VerifyPeer(dir, fd, path); !peer.ok()) {
    close(fd);
    return peer;
  }
  return fd;
}

Result<TrustedRuntimeDir> DiscoverTrustedRuntimeDir(const std::string& explicit_dir,
                                                    const std::string& socket_name) {
  const RuntimeDirChoice choice = DiscoverRuntimeDir(explicit_dir);
  Result<TrustedRuntimeDir> dir = VerifyRuntimeDir(choice);
  if (dir.ok()) {
    MEMOFFLOAD_RETURN_IF_ERROR(VerifySocket(*dir, socket_name));
    return dir;
  }
  const Status& st = dir.status();
  if (st.code() == StatusCode::kUnavailable) {
    // No daemon there (the message names the socket, as gRPC's errors do).
    return Unavailable("cannot reach memoffloadd at unix:" + choice.path + "/" + socket_name +
                       ": " + st.message() + " (is the daemon running? set " + kRuntimeDirEnv +
                       " to its runtime dir)");
  }
  return st;
}

}  // namespace memoffload::client
