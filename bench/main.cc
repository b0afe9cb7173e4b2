// memoffload-bench: benchmarks that report our numbers next to a baseline
// measured in the same run. Usage: memoffload-bench <allocator|...> [flags].
#include <absl/synchronization/mutex.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "benches.h"

namespace {

struct Subcommand {
  const char* name;
  const char* help;
  int (*run)(int argc, char** argv);
};

const Subcommand kSubcommands[] = {
    {"allocator", "replay activation traces: packing vs a pow2 caching model",
     memoffload::bench::RunAllocatorBench},
    {"startup", "arena build GB/s vs a parallel memset of the same size",
     memoffload::bench::RunStartupBench},
    {"attach", "attach latency and first-write GB/s vs private-memory memcpy",
     memoffload::bench::RunAttachBench},
    {"load", "N client processes cycle groups against a running daemon: ops/s, latency",
     memoffload::bench::RunLoadBench},
    {"crc", "CRC32C integrity check cost vs memcpy of the same bytes",
     memoffload::bench::RunCrcBench},
    {"zeroing", "a chunk changing tenant (fresh backing) vs memset of the same size",
     memoffload::bench::RunZeroingBench},
    {"edge", "HTTP/2 attacks on the gRPC socket: daemon memory, victims' p99 vs no attack",
     memoffload::bench::RunEdgeBench},
    {"streams", "plain TLS 1.3 (PSK) or TCP streams between two addresses: the link's baselines",
     memoffload::bench::RunStreamBench},

};

void PrintUsage() {
  std::fprintf(stderr, "usage: memoffload-bench <subcommand> [flags]\n\n");
  for (const auto& s : kSubcommands) {
    std::fprintf(stderr, "  %-10s %s\n", s.name, s.help);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // As memoffloadd does (daemon/app/main.cc): no lock-order graph on every
  // absl::Mutex lock, for the floor's server and every client alike.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    PrintUsage();
    return argc < 2 ? 2 : 0;
  }
  for (const auto& s : kSubcommands) {
    if (std::strcmp(argv[1], s.name) == 0) return s.run(argc - 1, argv + 1);
  }
  // Hidden: one client process of `load`, started by it.
  if (std::strcmp(argv[1], "load-worker") == 0) {
    return memoffload::bench::RunLoadWorker(argc - 1, argv + 1);
  }
  // Hidden: one client of bench/takeover_pause_bench.py.
  if (std::strcmp(argv[1], "pause-worker") == 0) {
    return memoffload::bench::RunPauseWorker(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "memoffload-bench: unknown subcommand '%s'\n", argv[1]);
  PrintUsage();
  return 2;
}
