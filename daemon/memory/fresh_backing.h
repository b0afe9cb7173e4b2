// FreshBacking: new memfds for chunks that change tenant, and the account of
// the old ones that processes still keep.
//
// Fds and mappings cannot be revoked, so a chunk handed to a new tenant gets
// a new memfd (SessionTable::Claim); the old one is "retired": the daemon
// closes it, and its pages live on only while some process still maps it or
// holds its fd. Those pages are private to their holders and sit outside the
// arena's capacity; stale_bytes() reports them.
//
// Once the first chunk has changed tenant (a node that never changes tenant
// pays nothing), a background thread keeps `spares` pre-faulted (and locked,
// when the arena is) memfds of the chunk size ready, so Take() never faults a page on the
// caller's thread: it hands out a spare, or, when none is ready, a new
// unfaulted memfd whose pages the thread then faults in (MADV_POPULATE_WRITE,
// which keeps contents, so a client may already be writing). The thread also
// unmaps retired backings (off the caller's lock) and, while any retired
// backing may still be held, scans /proc every scan_interval for processes
// that map it (/proc/<pid>/maps) or hold its fd (/proc/<pid>/fd). A process
// whose /proc entries the daemon may not read (another uid when the daemon is
// not root, or the unit's ProtectProc=invisible) cannot be seen that way: for
// those, the processes the backing was handed to (their pids, given to
// Retire) count as keeping it for as long as they live. Forks and fd passes
// of an unreadable process are not seen.
//
// Thread-safe.
#ifndef MEMOFFLOAD_DAEMON_FRESH_BACKING_H_
#define MEMOFFLOAD_DAEMON_FRESH_BACKING_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "memoffload/common/status.h"
#include "memoffload/shared_mem/chunk.h"

namespace memoffload::daemon {

struct FreshBackingOptions {
  uint64_t chunk_size_bytes = 0;
  uint32_t spares = 1;  // pre-faulted memfds kept ready
  bool hugepages = false;
  bool mlock = false;
  int numa_node = -1;
  std::chrono::milliseconds scan_interval{1000};
  // Whether the scan can read a recipient's /proc/<pid>/maps (then its maps,
  // not its life, say whether it keeps a backing). Null: opening the file
  // tells. Called on the scanning thread without FreshBacking's lock; tests
  // replace it.
  std::function<bool(pid_t)> proc_shows;
};

struct FreshBackingStats {
  uint32_t spares = 0;           // pre-faulted memfds ready now
  uint64_t taken = 0;            // backings handed out, total
  uint64_t taken_unfaulted = 0;  // of which no spare was ready
  uint32_t stale_backings = 0;   // retired backings some process still keeps
  uint64_t stale_bytes = 0;      // their size
};

class FreshBacking {
 public:
  explicit FreshBacking(const FreshBackingOptions& options);
  ~FreshBacking();  // stops the thread; retired backings are dropped
  FreshBacking(const FreshBacking&) = delete;
  FreshBacking& operator=(const FreshBacking&) = delete;

  // A new memfd of size_bytes, never faulted on this thread. Fails only when
  // memfd_create/ftruncate/mmap fail (RESOURCE_EXHAUSTED or the errno).
  Result<std::shared_ptr<Chunk>> Take(uint64_t size_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes the daemon's last reference of an old backing: it is closed and
  // unmapped on the background thread and counted as stale while a process
  // still keeps it.
  // `recipients`: the pids of the processes the backing was handed to.
  void Retire(std::shared_ptr<Chunk> old, const std::vector<pid_t>& recipients = {})
      ABSL_LOCKS_EXCLUDED(mu_);

  FreshBackingStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // Runs one /proc scan now and returns the stats after it (tests, status).
  FreshBackingStats ScanNow() ABSL_LOCKS_EXCLUDED(mu_, scan_mu_);

 private:
  struct Recipient {
    pid_t pid = 0;
    int pidfd = -1;  // readable once the process has exited
  };
  struct Retired {
    ino_t inode = 0;
    uint64_t size_bytes = 0;
    std::vector<Recipient> recipients;  // alive when retired; pidfds owned
  };
  // True while a recipient that /proc does not show lives; adds the pidfds
  // of those that exited to *exited. Slow (a poll and an open each).
  bool UnseenRecipientLives(const std::vector<Recipient>& recipients,
                            std::vector<int>* exited) const ABSL_LOCKS_EXCLUDED(mu_);
  static void CloseRecipients(Retired* r);
  // Whether the scan can read the process's /proc entries (proc_shows).
  bool ProcShows(pid_t pid) const;
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  Result<std::shared_ptr<Chunk>> Create(uint64_t size_bytes, bool prefault)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Scan() ABSL_LOCKS_EXCLUDED(mu_, scan_mu_);

  const FreshBackingOptions options_;
  // Lock order: scan_mu_ before mu_.
  absl::Mutex scan_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // one scan at a time
  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::shared_ptr<Chunk>> spares_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Chunk>> to_fault_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Chunk>> to_drop_ ABSL_GUARDED_BY(mu_);
  std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);  // maybe still kept
  uint64_t taken_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t taken_unfaulted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t serial_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_FRESH_BACKING_H_
