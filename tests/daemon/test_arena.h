// Helpers of the daemon unit tests: a small unlocked arena (four 1 MiB
// chunks by default) and a session opened as a given uid.
#ifndef MEMOFFLOAD_TESTS_DAEMON_TEST_ARENA_H_
#define MEMOFFLOAD_TESTS_DAEMON_TEST_ARENA_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/session_table.h"
#include "memoffload/common/units.h"
#include "memory/arena.h"

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

// Opens a session of `job` for a peer with this uid (and gid), pid 1234; on
// failure records a test failure and returns an empty grant.
inline SessionGrant OpenAs(SessionTable& table, uid_t uid, const std::string& job = "job") {
  Hello hello;
  hello.job_id = job;
  auto g = table.Open(hello, PeerCredentials{1234, uid, uid});
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  return g.ok() ? *g : SessionGrant{};
}

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_TESTS_DAEMON_TEST_ARENA_H_
