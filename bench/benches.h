// Entry points of memoffload-bench's subcommands. Each takes the arguments
// after the subcommand name (argv[0] is the subcommand) and returns an exit
// code; each prints one JSON object per line with --json.
#ifndef MEMOFFLOAD_BENCH_BENCHES_H_
#define MEMOFFLOAD_BENCH_BENCHES_H_

#include <cstdint>

namespace memoffload::bench {

int RunAllocatorBench(int argc, char** argv);
// Part of `allocator`: Reserve+Release through SessionTable, tenant-restricted
// vs unrestricted, latency (at least `samples` pairs each) and utilisation.
int PrintReservePathBench(bool json, uint64_t seed, uint64_t samples);
int RunStartupBench(int argc, char** argv);
int RunAttachBench(int argc, char** argv);
int RunLoadBench(int argc, char** argv);
// The hidden `load-worker` subcommand: one client process of RunLoadBench.
int RunLoadWorker(int argc, char** argv);
// The hidden `pause-worker` subcommand: one client of takeover_pause_bench.py.
int RunPauseWorker(int argc, char** argv);
int RunCrcBench(int argc, char** argv);
int RunZeroingBench(int argc, char** argv);
// The HTTP/2 attacks of issue 29 against a running daemon (edge_bench.cc).
int RunEdgeBench(int argc, char** argv);
// Plain TLS and TCP streams between two addresses: the link's baselines.
int RunStreamBench(int argc, char** argv);

}  // namespace memoffload::bench

#endif  // MEMOFFLOAD_BENCH_BENCHES_H_
