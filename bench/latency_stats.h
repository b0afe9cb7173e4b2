// Per-method latency statistics of memoffload-bench load: a histogram with 2%
// wide log buckets, mergeable across worker processes through the text lines
// PrintMethodStats writes ("M method ops errors rejected", "H method bucket
// count").
#ifndef MEMOFFLOAD_BENCH_LATENCY_STATS_H_
#define MEMOFFLOAD_BENCH_LATENCY_STATS_H_

#include <sys/resource.h>
#include <time.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace memoffload::bench {

using Clock = std::chrono::steady_clock;

inline constexpr double kBucketBase = 1.02;
inline constexpr int kBuckets = 1400;  // up to ~1e12 ns

inline int BucketOf(double ns) {
  if (ns < 1) return 0;
  const int b = static_cast<int>(std::log(ns) / std::log(kBucketBase));
  return b < kBuckets ? b : kBuckets - 1;
}

inline double BucketValueNs(int bucket) { return std::pow(kBucketBase, bucket + 0.5); }

struct MethodStats {
  uint64_t ops = 0;  // successful calls
  uint64_t errors = 0;
  uint64_t rejected = 0;  // RESOURCE_EXHAUSTED
  std::vector<uint64_t> histogram = std::vector<uint64_t>(kBuckets, 0);

  void Record(Clock::duration elapsed) {
    ++histogram[BucketOf(std::chrono::duration<double, std::nano>(elapsed).count())];
  }
  double PercentileUs(double q) const {
    uint64_t total = 0;
    for (uint64_t c : histogram) total += c;
    if (total == 0) return 0;
    const uint64_t target = static_cast<uint64_t>(std::ceil(q * static_cast<double>(total)));
    uint64_t seen = 0;
    for (int b = 0; b < kBuckets; ++b) {
      seen += histogram[b];
      if (seen >= target && histogram[b] > 0) return BucketValueNs(b) / 1000.0;
    }
    return BucketValueNs(kBuckets - 1) / 1000.0;
  }
};

// Writes one method's counts and non-empty buckets for the parent to merge.
inline void PrintMethodStats(int method, const MethodStats& s) {
  std::printf("M %d %lu %lu %lu\n", method, static_cast<unsigned long>(s.ops),
              static_cast<unsigned long>(s.errors), static_cast<unsigned long>(s.rejected));
  for (int b = 0; b < kBuckets; ++b) {
    if (s.histogram[b] != 0) {
      std::printf("H %d %d %lu\n", method, b, static_cast<unsigned long>(s.histogram[b]));
    }
  }
}

// CPU time, user and system, in seconds; `copy` is the part a load worker
// spent copying bytes into and out of the arena and verifying them (the
// floor's workers copy nothing).
struct CpuTime {
  double user = 0;
  double sys = 0;
  double copy = 0;
  CpuTime operator-(const CpuTime& o) const { return {user - o.user, sys - o.sys, copy - o.copy}; }
  CpuTime& operator+=(const CpuTime& o) {
    user += o.user;
    sys += o.sys;
    copy += o.copy;
    return *this;
  }
};

// The calling thread's CPU time so far, in seconds.
inline double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec / 1e9;
}

// This process's CPU time so far (every thread).
inline CpuTime SelfCpu() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return {secs(u.ru_utime), secs(u.ru_stime)};
}

// A worker's CPU time over its timed window, for the parent to add up
// ("C user sys").
inline void PrintCpu(const CpuTime& c) { std::printf("C %.6f %.6f %.6f\n", c.user, c.sys, c.copy); }

}  // namespace memoffload::bench

#endif  // MEMOFFLOAD_BENCH_LATENCY_STATS_H_
