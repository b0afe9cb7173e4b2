// RuntimeDirClaim: one daemon instance's hold on its runtime dir.
//
// Claim() refuses a dir that another user could tamper with (not owned by
// the daemon's uid, or writable by its group or by others: such a user could
// swap the broker socket or delete the admin token), then takes the instance
// lock: flock on <dir>/memoffloadd.lock (mode 0600: flock needs only a
// read-only fd), which holds the owner's pid. A
// second daemon on the same dir fails at once and names the holder's pid.
//
// Every file this instance creates in the dir is recorded (device, inode and
// change time, once the file is complete) and removed when the claim ends,
// and only if it is still the same file: an
// exiting daemon never removes what a later one created. A dir that Claim()
// created is removed too when it is empty by then, so a failed start leaves
// nothing behind.
#ifndef MEMOFFLOAD_DAEMON_RUNTIME_DIR_CLAIM_H_
#define MEMOFFLOAD_DAEMON_RUNTIME_DIR_CLAIM_H_

#include <sys/types.h>
#include <time.h>

#include <memory>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload::daemon {

inline constexpr char kInstanceLockName[] = "memoffloadd.lock";

class RuntimeDirClaim {
 public:
  // A dir that does not exist is created with `create_mode` (0700 for the
  // per-user default dir, which clients accept only so).
  static Result<std::unique_ptr<RuntimeDirClaim>> Claim(const std::string& dir,
                                                        mode_t create_mode = 0755);
  // Whether a live daemon holds the instance lock of `dir` (serving it, or
  // starting to): lifecycle.take_over = "auto" takes the node from it.
  static bool Held(const std::string& dir);
  // The claim a serving daemon handed on in a take-over (app/takeover.h):
  // its open instance lock, whose flock this process now holds.
  static Result<std::unique_ptr<RuntimeDirClaim>> Adopt(const std::string& dir, int lock_fd);
  // Forgets the files this instance created (a take-over: the new daemon
  // uses them), so that neither they nor the dir are removed.
  void Disown();
  // Removes what this instance created (see above) and drops the lock.
  ~RuntimeDirClaim();
  RuntimeDirClaim(const RuntimeDirClaim&) = delete;
  RuntimeDirClaim& operator=(const RuntimeDirClaim&) = delete;

  const std::string& dir() const { return dir_; }
  // The open instance lock (a take-over hands it on).
  int lock_fd() const { return lock_fd_; }

  // Binds a Unix stream socket at `path` (replacing a stale file: the lock
  // says no live daemon uses it), sets its mode and group (gid -1 keeps the
  // daemon's) and listens. Returns the listening fd (the caller owns it).
  Result<int> ListenUnix(const std::string& path, uint32_t mode, gid_t gid);
  // Records a file this instance just created and finished (mode, owner and
  // contents set) at `path`.
  void Own(const std::string& path);
  // Removes the recorded files now (they are forgotten).
  void RemoveOwned();

 private:
  struct Owned {
    std::string path;
    dev_t dev;
    ino_t ino;
    timespec ctime;
  };
  RuntimeDirClaim() = default;
  // Once the lock is held: a lock file of another mode than 0600 is
  // replaced by one of that mode (the old one stays locked).
  Status ReplaceOpenLock(const std::string& lock_path);

  std::string dir_;
  bool created_dir_ = false;
  int lock_fd_ = -1;
  int old_lock_fd_ = -1;  // ReplaceOpenLock's old file, held locked
  std::vector<Owned> owned_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_RUNTIME_DIR_CLAIM_H_
