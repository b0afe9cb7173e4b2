// A small unlocked arena for daemon unit tests (four 1 MiB chunks by default).
#ifndef MEMOFFLOAD_TESTS_DAEMON_TEST_ARENA_H_
#define MEMOFFLOAD_TESTS_DAEMON_TEST_ARENA_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>

#include "memoffload/daemon/arena.h"
#include "memoffload/shared_mem/units.h"

namespace memoffload::daemon {

// Builds the arena; on failure records a test failure and returns nullptr.
inline std::unique_ptr<Arena> MakeTestArena(uint64_t size_bytes = 4 * kMiB,
                                            uint64_t chunk_size_bytes = kMiB) {
  ArenaOptions options;
  options.size_bytes = size_bytes;
  options.chunk_size_bytes = chunk_size_bytes;
  options.mlock = false;
  ArenaBuildReport report;
  auto arena = Arena::Build(options, &report);
  if (!arena.ok()) {
    ADD_FAILURE() << "test arena: " << arena.status().ToString();
    return nullptr;
  }
  return std::move(arena).value();
}

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_TESTS_DAEMON_TEST_ARENA_H_
