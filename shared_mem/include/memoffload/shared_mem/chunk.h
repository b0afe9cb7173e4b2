// Chunk: one memfd-backed piece of the arena, mapped MAP_SHARED.
//
// The daemon creates chunks (Create), pre-faults and locks them, and hands
// their fds to clients, which map them (Map). A created memfd is sealed
// against shrinking and growing, so no client can ftruncate it under the
// daemon (which would turn the daemon's accesses into SIGBUS).
//
// Huge pages: a hugetlbfs memfd (MFD_HUGETLB) when asked for; otherwise
// every mapping (the daemon's and each client's) starts at a 2 MiB-aligned
// address and is advised MADV_HUGEPAGE, so that where the node allows
// shared-memory transparent huge pages (shmem_enabled "advise"), the kernel
// backs the memfd with 2 MiB pages and maps them with one page-table entry
// each. Where it does not, the advice does nothing. PagesOf says what the
// kernel gave.
//
// A Chunk owns its fd and its mapping; both are released on destruction.
// Move-only; not thread-safe (callers synchronise).
#ifndef MEMOFFLOAD_SHARED_MEM_CHUNK_H_
#define MEMOFFLOAD_SHARED_MEM_CHUNK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload {

class Chunk {
 public:
  // Creates a sealed memfd of size_bytes and maps it read-write. With
  // hugepages the memfd uses MFD_HUGETLB (size must be a multiple of the
  // default hugepage size); failure then is RESOURCE_EXHAUSTED (typically no
  // hugepages reserved) and the caller decides whether to fall back.
  static Result<Chunk> Create(const std::string& name, uint64_t size_bytes, bool hugepages);

  // Maps a received chunk fd (taking ownership of it). The fd must be a memfd
  // of at least size_bytes. With populate, page tables are filled at once
  // (MAP_POPULATE), otherwise lazily on first touch.
  static Result<Chunk> Map(int fd, uint64_t size_bytes, bool populate);

  // Pieces small enough that a thread waiting for the mmap lock behind a
  // populate or an unmap waits about a millisecond (one 2 MiB hugepage).
  static constexpr uint64_t kMmapLockPiece = 2ull << 20;

  Chunk() = default;
  ~Chunk();
  Chunk(Chunk&& other) noexcept;
  Chunk& operator=(Chunk&& other) noexcept;
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  // Faults in pages [offset, offset + length) for writing (page-aligned
  // range), with MADV_POPULATE_WRITE where the kernel has it, else by touching
  // a byte per page. Safe to call from several threads on disjoint ranges.
  // With piece_bytes > 0 (a multiple of the page size), in calls of that
  // many bytes: a populate holds the process's mmap lock for as long as one
  // call runs, so the process's other threads' mmap, munmap and large
  // mallocs then wait for one piece at most (kMmapLockPiece).
  Status Prefault(uint64_t offset, uint64_t length, uint64_t piece_bytes = 0);

  // Fills this mapping's page tables for [offset, offset + length) (offset
  // page-aligned) without changing the contents: MADV_POPULATE_READ, which on
  // a memfd whose pages already exist maps them writable 16 at a time (fault
  // around), several times cheaper than one write fault per page. Falls back
  // to reading a byte per page. Safe to call from several threads, also on
  // overlapping ranges.
  Status MapPages(uint64_t offset, uint64_t length) const;

  // Binds the memfd's memory to NUMA node `node` (mbind MPOL_BIND on the
  // shared mapping, so it applies to the file whoever faults it). Call before
  // pages are faulted; pages that already exist are not moved.
  Status BindToNode(int node);

  // mlock()s the whole mapping. Returns the errno-based status on failure
  // (typically ENOMEM/EPERM when RLIMIT_MEMLOCK is too low).
  Status Lock();
  // Marks the whole mapping locked without faulting it (mlock2
  // MLOCK_ONFAULT): pages are locked as Prefault faults them, so locking
  // costs no second pass. UNIMPLEMENTED when the kernel lacks mlock2.
  Status LockOnFault();
  bool locked() const { return locked_; }

  int fd() const { return fd_; }
  uint8_t* data() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }
  bool valid() const { return data_ != nullptr; }

 private:
  Chunk(int fd, uint8_t* data, uint64_t size_bytes)
      : fd_(fd), data_(data), size_bytes_(size_bytes) {}
  void Reset();

  int fd_ = -1;
  uint8_t* data_ = nullptr;
  uint64_t size_bytes_ = 0;
  bool locked_ = false;
};

// What the kernel maps a mapping with, from /proc/self/smaps.
struct MappingPages {
  uint64_t kernel_page_bytes = 0;  // KernelPageSize (2 MiB for hugetlbfs)
  uint64_t pmd_mapped_bytes = 0;   // ShmemPmdMapped: shared memory on huge pages (THP)
  uint64_t rss_bytes = 0;          // Rss
  uint64_t size_bytes = 0;         // Size
};
// The pages of the mappings that start at `starts` in this process, in
// order, from one read of /proc/self/smaps (NOT_FOUND when one is missing).
// The kernel walks every mapping's page tables for it: on 4 KiB pages about
// 25 ns per page mapped, so ask once for all.
Result<std::vector<MappingPages>> PagesOf(const std::vector<const void*>& starts);

// The kernel's shared-memory THP setting: the selected word of
// /sys/kernel/mm/transparent_hugepage/shmem_enabled ("never", "advise",
// "always", "within_size", "deny", "force"), and of its 2 MiB size
// (hugepages-2048kB/shmem_enabled, "inherit" where it follows the first);
// "" where the kernel has none.
struct ShmemThpSetting {
  std::string global;
  std::string pmd_size;
  // Whether a mapping advised MADV_HUGEPAGE may get 2 MiB pages.
  bool allows_advised() const;
};
ShmemThpSetting ReadShmemThpSetting();
// The selected word of a sysfs choice file ("a [b] c" -> "b"), "" if none.
std::string SelectedWord(const std::string& contents);

// Page size of the running system.
uint64_t SystemPageBytes();
// Whether `fd` is a file of hugetlbfs (a MFD_HUGETLB memfd).
bool IsHugetlbFd(int fd);

// The default hugepage size (Hugepagesize in /proc/meminfo), 0 if unknown.
uint64_t DefaultHugePageBytes();
// Free hugepages of the default size (HugePages_Free), 0 if unknown.
uint64_t FreeHugePages();

}  // namespace memoffload

#endif  // MEMOFFLOAD_SHARED_MEM_CHUNK_H_
