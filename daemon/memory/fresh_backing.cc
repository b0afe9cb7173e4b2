#include "memory/fresh_backing.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include "base/log.h"

namespace memoffload::daemon {
namespace {

constexpr char kBackingName[] = "memoffload-backing";
// Every memfd of the daemon is named memoffload-*: the arena's first
// backings (memoffload-chunk-N) and the fresh ones (memoffload-backing-N).
// Both can be retired, so a keeper of either must be found.
constexpr char kMemfdPrefix[] = "/memfd:memoffload-";

// Inodes (of `wanted`) that some process other than this one maps or holds
// an fd of. Processes whose /proc entries cannot be read are skipped.
std::unordered_set<ino_t> HeldInodes(const std::unordered_set<ino_t>& wanted) {
  std::unordered_set<ino_t> held;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return held;
  const std::string self = std::to_string(getpid());
  const size_t prefix_len = std::strlen(kMemfdPrefix);
  while (dirent* d = readdir(proc)) {
    if (d->d_name[0] < '0' || d->d_name[0] > '9' || self == d->d_name) continue;
    const std::string dir = std::string("/proc/") + d->d_name;
    if (FILE* maps = std::fopen((dir + "/maps").c_str(), "re")) {
      char line[4096];
      while (std::fgets(line, sizeof(line), maps) != nullptr) {
        if (std::strstr(line, kMemfdPrefix) == nullptr) continue;
        // address perms offset dev inode path
        unsigned long long inode = 0;
        if (std::sscanf(line, "%*s %*s %*s %*s %llu", &inode) == 1 &&
            wanted.count(static_cast<ino_t>(inode)) > 0) {
          held.insert(static_cast<ino_t>(inode));
        }
      }
      std::fclose(maps);
    }
    if (DIR* fds = opendir((dir + "/fd").c_str())) {
      while (dirent* f = readdir(fds)) {
        if (f->d_name[0] == '.') continue;
        const std::string path = dir + "/fd/" + f->d_name;
        char target[256];
        const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
        if (n <= 0) continue;
        target[n] = '\0';
        if (std::strncmp(target, kMemfdPrefix, prefix_len) != 0) continue;
        struct stat st {};
        if (stat(path.c_str(), &st) == 0 && wanted.count(st.st_ino) > 0) held.insert(st.st_ino);
      }
      closedir(fds);
    }
  }
  closedir(proc);
  return held;
}

}  // namespace

bool FreshBacking::ProcShows(pid_t pid) const {
  if (options_.proc_shows) return options_.proc_shows(pid);
  // A process whose maps the scan could read was judged by them (access(2)
  // would not do: the kernel's ptrace check is made at open).
  const std::string maps = "/proc/" + std::to_string(pid) + "/maps";
  const int fd = open(maps.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  close(fd);
  return true;
}

FreshBacking::FreshBacking(const FreshBackingOptions& options) : options_(options) {
  thread_ = std::thread([this] { Run(); });
}

FreshBacking::~FreshBacking() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  wake_.SignalAll();
  thread_.join();
  for (Retired& r : retired_) CloseRecipients(&r);
}

Result<std::shared_ptr<Chunk>> FreshBacking::Create(uint64_t size_bytes, bool prefault) {
  std::string name;
  {
    absl::MutexLock lock(&mu_);
    name = std::string(kBackingName) + "-" + std::to_string(++serial_);
  }
  Result<Chunk> chunk = Chunk::Create(name, size_bytes, options_.hugepages);
  if (!chunk.ok() && options_.hugepages) chunk = Chunk::Create(name, size_bytes, false);
  if (!chunk.ok()) return chunk.status();
  auto c = std::make_shared<Chunk>(std::move(chunk).value());
  if (options_.numa_node >= 0) {
    if (Status st = c->BindToNode(options_.numa_node); !st.ok()) {
      MO_LOG_WARN("fresh chunk backing: %s", st.ToString().c_str());
    }
  }
  // Best effort, like the arena: a backing that cannot be locked still
  // isolates, but may be swapped out; the operator is told.
  if (options_.mlock) {
    if (Status locked = c->LockOnFault(); !locked.ok()) {
      MO_LOG_WARN_LIMITED("fresh chunk backing not locked (it may be swapped out): %s",
                          locked.ToString().c_str());
    }
  }
  if (prefault) MEMOFFLOAD_RETURN_IF_ERROR(c->Prefault(0, c->size_bytes(), Chunk::kMmapLockPiece));
  return c;
}

Result<std::shared_ptr<Chunk>> FreshBacking::Take(uint64_t size_bytes) {
  {
    absl::MutexLock lock(&mu_);
    ++taken_;
    if (!spares_.empty() && spares_.front()->size_bytes() == size_bytes) {
      std::shared_ptr<Chunk> c = std::move(spares_.front());
      spares_.pop_front();
      wake_.SignalAll();  // refill
      return c;
    }
    ++taken_unfaulted_;
  }
  Result<std::shared_ptr<Chunk>> c = Create(size_bytes, /*prefault=*/false);
  if (!c.ok()) return c.status();
  {
    absl::MutexLock lock(&mu_);
    to_fault_.push_back(*c);
  }
  wake_.SignalAll();
  return c;
}

void FreshBacking::Retire(std::shared_ptr<Chunk> old, const std::vector<pid_t>& recipients) {
  if (old == nullptr) return;
  struct stat st {};
  const bool known = fstat(old->fd(), &st) == 0;
  Retired retired{st.st_ino, old->size_bytes(), {}};
  for (pid_t pid : recipients) {
    // Fails (ESRCH) for a process that is gone: it keeps nothing.
    const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (fd >= 0) retired.recipients.push_back({pid, fd});
  }
  {
    absl::MutexLock lock(&mu_);
    if (known) {
      retired_.push_back(std::move(retired));
    } else {
      CloseRecipients(&retired);
    }
    to_drop_.push_back(std::move(old));
  }
  wake_.SignalAll();
}

FreshBackingStats FreshBacking::Stats() const {
  absl::MutexLock lock(&mu_);
  FreshBackingStats s;
  s.spares = static_cast<uint32_t>(spares_.size());
  s.taken = taken_;
  s.taken_unfaulted = taken_unfaulted_;
  s.stale_backings = static_cast<uint32_t>(retired_.size());
  for (const Retired& r : retired_) s.stale_bytes += r.size_bytes;
  return s;
}

FreshBackingStats FreshBacking::ScanNow() {
  Scan();
  return Stats();
}

void FreshBacking::Scan() {
  absl::MutexLock scan_lock(&scan_mu_);
  std::unordered_set<ino_t> wanted;
  std::vector<std::shared_ptr<Chunk>> drop;
  size_t scanned = 0;  // retired_[0, scanned) are looked for
  {
    absl::MutexLock lock(&mu_);
    // The daemon's own references go first: a backing is stale only when
    // someone else keeps it.
    drop.swap(to_drop_);
    scanned = retired_.size();
    for (const Retired& r : retired_) wanted.insert(r.inode);
  }
  drop.clear();  // munmap + close without mu_ (Take waits for it under the table lock)
  if (wanted.empty()) return;
  const std::unordered_set<ino_t> held = HeldInodes(wanted);
  // Backings nobody was seen keeping: their recipients are looked at next.
  // Only Scan (one at a time: scan_mu_) changes or erases entries of
  // retired_ and Retire only appends, so these indices and pidfds stay valid
  // while mu_ is released.
  struct Look {
    size_t index = 0;
    std::vector<Recipient> recipients;
    std::vector<int> exited;  // pidfds of recipients that exited
    bool unseen_lives = false;
  };
  std::vector<Look> looks;
  {
    absl::MutexLock lock(&mu_);
    for (size_t k = 0; k < scanned; ++k) {
      if (held.count(retired_[k].inode) == 0)
        looks.push_back({k, retired_[k].recipients, {}, false});
    }
  }
  // The poll and /proc open of each recipient, without mu_: Take waits on
  // mu_ under the session table's lock, so a Reserve never waits for them.
  for (Look& look : looks) {
    look.unseen_lives = UnseenRecipientLives(look.recipients, &look.exited);
  }
  std::vector<int> to_close;
  {
    absl::MutexLock lock(&mu_);
    for (auto look = looks.rbegin(); look != looks.rend(); ++look) {  // erasing from the back
      Retired& r = retired_[look->index];
      auto exited = [&](const Recipient& c) {
        return std::find(look->exited.begin(), look->exited.end(), c.pidfd) != look->exited.end();
      };
      auto gone = std::stable_partition(r.recipients.begin(), r.recipients.end(),
                                        [&](const Recipient& c) { return !exited(c); });
      if (look->unseen_lives) {
        for (auto it = gone; it != r.recipients.end(); ++it) to_close.push_back(it->pidfd);
        r.recipients.erase(gone, r.recipients.end());
        continue;
      }
      for (const Recipient& c : r.recipients) to_close.push_back(c.pidfd);
      retired_.erase(retired_.begin() + static_cast<std::ptrdiff_t>(look->index));
    }
  }
  for (int fd : to_close) close(fd);
}

bool FreshBacking::UnseenRecipientLives(const std::vector<Recipient>& recipients,
                                        std::vector<int>* exited) const {
  bool lives = false;
  for (const Recipient& c : recipients) {
    pollfd p{c.pidfd, POLLIN, 0};
    if (poll(&p, 1, 0) != 0) {  // exited (or the pidfd is unusable): keeps nothing
      exited->push_back(c.pidfd);
      continue;
    }
    if (!ProcShows(c.pid)) lives = true;
  }
  return lives;
}

void FreshBacking::CloseRecipients(Retired* r) {
  for (const Recipient& c : r->recipients) close(c.pidfd);
  r->recipients.clear();
}

void FreshBacking::Run() {
  auto next_scan = std::chrono::steady_clock::now();
  mu_.Lock();
  while (!stop_) {
    if (!to_drop_.empty()) {
      std::vector<std::shared_ptr<Chunk>> drop;
      drop.swap(to_drop_);
      mu_.Unlock();
      drop.clear();  // munmap + close, off every caller's lock
      mu_.Lock();
      continue;
    }
    if (!to_fault_.empty()) {
      std::shared_ptr<Chunk> c = std::move(to_fault_.back());
      to_fault_.pop_back();
      mu_.Unlock();
      if (Status st = c->Prefault(0, c->size_bytes(), Chunk::kMmapLockPiece); !st.ok()) {
        MO_LOG_WARN("faulting in a fresh chunk backing: %s", st.ToString().c_str());
      }
      c.reset();
      mu_.Lock();
      continue;
    }
    if (taken_ > 0 && spares_.size() < options_.spares && options_.chunk_size_bytes > 0) {
      mu_.Unlock();
      Result<std::shared_ptr<Chunk>> c = Create(options_.chunk_size_bytes, /*prefault=*/true);
      mu_.Lock();
      if (c.ok()) {
        spares_.push_back(std::move(c).value());
        continue;
      }
      MO_LOG_WARN("preparing a spare chunk backing: %s (retrying in 1 s)",
                  c.status().ToString().c_str());
      wake_.WaitWithTimeout(&mu_, absl::Seconds(1));
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (!retired_.empty() && now >= next_scan) {
      mu_.Unlock();
      Scan();
      mu_.Lock();
      next_scan = std::chrono::steady_clock::now() + options_.scan_interval;
      continue;
    }
    if (retired_.empty()) {
      wake_.Wait(&mu_);
    } else {
      wake_.WaitWithTimeout(&mu_, absl::FromChrono(next_scan - now));
    }
  }
  mu_.Unlock();
}

}  // namespace memoffload::daemon
