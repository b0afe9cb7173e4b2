// An arena for the in-process benches (allocator's reserve path, zeroing):
// `chunks` chunks of `chunk_bytes`, pre-faulted, not locked (as an
// unprivileged run would get). Null after printing why to stderr.
#ifndef MEMOFFLOAD_BENCH_BENCH_ARENA_H_
#define MEMOFFLOAD_BENCH_BENCH_ARENA_H_

#include <cstdint>
#include <cstdio>
#include <memory>

#include "memory/arena.h"

namespace memoffload::bench {

inline std::unique_ptr<daemon::Arena> BuildBenchArena(const char* bench, uint64_t chunk_bytes,
                                                      uint32_t chunks) {
  daemon::ArenaOptions options;
  options.size_bytes = chunk_bytes * chunks;
  options.chunk_size_bytes = chunk_bytes;
  options.mlock = false;
  daemon::ArenaBuildReport report;
  auto arena = daemon::Arena::Build(options, &report);
  if (!arena.ok()) {
    std::fprintf(stderr, "memoffload-bench %s: arena: %s\n", bench,
                 arena.status().ToString().c_str());
    return nullptr;
  }
  return std::move(arena).value();
}

}  // namespace memoffload::bench

#endif  // MEMOFFLOAD_BENCH_BENCH_ARENA_H_
