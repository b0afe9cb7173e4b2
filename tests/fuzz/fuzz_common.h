// Helpers shared by the fuzz targets: a small real arena built once per
// process, and a check that aborts with a message (libFuzzer then saves the
// input as a crash).
#ifndef MEMOFFLOAD_TESTS_FUZZ_FUZZ_COMMON_H_
#define MEMOFFLOAD_TESTS_FUZZ_FUZZ_COMMON_H_

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "memoffload/common/status.h"
#include "memoffload/common/units.h"
#include "memory/arena.h"

namespace memoffload::fuzz {

[[noreturn]] inline void Die(const std::string& what) {
  std::fprintf(stderr, "fuzz check failed: %s\n", what.c_str());
  std::abort();
}

inline void Check(bool condition, const std::string& what) {
  if (!condition) Die(what);
}

inline void CheckOk(const Status& status, const std::string& what) {
  if (!status.ok()) Die(what + ": " + status.ToString());
}

// A 4 MiB arena of 1 MiB chunks, not mlock'ed, shared by every iteration.
// Each iteration must give back everything it reserved (the targets check).
inline daemon::Arena* SharedArena() {
  static daemon::Arena* arena = [] {
    daemon::ArenaOptions options;
    options.size_bytes = 4 * kMiB;
    options.chunk_size_bytes = kMiB;
    options.mlock = false;
    daemon::ArenaBuildReport report;
    Result<std::unique_ptr<daemon::Arena>> built = daemon::Arena::Build(options, &report);
    CheckOk(built.status(), "building the fuzz arena");
    return std::move(built).value().release();
  }();
  return arena;
}

}  // namespace memoffload::fuzz

#endif  // MEMOFFLOAD_TESTS_FUZZ_FUZZ_COMMON_H_
