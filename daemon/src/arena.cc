#include "memoffload/daemon/arena.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "memoffload/daemon/log.h"
#include "memoffload/shared_mem/units.h"

namespace memoffload::daemon {
namespace {

constexpr uint64_t kPrefaultPieceBytes = 64 * kMiB;
constexpr uint64_t kProgressEveryBytes = 16 * kGiB;

// Pre-faults all chunks with `threads` workers pulling 64 MiB pieces from a
// shared counter. Logs progress for large arenas.
Status PrefaultAll(std::vector<Chunk>& chunks, int threads) {
  struct Piece {
    uint32_t chunk;
    uint64_t offset, length;
  };
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (uint32_t c = 0; c < chunks.size(); ++c) {
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

}  // namespace

Result<std::unique_ptr<Arena>> Arena::Build(const ArenaOptions& options, ArenaBuildReport* report) {
  const auto start = std::chrono::steady_clock::now();
  if (options.size_bytes == 0 || options.chunk_size_bytes == 0) {
    return InvalidArgument("arena and chunk size must be positive");
  }
  std::unique_ptr<Arena> arena(new Arena());
  arena->page_bytes_ = SystemPageBytes();
  arena->chunk_size_bytes_ = options.chunk_size_bytes;
  std::vector<uint64_t> sizes;
  for (uint64_t left = options.size_bytes; left > 0;) {
    const uint64_t size = std::min(left, options.chunk_size_bytes);
    const std::string name = "memoffload-chunk-" + std::to_string(sizes.size());
    Result<Chunk> chunk = Chunk::Create(name, size, options.hugepages);
    if (!chunk.ok()) {
      return Status(chunk.status().code(), "creating chunk " + std::to_string(sizes.size()) +
                                               " of " + FormatSize(size) + ": " +
                                               chunk.status().message());
    }
    arena->chunks_.push_back(std::move(chunk).value());
    sizes.push_back(size);
    left -= size;
  }
  arena->capacity_bytes_ = options.size_bytes;
  MEMOFFLOAD_RETURN_IF_ERROR(PrefaultAll(arena->chunks_, options.prefault_threads));

  if (options.mlock) {
    arena->mlocked_ = true;
    for (Chunk& c : arena->chunks_) {
      if (Status st = c.Lock(); !st.ok()) {
        report->mlock_problem = st.message() + ": " + MemlockAdvice(options.size_bytes);
        arena->mlocked_ = false;
        break;
      }
    }
    if (!arena->mlocked_) {
      // Unlock whatever was locked: a partly locked arena helps nobody.
      for (Chunk& c : arena->chunks_) munlock(c.data(), c.size_bytes());
    }
  } else {
    report->mlock_problem = "mlock disabled by --no-mlock";
  }
  arena->allocator_ = std::make_unique<ExtentAllocator>(sizes, arena->page_bytes_);
  report->mlocked = arena->mlocked_;
  report->build_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return arena;
}

}  // namespace memoffload::daemon
