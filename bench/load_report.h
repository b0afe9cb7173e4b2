// memoffload-bench load: what the parent (load_bench.cc) adds up from its
// client processes, and how it prints where the time and the CPU went.
#ifndef MEMOFFLOAD_BENCH_LOAD_REPORT_H_
#define MEMOFFLOAD_BENCH_LOAD_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "latency_stats.h"
#include "load_options.h"

namespace memoffload::bench {

// One phase's reports (the daemon's load or the floor's), or several merged.
struct PhaseTotals {
  MethodStats total[kMethods];
  uint64_t offloaded_bytes = 0, verify_failures = 0, cycles = 0, lost_workers = 0;
  uint64_t write_errors = 0;
  double elapsed_max = 0;
  std::vector<std::string> messages;
  CpuTime clients;  // the workers' timed windows, added up
  // The server's, from the start signal until every worker's window ended
  // (drains and exits come after); server_known is false when it could not
  // be read.
  CpuTime server;
  bool server_known = false;
  int phases = 0;  // merged into this
};

// One (daemon, floor) pair's ratios per method.
struct PairRatios {
  double p50[kMethods] = {};
  double p99[kMethods] = {};
  double cpu = 0;  // CPU per call, clients and server, vs the floor's (0: unknown)
};

struct Spread {
  double median = 0, min = 0, max = 0;
};

void Merge(MethodStats* into, const MethodStats& s);
// Adds a phase that ran after the ones in *into.
void Merge(PhaseTotals* into, const PhaseTotals& t);

// The median of v and its min..max; v must not be empty.
Spread SpreadOf(std::vector<double> v);

// Each pair's ratios, then per method the median over the pairs and its
// spread (the figure the load targets are read from).
void PrintPairRatios(const LoadOptions& o, const std::vector<PairRatios>& pairs);

// Calls made in a phase, answered or not.
uint64_t Calls(const PhaseTotals& t);

// Client and server CPU per call (us), copies included, of a phase.
double CpuPerCallUs(const PhaseTotals& t);

// Where the CPU went in `what` (the daemon's phases or the floor's): the
// clients' timed windows (of which their copies and verify) and the
// server's, per call. With hundreds of clients on a few cores the machine
// is saturated: a call's latency is then mostly its wait for the CPU the
// other calls use, so the p50 ratio follows the ratio of CPU per call.
void PrintCpuUse(const LoadOptions& o, const char* what, const PhaseTotals& t);

}  // namespace memoffload::bench

#endif  // MEMOFFLOAD_BENCH_LOAD_REPORT_H_
