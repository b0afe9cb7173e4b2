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

// Whether a directory owned by `st.st_uid` with `st.st_mode` is one that
// only root, the user or the named uid can change: "" if so, else why not.
std::string DirProblem(const struct stat& st, uint32_t named) {
  const uid_t me = geteuid();
  if (st.st_uid != 0 && st.st_uid != me && st.st_uid != named) {
    return "belongs to " + Uid(st.st_uid) + ", who could replace what is below it" +
           UidHint(st.st_uid);
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    return "has mode " + Octal(st.st_mode) + ": its group or others could replace what is below it";
  }
  return "";
}

// Resolves `shown` (made absolute against the working directory) one
// component at a time, as the kernel would, and checks each directory it
// passes through and each symlink it follows: every directory is root's,
// the user's or the named uid's and not writable by group or others unless
// sticky (/tmp), and every symlink is root's, the user's or the named uid's
// (a symlink in a sticky dir belongs to whoever made it). So nobody else can
// change where the path leads, from the first component to the last. The
// last component's own rules are VerifyRuntimeDir's. Returns the path with
// no symlink, "." or "..": what the client connects by.
Result<std::string> ResolveTrusted(const std::string& shown, uint32_t named) {
  std::string pending = shown;
  if (pending.empty() || pending[0] != '/') {
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof(cwd)) == nullptr) return ErrnoStatus("getcwd", errno);
    pending = std::string(cwd) + "/" + pending;
  }
  const uid_t me = geteuid();
  std::vector<std::string> parts;  // the resolved path so far, checked
  auto joined = [&parts] {
    std::string out;
    for (const std::string& p : parts) out += "/" + p;
    return out.empty() ? std::string("/") : out;
  };
  auto refuse = [&](const std::string& why) {
    return PermissionDenied(Refused("runtime dir " + shown + ": " + why + "; use a runtime dir " +
                                    "reached only through directories of root's or yours (set " +
                                    kRuntimeDirEnv + ")"));
  };
  struct stat root;
  if (lstat("/", &root) != 0) return ErrnoStatus("stat /", errno);
  if (std::string why = DirProblem(root, named); !why.empty()) return refuse("directory / " + why);
  int links = 0;
  size_t at = 0;
  while (at < pending.size()) {
    const size_t slash = pending.find('/', at);
    const size_t stop = slash == std::string::npos ? pending.size() : slash;
    const std::string name = pending.substr(at, stop - at);
    at = stop + 1;
    if (name.empty() || name == ".") continue;
    if (name == "..") {
      if (!parts.empty()) parts.pop_back();
      continue;
    }
    const std::string parent = joined();
    parts.push_back(name);
    const std::string here = joined();
    struct stat st;
    if (lstat(here.c_str(), &st) != 0) {
      const int err = errno;
      // Name the component that is missing only when it is not the dir itself.
      return Unavailable("runtime dir " + shown + ": " + (here == shown ? "" : here + ": ") +
                         std::strerror(err));
    }
    if (S_ISLNK(st.st_mode)) {
      if (++links > 40) return refuse("too many symlinks");
      if (st.st_uid != 0 && st.st_uid != me && st.st_uid != named) {
        return refuse("symlink " + here + " in " + parent + " belongs to " + Uid(st.st_uid) +
                      ", who could change where it leads" + UidHint(st.st_uid));
      }
      char target[PATH_MAX];
      const ssize_t n = readlink(here.c_str(), target, sizeof(target) - 1);
      if (n < 0) return ErrnoStatus("readlink " + here, errno);
      target[n] = '\0';
      parts.pop_back();
      if (target[0] == '/') parts.clear();
      pending = std::string(target) + "/" + pending.substr(std::min(at, pending.size()));
      at = 0;
      continue;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (at >= pending.size()) return here;  // the last: VerifyRuntimeDir says what it is
      return Unavailable("runtime dir " + shown + ": " + here + " is not a directory");
    }
    const bool last = pending.find_first_not_of("/.", at) == std::string::npos &&
                      pending.find("..", at) == std::string::npos;
    if (last) continue;  // the runtime dir itself: VerifyRuntimeDir's rules
    if (std::string why = DirProblem(st, named); !why.empty()) {
      return refuse("directory " + here + " on its way " + why);
    }
  }
  return joined();
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
