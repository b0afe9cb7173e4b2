#include "memoffload/client/daemon_trust.h"

#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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

std::string UidHint(uint32_t uid) {
  return " (if uid " + std::to_string(uid) + " runs your daemon, name it with " + kDaemonUidEnv +
         "=" + std::to_string(uid) + ")";
}

// Every directory above `resolved` (an absolute path without symlinks).
Status VerifyAncestors(const std::string& shown, const std::string& resolved, uint32_t named) {
  const uid_t me = geteuid();
  std::string ancestor = resolved;
  while (true) {
    const size_t slash = ancestor.find_last_of('/');
    if (slash == std::string::npos || ancestor == "/") break;
    ancestor = slash == 0 ? "/" : ancestor.substr(0, slash);
    struct stat st;
    if (lstat(ancestor.c_str(), &st) != 0) return ErrnoStatus("stat " + ancestor, errno);
    if (st.st_uid != 0 && st.st_uid != me && st.st_uid != named) {
      return PermissionDenied(
          Refused("directory " + ancestor + " above the runtime dir " + shown + " belongs to " +
                  Uid(st.st_uid) + ", who could replace the runtime dir" + UidHint(st.st_uid) +
                  "; use a runtime dir whose parents belong to root or to you (set " +
                  kRuntimeDirEnv + ")"));
    }
    const bool sticky = (st.st_mode & S_ISVTX) != 0;
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && !sticky) {
      return PermissionDenied(Refused("directory " + ancestor + " above the runtime dir " + shown +
                                      " has mode " + Octal(st.st_mode) +
                                      ": its group or others could replace the runtime dir; "
                                      "chmod go-w " +
                                      ancestor + " or move the runtime dir (set " + kRuntimeDirEnv +
                                      ")"));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<TrustedRuntimeDir> VerifyRuntimeDir(const RuntimeDirChoice& choice) {
  Result<uint32_t> named = NamedDaemonUid();
  if (!named.ok()) return named.status();
  const std::string& shown = choice.path;
  char resolved[PATH_MAX];
  if (realpath(shown.c_str(), resolved) == nullptr) {
    const int err = errno;
    return Unavailable("runtime dir " + shown + ": " + std::strerror(err));
  }
  struct stat st;
  if (lstat(resolved, &st) != 0) return ErrnoStatus("stat " + std::string(resolved), errno);
  if (!S_ISDIR(st.st_mode)) {
    return Unavailable("runtime dir " + shown + " is not a directory");
  }
  const uid_t me = geteuid();
  const std::string where = std::string("runtime dir ") + shown +
                            (shown == resolved ? "" : std::string(" (") + resolved + ")");
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
    const bool system =
        choice.source == RuntimeDirSource::kSystem || std::string(resolved) == kSystemRuntimeDir;
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
  MEMOFFLOAD_RETURN_IF_ERROR(VerifyAncestors(shown, resolved, *named));
  TrustedRuntimeDir dir;
  dir.path = shown;
  dir.owner_uid = st.st_uid;
  dir.uids = {0, static_cast<uint32_t>(me), static_cast<uint32_t>(st.st_uid)};
  if (*named != kNoUid) dir.uids.push_back(*named);
  return dir;
}

Status VerifySocket(const TrustedRuntimeDir& dir, const std::string& name) {
  const std::string path = dir.path + "/" + name;
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
