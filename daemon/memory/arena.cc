#include "memory/arena.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "base/log.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

constexpr uint64_t kPrefaultPieceBytes = 64 * kMiB;
constexpr uint64_t kProgressEveryBytes = 16 * kGiB;

// Pre-faults all chunks with `threads` workers pulling 64 MiB pieces from a
// shared counter. Logs progress for large arenas.
Status PrefaultAll(std::vector<Chunk>& chunks, int threads, const std::vector<bool>& skip) {
  struct Piece {
    uint32_t chunk;
    uint64_t offset, length;
  };
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (uint32_t c = 0; c < chunks.size(); ++c) {
    if (c < skip.size() && skip[c]) continue;
    for (uint64_t off = 0; off < chunks[c].size_bytes(); off += kPrefaultPieceBytes) {
      const uint64_t len = std::min(kPrefaultPieceBytes, chunks[c].size_bytes() - off);
      pieces.push_back({c, off, len});
      total += len;
    }
  }
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done_bytes{0};
  std::atomic<bool> failed{false};
  Status first_error;
  std::atomic_flag error_taken = ATOMIC_FLAG_INIT;
  auto worker = [&] {
    for (size_t i = next++; i < pieces.size() && !failed; i = next++) {
      const Piece& p = pieces[i];
      Status st = chunks[p.chunk].Prefault(p.offset, p.length);
      if (!st.ok()) {
        if (!error_taken.test_and_set()) first_error = st;
        failed = true;
        return;
      }
      const uint64_t before = done_bytes.fetch_add(p.length);
      if (total >= kProgressEveryBytes &&
          (before / kProgressEveryBytes) != ((before + p.length) / kProgressEveryBytes)) {
        MO_LOG_INFO("pre-faulting arena: %s of %s", FormatSize(before + p.length).c_str(),
                    FormatSize(total).c_str());
      }
    }
  };
  std::vector<std::thread> pool;
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(pieces.size())));
  for (int t = 1; t < n; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  return failed ? first_error : Status::Ok();
}

// Online NUMA nodes as listed in /sys/devices/system/node/online ("0",
// "0-3,6"). Empty when the file is missing (kernel without NUMA): node 0
// alone then.
std::vector<int> OnlineNumaNodes() {
  std::vector<int> nodes;
  FILE* f = std::fopen("/sys/devices/system/node/online", "r");
  if (f == nullptr) return {0};
  char buf[4096] = "";
  const bool read = std::fgets(buf, sizeof(buf), f) != nullptr;
  std::fclose(f);
  if (!read) return {0};
  for (char* p = buf; *p != '\0' && *p != '\n';) {
    char* end = nullptr;
    const long first = std::strtol(p, &end, 10);
    if (end == p) break;
    long last = first;
    p = end;
    if (*p == '-') {
      last = std::strtol(p + 1, &end, 10);
      p = end;
    }
    for (long n = first; n <= last && n < 65536; ++n) nodes.push_back(static_cast<int>(n));
    if (*p == ',') ++p;
  }
  return nodes;
}

std::string JoinNodes(const std::vector<int>& nodes) {
  std::string s;
  for (int n : nodes) s += (s.empty() ? "" : ",") + std::to_string(n);
  return s;
}

std::string HugepageAdvice(uint64_t arena_bytes, uint64_t huge_bytes) {
  const uint64_t pages = huge_bytes == 0 ? 0 : (arena_bytes + huge_bytes - 1) / huge_bytes;
  return "reserve them with 'sysctl -w vm.nr_hugepages=" + std::to_string(pages) +
         "' (or hugepages=" + std::to_string(pages) + " on the kernel command line)";
}

std::string MemlockAdvice(uint64_t needed) {
  rlimit lim{};
  getrlimit(RLIMIT_MEMLOCK, &lim);
  std::string current = lim.rlim_cur == RLIM_INFINITY
                            ? std::string("unlimited")
                            : FormatSize(static_cast<uint64_t>(lim.rlim_cur));
  return "RLIMIT_MEMLOCK is " + current + ", the arena needs " + FormatSize(needed) +
         "; raise it with 'ulimit -l unlimited', LimitMEMLOCK=infinity (systemd) or "
         "CAP_IPC_LOCK; continuing without mlock (pages may be swapped)";
}

// arena.numa_node names an online node.
Status CheckNumaNode(int numa_node) {
  const std::vector<int> nodes = OnlineNumaNodes();
  if (std::find(nodes.begin(), nodes.end(), numa_node) == nodes.end()) {
    return InvalidArgument("arena.numa_node: node " + std::to_string(numa_node) +
                           " does not exist; online nodes: " + JoinNodes(nodes) +
                           " (/sys/devices/system/node/online)");
  }
  return Status::Ok();
}

// Creates the chunks of options.size_bytes (only the last one may be
// shorter than the chunk size), on hugepages when asked and while they last;
// *sizes gets each chunk's size, the report why hugepages were not used and
// how many chunks have them.
Status CreateChunks(const ArenaOptions& options, std::vector<Chunk>* chunks,
                    std::vector<uint64_t>* sizes, ArenaBuildReport* report) {
  bool use_hugepages = options.hugepages;
  const uint64_t huge_bytes = DefaultHugePageBytes();
  if (use_hugepages && (huge_bytes == 0 || options.chunk_size_bytes % huge_bytes != 0)) {
    report->hugepage_fallback =
        huge_bytes == 0
            ? std::string("the kernel reports no hugepage size (Hugepagesize in /proc/meminfo)")
            : "chunk size " + FormatSize(options.chunk_size_bytes) +
                  " is not a multiple of the hugepage size " + FormatSize(huge_bytes) +
                  "; set --chunk-size to a multiple of it";
    use_hugepages = false;
  }
  for (uint64_t left = options.size_bytes; left > 0;) {
    const uint64_t size = std::min(left, options.chunk_size_bytes);
    const uint32_t index = static_cast<uint32_t>(sizes->size());
    const std::string name = "memoffload-chunk-" + std::to_string(index);
    if (index < options.adopt_fds.size() && options.adopt_fds[index] >= 0) {
      // Kept across a restart (app/state_store.h): mapped, its bytes as they are.
      Result<Chunk> kept = Chunk::Map(options.adopt_fds[index], size, false);
      if (!kept.ok()) {
        return Status(kept.status().code(), "mapping kept chunk " + std::to_string(index) + ": " +
                                                kept.status().message());
      }
      ++report->adopted_chunks;
      report->adopted_bytes += size;
      chunks->push_back(std::move(kept).value());
      sizes->push_back(size);
      left -= size;
      continue;
    }
    bool huge = use_hugepages && size % huge_bytes == 0;
    if (use_hugepages && !huge) {
      // Only the last chunk can be shorter than the chunk size.
      report->hugepage_fallback = "the last chunk (chunk " + std::to_string(index) + ", " +
                                  FormatSize(size) + ") is not a multiple of the hugepage size " +
                                  FormatSize(huge_bytes) + "; make --arena-size a multiple of it";
    }
    Result<Chunk> chunk = Chunk::Create(name, size, huge);
    if (!chunk.ok() && huge) {
      report->hugepage_fallback =
          "not enough hugepages: HugePages_Free=" + std::to_string(FreeHugePages()) + " of " +
          FormatSize(huge_bytes) + " at chunk " + std::to_string(index) + "; " +
          HugepageAdvice(options.size_bytes, huge_bytes);
      use_hugepages = false;
      huge = false;
      chunk = Chunk::Create(name, size, false);
    }
    if (!chunk.ok()) {
      return Status(chunk.status().code(), "creating chunk " + std::to_string(index) + " of " +
                                               FormatSize(size) + ": " + chunk.status().message());
    }
    if (huge) ++report->hugepage_chunks;
    chunks->push_back(std::move(chunk).value());
    sizes->push_back(size);
    left -= size;
  }
  return Status::Ok();
}

// Locks the chunks as they are faulted (MLOCK_ONFAULT), so that the
// pre-fault locks every page instead of a second single-threaded pass.
// Returns true when the kernel cannot (lock them after the pre-fault
// instead); on another failure *mlocked turns false and the report says why.
// Either way nothing stays locked on return but what MLOCK_ONFAULT will lock.
bool LockOnFault(std::vector<Chunk>& chunks, uint64_t arena_bytes, bool* mlocked,
                 ArenaBuildReport* report) {
  bool lock_after_prefault = false;
  for (Chunk& c : chunks) {
    Status st = c.LockOnFault();
    if (st.code() == StatusCode::kUnimplemented) {
      lock_after_prefault = true;
      break;
    }
    if (!st.ok()) {
      report->mlock_problem = st.message() + ": " + MemlockAdvice(arena_bytes);
      *mlocked = false;
      break;
    }
  }
  if (!*mlocked || lock_after_prefault) {
    for (Chunk& c : chunks) munlock(c.data(), c.size_bytes());
  }
  return lock_after_prefault;
}

// Locks the pre-faulted chunks; on a failure *mlocked turns false, the
// report says why and none stays locked.
void LockAfterPrefault(std::vector<Chunk>& chunks, uint64_t arena_bytes, bool* mlocked,
                       ArenaBuildReport* report) {
  for (Chunk& c : chunks) {
    if (Status st = c.Lock(); !st.ok()) {
      report->mlock_problem = st.message() + ": " + MemlockAdvice(arena_bytes);
      *mlocked = false;
      break;
    }
  }
  if (!*mlocked) {
    // Unlock whatever was locked: a partly locked arena helps nobody.
    for (Chunk& c : chunks) munlock(c.data(), c.size_bytes());
  }
}

// What the kernel gave each chunk, summed into the report, and the line
// that says why the arena is not all on huge pages.
void ReportPages(const std::vector<Chunk>& chunks, uint64_t capacity_bytes,
                 const std::vector<bool>& kept, ArenaBuildReport* report) {
  // A kept chunk's 2 MiB mappings are there only once it is mapped: its THP
  // bytes are counted then (MapKept), and not taken for small pages here.
  uint64_t unmeasured = 0;
  const ShmemThpSetting thp = ReadShmemThpSetting();
  // Reading smaps walks every page table of the arena: on 4 KiB pages a
  // second per 40 GiB or so. Where neither kind of huge page can be there,
  // the answer is known without it.
  // A kept chunk on hugetlbfs is known by its file system, unmapped.
  for (size_t i = 0; i < chunks.size() && i < kept.size(); ++i) {
    if (!kept[i]) continue;
    if (IsHugetlbFd(chunks[i].fd())) {
      report->hugetlb_bytes += chunks[i].size_bytes();
    } else if (thp.allows_advised()) {
      unmeasured += chunks[i].size_bytes();
    }
  }
  if (report->hugepage_chunks > 0 || thp.allows_advised()) {
    std::vector<const void*> starts;
    for (const Chunk& c : chunks) starts.push_back(c.data());
    Result<std::vector<MappingPages>> pages = PagesOf(starts);
    if (!pages.ok()) {
      MO_LOG_WARN("cannot tell the arena's page size: %s", pages.status().ToString().c_str());
      return;
    }
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (i < kept.size() && kept[i]) continue;  // above
      if ((*pages)[i].kernel_page_bytes > SystemPageBytes()) {
        report->hugetlb_bytes += chunks[i].size_bytes();
      } else {
        report->thp_bytes += std::min((*pages)[i].pmd_mapped_bytes, chunks[i].size_bytes());
      }
    }
  }
  report->unmeasured_bytes = unmeasured;
  if (report->hugetlb_bytes + report->thp_bytes + unmeasured >= capacity_bytes) return;
  const std::string knob = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
  if (thp.global.empty()) {
    report->pages_note =
        "this kernel has no shared-memory transparent huge pages (" + knob +
        " is missing); --hugepages with reserved pages (vm.nr_hugepages) puts it on 2 MiB pages";
  } else if (!thp.allows_advised()) {
    const bool per_size = !thp.pmd_size.empty() && thp.pmd_size != "inherit";
    report->pages_note =
        "shared-memory transparent huge pages are off (" +
        (per_size ? "/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled is '" +
                        thp.pmd_size + "'"
                  : knob + " is '" + thp.global + "'") +
        "); setting it to 'advise' puts the arena on 2 MiB pages, which makes a first write "
        "into it about as fast as a copy into touched memory (docs/deploy.md, 'Huge pages')";
  } else {
    report->pages_note = "the kernel gave " + FormatSize(report->thp_bytes) + " of " +
                         FormatSize(capacity_bytes - report->hugetlb_bytes - unmeasured) +
                         " as transparent huge pages (" + knob + " is '" + thp.global +
                         "'): memory was too fragmented for more; a start after a reboot, or "
                         "'echo 1 > /proc/sys/vm/compact_memory' first, gets more";
  }
}

}  // namespace

std::string DescribePages(uint64_t capacity_bytes, uint64_t hugetlb_bytes, uint64_t thp_bytes) {
  std::vector<std::string> parts;
  if (hugetlb_bytes > 0) parts.push_back("2 MiB pages (hugetlbfs)");
  if (thp_bytes > 0) parts.push_back("2 MiB pages (shared-memory THP)");
  const uint64_t small = capacity_bytes - std::min(capacity_bytes, hugetlb_bytes + thp_bytes);
  if (parts.empty()) return FormatSize(SystemPageBytes()) + " pages";
  if (small == 0 && parts.size() == 1) return parts[0];
  std::string out;
  if (hugetlb_bytes > 0) out += parts[0] + " for " + FormatSize(hugetlb_bytes);
  if (thp_bytes > 0) {
    out += std::string(out.empty() ? "" : ", ") + "2 MiB pages (shared-memory THP) for " +
           FormatSize(thp_bytes);
  }
  if (small > 0) out += ", " + FormatSize(SystemPageBytes()) + " pages for the rest";
  return out;
}

std::string DescribeArenaPages(const Arena& arena) {
  const uint64_t unmeasured = arena.unmeasured_bytes();
  const uint64_t measured = arena.capacity_bytes() - unmeasured;
  if (measured == 0) return "pages told once its kept chunks are mapped";
  std::string out = DescribePages(measured, arena.hugetlb_bytes(), arena.thp_bytes());
  if (unmeasured != 0) out += " (" + FormatSize(unmeasured) + " kept: told once mapped)";
  return out;
}

Result<std::unique_ptr<Arena>> Arena::Build(const ArenaOptions& options, ArenaBuildReport* report) {
  const auto start = std::chrono::steady_clock::now();
  if (options.size_bytes == 0 || options.chunk_size_bytes == 0) {
    return InvalidArgument("arena and chunk size must be positive");
  }
  if (options.numa_node >= 0) MEMOFFLOAD_RETURN_IF_ERROR(CheckNumaNode(options.numa_node));
  std::unique_ptr<Arena> arena(new Arena());
  arena->page_bytes_ = SystemPageBytes();
  arena->chunk_size_bytes_ = options.chunk_size_bytes;

  std::vector<uint64_t> sizes;
  MEMOFFLOAD_RETURN_IF_ERROR(CreateChunks(options, &arena->chunks_, &sizes, report));
  arena->chunk_bytes_ = sizes;
  if (options.hugepages && !report->hugepage_fallback.empty()) {
    MO_LOG_WARN("--hugepages: using normal pages for %zu of %zu chunks: %s",
                sizes.size() - report->hugepage_chunks, sizes.size(),
                report->hugepage_fallback.c_str());
  }
  arena->capacity_bytes_ = options.size_bytes;

  if (options.numa_node >= 0) {
    MO_LOG_INFO("binding arena memory to NUMA node %d", options.numa_node);
    for (Chunk& c : arena->chunks_) MEMOFFLOAD_RETURN_IF_ERROR(c.BindToNode(options.numa_node));
  }

  bool lock_after_prefault = false;
  if (options.mlock) {
    arena->mlocked_ = true;
    lock_after_prefault = LockOnFault(arena->chunks_, options.size_bytes, &arena->mlocked_, report);
  } else {
    report->mlock_problem = "mlock disabled by --no-mlock";
  }

  // Kept chunks are mapped after the daemon serves (TakeUnmappedKept).
  std::vector<bool> kept(arena->chunks_.size(), false);
  for (size_t i = 0; i < kept.size() && i < options.adopt_fds.size(); ++i) {
    kept[i] = options.adopt_fds[i] >= 0;
  }
  MEMOFFLOAD_RETURN_IF_ERROR(PrefaultAll(arena->chunks_, options.prefault_threads, kept));
  ReportPages(arena->chunks_, options.size_bytes, kept, report);
  arena->hugetlb_bytes_ = report->hugetlb_bytes;
  arena->thp_bytes_ = report->thp_bytes;
  arena->unmeasured_bytes_ = report->unmeasured_bytes;
  arena->unmapped_kept_ = kept;

  if (lock_after_prefault) {
    LockAfterPrefault(arena->chunks_, options.size_bytes, &arena->mlocked_, report);
  }
  arena->allocator_ = std::make_unique<ExtentAllocator>(sizes, arena->page_bytes_);
  for (Chunk& c : arena->chunks_) {
    arena->backings_.push_back(std::make_shared<Chunk>(std::move(c)));
    arena->generations_.push_back(1);
  }
  arena->chunks_.clear();
  report->mlocked = arena->mlocked_;
  report->build_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return arena;
}

std::vector<std::weak_ptr<const Chunk>> Arena::TakeUnmappedKept() {
  std::vector<std::weak_ptr<const Chunk>> out;
  for (size_t i = 0; i < unmapped_kept_.size(); ++i) {
    if (unmapped_kept_[i]) out.push_back(backings_[i]);
  }
  unmapped_kept_.clear();
  return out;
}

std::shared_ptr<Chunk> Arena::ReplaceBacking(uint32_t index, std::shared_ptr<Chunk> fresh) {
  // A new backing is pre-faulted by whoever made it.
  if (index < unmapped_kept_.size()) unmapped_kept_[index] = false;
  std::shared_ptr<Chunk> old = std::move(backings_[index]);
  backings_[index] = std::move(fresh);
  ++generations_[index];
  return old;
}

}  // namespace memoffload::daemon
