#include "app/runtime_dir_claim.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/log.h"
#include "memoffload/common/runtime_dir.h"

namespace memoffload::daemon {
namespace {

std::string Octal(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// The pid written in the lock file, or "" when unreadable.
std::string LockHolder(int fd) {
  char buf[32] = {};
  const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return "";
  std::string pid(buf, static_cast<size_t>(n));
  while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
  return pid;
}

}  // namespace

Result<std::unique_ptr<RuntimeDirClaim>> RuntimeDirClaim::Claim(const std::string& dir,
                                                                mode_t create_mode) {
  std::unique_ptr<RuntimeDirClaim> claim(new RuntimeDirClaim());
  claim->dir_ = dir;
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return ErrnoStatus("runtime dir " + dir, errno);
    if (mkdir(dir.c_str(), create_mode) != 0) {
      return FailedPrecondition("cannot create runtime dir " + dir + ": " + std::strerror(errno));
    }
    claim->created_dir_ = true;
    if (lstat(dir.c_str(), &st) != 0) return ErrnoStatus("runtime dir " + dir, errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    return FailedPrecondition("runtime dir " + dir + " exists but is not a directory" +
                              (S_ISLNK(st.st_mode) ? " (a symlink)" : ""));
  }
  if (st.st_uid != geteuid()) {
    return FailedPrecondition("runtime dir " + dir + " belongs to uid " +
                              std::to_string(st.st_uid) + ", not to the daemon's uid " +
                              std::to_string(geteuid()) +
                              ": its owner could replace the sockets; use a dir of the "
                              "daemon's own (or remove this one)");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return FailedPrecondition("runtime dir " + dir + " has mode " + Octal(st.st_mode) +
                              ": writable by its group or others, who could replace the "
                              "sockets or delete the admin token; chmod it to 0755 or 0750");
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    return FailedPrecondition("runtime dir " + dir + " is not writable by uid " +
                              std::to_string(geteuid()));
  }
  const size_t max_path = sizeof(sockaddr_un{}.sun_path) - 1;
  if (GrpcSocketPath(dir).size() > max_path) {
    return FailedPrecondition("runtime dir " + dir + " is too long for a Unix socket path (" +
                              std::to_string(max_path) + " bytes max)");
  }

  const std::string lock_path = dir + "/" + kInstanceLockName;
  // 0600: flock needs only a read-only fd, so a lock others can open is a
  // lock others can hold.
  claim->lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (claim->lock_fd_ < 0) return ErrnoStatus("opening the instance lock " + lock_path, errno);
  if (flock(claim->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    const std::string holder = LockHolder(claim->lock_fd_);
    if (error == EWOULDBLOCK) {
      return FailedPrecondition("another memoffloadd" +
                                (holder.empty() ? std::string() : " (pid " + holder + ")") +
                                " is already serving " + dir + " (it holds " + lock_path + ")");
    }
    return ErrnoStatus("locking " + lock_path, error);
  }
  MEMOFFLOAD_RETURN_IF_ERROR(claim->ReplaceOpenLock(lock_path));
  const std::string pid = std::to_string(getpid()) + "\n";
  if (ftruncate(claim->lock_fd_, 0) != 0 ||
      pwrite(claim->lock_fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    MO_LOG_WARN("cannot write the pid into %s: %s", lock_path.c_str(), std::strerror(errno));
  }
  // Ours now: the lock file is removed with the dir only (see the header).
  if (claim->created_dir_) claim->Own(lock_path);
  return claim;
}

Status RuntimeDirClaim::ReplaceOpenLock(const std::string& lock_path) {
  struct stat st {};
  if (fstat(lock_fd_, &st) != 0) return ErrnoStatus("stat of the instance lock", errno);
  if ((st.st_mode & 0077) == 0) return Status::Ok();
  // A lock file another uid could open (an earlier version made it 0644):
  // whoever kept it open could hold it at the next start. A new file takes
  // its name; the old one stays locked here, so that nobody who opened it
  // before the rename can take it either.
  const std::string fresh = lock_path + ".new";
  unlink(fresh.c_str());
  const int fd = open(fresh.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return ErrnoStatus("creating " + fresh, errno);
  if (flock(fd, LOCK_EX | LOCK_NB) != 0 || rename(fresh.c_str(), lock_path.c_str()) != 0) {
    const int error = errno;
    close(fd);
    unlink(fresh.c_str());
    return ErrnoStatus("replacing the instance lock " + lock_path, error);
  }
  MO_LOG_INFO("instance lock %s was mode %s: replaced by one of mode 0600", lock_path.c_str(),
              Octal(st.st_mode).c_str());
  old_lock_fd_ = std::exchange(lock_fd_, fd);
  return Status::Ok();
}

bool RuntimeDirClaim::Held(const std::string& dir) {
  const std::string lock_path = dir + "/" + kInstanceLockName;
  const int fd = open(lock_path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  const bool held = flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  close(fd);  // drops the shared lock if it was taken
  return held;
}

Result<std::unique_ptr<RuntimeDirClaim>> RuntimeDirClaim::Adopt(const std::string& dir,
                                                                int lock_fd) {
  std::unique_ptr<RuntimeDirClaim> claim(new RuntimeDirClaim());
  claim->dir_ = dir;
  claim->lock_fd_ = lock_fd;
  // The flock is the open file's: the serving daemon's exit leaves it held here.
  if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    return FailedPrecondition("the handed-on instance lock of " + dir +
                              " is not held: " + std::strerror(errno));
  }
  // A lock file an earlier version made 0644 goes on with the node.
  if (Status st = claim->ReplaceOpenLock(dir + "/" + kInstanceLockName); !st.ok()) {
    MO_LOG_WARN("%s; another user who opened it could hold it once this daemon is gone",
                st.ToString().c_str());
  }
  lock_fd = claim->lock_fd_;
  const std::string pid = std::to_string(getpid()) + "\n";
  if (ftruncate(lock_fd, 0) != 0 ||
      pwrite(lock_fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    MO_LOG_WARN("cannot write the pid into the instance lock of %s: %s", dir.c_str(),
                std::strerror(errno));
  }
  return claim;
}

void RuntimeDirClaim::Disown() {
  owned_.clear();
  created_dir_ = false;
}

RuntimeDirClaim::~RuntimeDirClaim() {
  RemoveOwned();
  if (lock_fd_ >= 0) close(lock_fd_);
  if (old_lock_fd_ >= 0) close(old_lock_fd_);
  if (created_dir_ && rmdir(dir_.c_str()) != 0 && errno != ENOTEMPTY && errno != EEXIST) {
    MO_LOG_WARN("cannot remove runtime dir %s: %s", dir_.c_str(), std::strerror(errno));
  }
}

Result<int> RuntimeDirClaim::ListenUnix(const std::string& path, uint32_t mode, gid_t gid) {
  unlink(path.c_str());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return ErrnoStatus("socket for " + path, errno);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int error = errno;
    close(fd);
    return Unavailable("cannot bind " + path + ": " + std::strerror(error));
  }
  Status st = Status::Ok();
  if (chmod(path.c_str(), mode) != 0) {
    st = ErrnoStatus("chmod " + path, errno);
  } else if (gid != static_cast<gid_t>(-1) &&
             chown(path.c_str(), static_cast<uid_t>(-1), gid) != 0) {
    st = ErrnoStatus("chown " + path + " to the socket group", errno);
  } else if (listen(fd, SOMAXCONN) != 0) {
    st = ErrnoStatus("listen on " + path, errno);
  }
  if (!st.ok()) {
    close(fd);
    unlink(path.c_str());  // created a moment ago, under the lock
    return st;
  }
  Own(path);  // after chmod/chown: they change ctime, part of the identity
  return fd;
}

void RuntimeDirClaim::Own(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return;
  owned_.push_back({path, st.st_dev, st.st_ino, st.st_ctim});
}

void RuntimeDirClaim::RemoveOwned() {
  // Newest first: the lock file (first recorded) goes last.
  for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) {
    struct stat st;
    if (lstat(it->path.c_str(), &st) != 0) continue;
    // Another's now. Inode numbers are reused at once (tmpfs), so the change
    // time counts too; a file whose metadata someone changed is left alone.
    if (st.st_dev != it->dev || st.st_ino != it->ino || st.st_ctim.tv_sec != it->ctime.tv_sec ||
        st.st_ctim.tv_nsec != it->ctime.tv_nsec) {
      continue;
    }
    unlink(it->path.c_str());
  }
  owned_.clear();
}

}  // namespace memoffload::daemon
