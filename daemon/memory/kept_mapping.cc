#include "memory/kept_mapping.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "memoffload/common/units.h"

namespace memoffload::daemon {

KeptMapping MapKept(const std::vector<std::shared_ptr<const Chunk>>& chunks, int threads,
                    const std::atomic<bool>& stop) {
  constexpr uint64_t kPiece = 64 * kMiB;
  const auto start = std::chrono::steady_clock::now();
  struct Piece {
    const Chunk* chunk;
    uint64_t offset, length;
  };
  std::vector<Piece> pieces;
  for (const auto& c : chunks) {
    for (uint64_t off = 0; off < c->size_bytes(); off += kPiece) {
      pieces.push_back({c.get(), off, std::min(kPiece, c->size_bytes() - off)});
    }
  }
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> mapped{0};
  auto worker = [&] {
    for (size_t i; !stop.load() && (i = next.fetch_add(1)) < pieces.size();) {
      // In range by construction: MapPages fails for nothing else.
      (void)pieces[i].chunk->MapPages(pieces[i].offset, pieces[i].length).ok();
      mapped += pieces[i].length;
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
    std::vector<const void*> starts;
    for (const auto& c : chunks) starts.push_back(c->data());
    Result<std::vector<MappingPages>> pages = PagesOf(starts);
    for (size_t i = 0; pages.ok() && i < chunks.size(); ++i) {
      if ((*pages)[i].kernel_page_bytes <= SystemPageBytes()) {
        out.thp_bytes += std::min((*pages)[i].pmd_mapped_bytes, chunks[i]->size_bytes());
      }
    }
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace memoffload::daemon
