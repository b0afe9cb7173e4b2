// Arena: the daemon's chunks of shared memory and the allocator over them.
//
// Built once at start: chunks are created (hugetlb when asked and available,
// else normal pages), bound to a NUMA node when asked, marked locked on fault
// (mlock2 MLOCK_ONFAULT, when permitted) and pre-faulted in parallel, so each
// page is allocated, zeroed and locked in one pass; nothing is allocated or
// faulted afterwards. A chunk a restart kept (adopt_fds) has its pages
// already: Build only maps it, and its page tables are filled (and its pages
// locked) after the daemon serves (memory/kept_mapping.h). The arena owns the chunk slots (index,
// size) for the daemon's lifetime; the memfd behind a slot (its backing) is replaced when the chunk
// changes tenant (SessionTable::Claim), and each backing of a slot has its own generation (1 at
// start). The allocator and the backings are not thread-safe: their single user (SessionTable)
// holds its own lock around them. chunk_bytes() never changes and needs no lock.
#ifndef MEMOFFLOAD_DAEMON_ARENA_H_
#define MEMOFFLOAD_DAEMON_ARENA_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memoffload/common/status.h"
#include "memoffload/shared_mem/chunk.h"
#include "memory/allocator.h"

namespace memoffload::daemon {

struct ArenaOptions {
  uint64_t size_bytes = 0;
  uint64_t chunk_size_bytes = 0;
  int prefault_threads = 1;
  // Back chunks with hugepages (MFD_HUGETLB). When the system has too few
  // free, Build warns once and uses normal pages for the remaining chunks.
  bool hugepages = false;
  bool mlock = true;
  int numa_node = -1;  // bind chunk memory to this node; -1: no binding
  // By chunk index: a memfd a restart kept (taken, and closed on failure),
  // mapped as it is instead of a new one; -1 (or past the end): a new one.
  // Not pre-faulted here (TakeUnmappedKept).
  std::vector<int> adopt_fds;
};

struct ArenaBuildReport {
  double build_seconds = 0;  // create + pre-fault + lock
  bool mlocked = false;
  std::string mlock_problem;     // why mlock was skipped or failed, "" if ok
  uint32_t hugepage_chunks = 0;  // chunks backed by hugepages
  uint32_t adopted_chunks = 0;   // chunks kept across a restart (adopt_fds)
  uint64_t adopted_bytes = 0;    // their bytes: mapped, not pre-faulted
  // Kept bytes whose pages are not known until mapped (shared-memory THP
  // allowed): counted neither as huge nor as small.
  uint64_t unmeasured_bytes = 0;
  std::string hugepage_fallback;  // why hugepages were not (all) used, "" if ok
  // What the kernel gave after the pre-fault (/proc/self/smaps): bytes on
  // hugetlbfs pages, and on shared-memory transparent huge pages (2 MiB).
  uint64_t hugetlb_bytes = 0;
  uint64_t thp_bytes = 0;  // of the pre-faulted chunks (kept ones: once mapped)
  // The one line for an arena not all on huge pages: why, and the setting
  // that would change it; "" when all are.
  std::string pages_note;
};

// "2 MiB pages (shared-memory THP)", "2 MiB pages (hugetlbfs)", "4 KiB
// pages", or a mix ("2 MiB pages (shared-memory THP) for 512 MiB, 4 KiB
// pages for the rest").
std::string DescribePages(uint64_t capacity_bytes, uint64_t hugetlb_bytes, uint64_t thp_bytes);
class Arena;
// The arena's pages now; kept chunks not mapped yet are named as such.
std::string DescribeArenaPages(const Arena& arena);

class Arena {
 public:
  // Builds the whole arena or fails (nothing is left allocated on failure).
  // A NUMA node that does not exist is INVALID_ARGUMENT.
  static Result<std::unique_ptr<Arena>> Build(const ArenaOptions& options,
                                              ArenaBuildReport* report);

  uint32_t chunk_count() const { return static_cast<uint32_t>(chunk_bytes_.size()); }
  uint64_t chunk_bytes(uint32_t index) const { return chunk_bytes_[index]; }
  // The current backing of a chunk and its generation. Under the
  // SessionTable's lock (or while no chunk changes tenant, e.g. in tests).
  const Chunk& chunk(uint32_t index) const { return *backings_[index]; }
  std::shared_ptr<const Chunk> backing(uint32_t index) const { return backings_[index]; }
  uint64_t generation(uint32_t index) const { return generations_[index]; }
  // Puts `fresh` (same size) behind chunk `index`, bumps its generation and
  // returns the old backing. Under the SessionTable's lock.
  std::shared_ptr<Chunk> ReplaceBacking(uint32_t index, std::shared_ptr<Chunk> fresh);
  uint64_t capacity_bytes() const { return capacity_bytes_; }
  uint64_t chunk_size_bytes() const { return chunk_size_bytes_; }
  uint64_t page_bytes() const { return page_bytes_; }
  bool mlocked() const { return mlocked_; }
  // Bytes of the arena on huge pages after the build: on transparent huge
  // pages (kept chunks counted once mapped), and on hugetlbfs pages.
  uint64_t thp_bytes() const { return thp_bytes_.load(); }
  uint64_t hugetlb_bytes() const { return hugetlb_bytes_; }
  // The kept chunks not mapped into this process's page tables yet, once
  // (later calls: none). Before the daemon serves: no backing changes then.
  std::vector<std::weak_ptr<const Chunk>> TakeUnmappedKept();
  // Kept bytes whose page size is not known until mapped (their THP
  // allowed); MappedKept counts them.
  uint64_t unmeasured_bytes() const { return unmeasured_bytes_.load(); }
  void MappedKept(uint64_t thp_bytes) {
    thp_bytes_ += thp_bytes;
    unmeasured_bytes_ = 0;
  }

  ExtentAllocator& allocator() { return *allocator_; }
  const ExtentAllocator& allocator() const { return *allocator_; }

 private:
  Arena() = default;
  std::vector<Chunk> chunks_;  // while building only
  std::vector<std::shared_ptr<Chunk>> backings_;
  std::vector<uint64_t> generations_;
  std::vector<uint64_t> chunk_bytes_;
  std::unique_ptr<ExtentAllocator> allocator_;
  uint64_t capacity_bytes_ = 0;
  uint64_t chunk_size_bytes_ = 0;
  uint64_t page_bytes_ = 0;
  bool mlocked_ = false;
  uint64_t hugetlb_bytes_ = 0;
  std::atomic<uint64_t> thp_bytes_{0};
  std::atomic<uint64_t> unmeasured_bytes_{0};
  std::vector<bool> unmapped_kept_;  // by chunk index, until TakeUnmappedKept
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_ARENA_H_
