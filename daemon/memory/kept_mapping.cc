#include "memory/kept_mapping.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "memoffload/common/units.h"

namespace memoffload::daemon {

KeptMapping MapKept(const std::vector<std::weak_ptr<const Chunk>>& chunks, int threads,
                    const std::atomic<bool>& stop) {
  constexpr uint64_t kPiece = 64 * kMiB;
  const auto start = std::chrono::steady_clock::now();
  struct Piece {
    size_t chunk;
    uint64_t offset, length;
  };
  std::vector<Piece> pieces;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const std::shared_ptr<const Chunk> chunk = chunks[c].lock();
    if (chunk == nullptr) continue;
    for (uint64_t off = 0; off < chunk->size_bytes(); off += kPiece) {
      pieces.push_back({c, off, std::min(kPiece, chunk->size_bytes() - off)});
    }
  }
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> mapped{0};
  auto worker = [&] {
    for (size_t i; !stop.load() && (i = next.fetch_add(1)) < pieces.size();) {
      // Held for the piece only: a chunk that changes tenant meanwhile is
      // retired to its old holders, not kept by this pass.
      const std::shared_ptr<const Chunk> chunk = chunks[pieces[i].chunk].lock();
      if (chunk == nullptr) continue;
      // In calls of one huge page: the daemon's other threads wait for the
      // mmap lock behind one call at most (Chunk::kMmapLockPiece).
      const Piece& p = pieces[i];
      for (uint64_t off = p.offset; off < p.offset + p.length && !stop.load();
           off += Chunk::kMmapLockPiece) {
        const uint64_t n = std::min(Chunk::kMmapLockPiece, p.offset + p.length - off);
        // In range by construction: MapPages fails for nothing else.
        (void)chunk->MapPages(off, n).ok();
        mapped += n;
      }
    }
  };
  std::vector<std::thread> pool;
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(pieces.size())));
  for (int t = 1; t < n; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  KeptMapping out;
  out.chunks = static_cast<uint32_t>(chunks.size());
  out.bytes = mapped.load();
  out.stopped = stop.load();
  if (!out.stopped && ReadShmemThpSetting().allows_advised()) {
    std::vector<std::shared_ptr<const Chunk>> alive;
    std::vector<const void*> starts;
    for (const auto& weak : chunks) {
      if (std::shared_ptr<const Chunk> c = weak.lock()) {
        starts.push_back(c->data());
        alive.push_back(std::move(c));
      }
    }
    Result<std::vector<MappingPages>> pages = PagesOf(starts);
    for (size_t i = 0; pages.ok() && i < alive.size(); ++i) {
      if ((*pages)[i].kernel_page_bytes <= SystemPageBytes()) {
        out.thp_bytes += std::min((*pages)[i].pmd_mapped_bytes, alive[i]->size_bytes());
      }
    }
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace memoffload::daemon
