// memoffload-bench startup [--arena-size SIZE] [--chunk-size SIZE]
//                          [--threads N] [--hugepages] [--numa-node N] [--json]
//
// Builds the daemon's arena in this process with the daemon's own code
// (Arena::Build: memfd chunks, MLOCK_ONFAULT, parallel MADV_POPULATE_WRITE)
// and reports its rate next to the baseline measured in the same run: a
// plain parallel memset of a fresh private mmap of the same size with the
// same thread count. The memset runs once before and once after the build
// (their mean is the baseline), so neither side profits alone from pages the
// kernel has just freed.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "benches.h"
#include "memoffload/common/units.h"
#include "memory/arena.h"

namespace memoffload::bench {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Seconds to memset a fresh private anonymous mapping of `bytes` with
// `threads` threads, each taking one contiguous slice. -1 if mmap fails.
double TimeParallelMemset(uint64_t bytes, int threads) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return -1;
  uint8_t* base = static_cast<uint8_t*>(p);
  const uint64_t page = SystemPageBytes();
  const uint64_t slice = (bytes / threads + page - 1) / page * page;
  const auto start = Clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    const uint64_t from = std::min(bytes, t * slice);
    const uint64_t to = std::min(bytes, from + slice);
    pool.emplace_back([=] { std::memset(base + from, 1, to - from); });
  }
  for (auto& t : pool) t.join();
  const double seconds = SecondsSince(start);
  munmap(p, bytes);
  return seconds;
}

void PrintUsage() {
  std::fprintf(stderr,
               "usage: memoffload-bench startup [--arena-size SIZE] [--chunk-size SIZE]\n"
               "                                [--threads N] [--hugepages] [--numa-node N] "
               "[--json]\n"
               "Builds an arena with the daemon's code and reports its GB/s next to a\n"
               "parallel memset of a fresh private mapping of the same size (same threads).\n"
               "Defaults: 4GiB arena, 1GiB chunks, one thread per core.\n");
}

bool ParseSizeFlag(const char* flag, const char* value, uint64_t* out) {
  Result<uint64_t> r = ParseSize(value);
  if (!r.ok() || *r == 0) {
    std::fprintf(stderr, "startup: %s wants a size like 4GiB, got '%s'\n", flag, value);
    return false;
  }
  *out = *r;
  return true;
}

}  // namespace

int RunStartupBench(int argc, char** argv) {
  bool json = false;
  daemon::ArenaOptions options;
  options.size_bytes = 4 * kGiB;
  options.chunk_size_bytes = kGiB;
  options.prefault_threads = static_cast<int>(std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)));
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const bool has_value = i + 1 < argc;
    if (std::strcmp(a, "--json") == 0) {
      json = true;
    } else if (std::strcmp(a, "--hugepages") == 0) {
      options.hugepages = true;
    } else if (std::strcmp(a, "--arena-size") == 0 && has_value) {
      if (!ParseSizeFlag(a, argv[++i], &options.size_bytes)) return 2;
    } else if (std::strcmp(a, "--chunk-size") == 0 && has_value) {
      if (!ParseSizeFlag(a, argv[++i], &options.chunk_size_bytes)) return 2;
    } else if ((std::strcmp(a, "--threads") == 0 || std::strcmp(a, "--numa-node") == 0) &&
               has_value) {
      char* end = nullptr;
      const long n = std::strtol(argv[++i], &end, 10);
      if (end == argv[i] || *end != '\0' || n < 0 || n > 1024) {
        std::fprintf(stderr, "startup: %s wants a number, got '%s'\n", a, argv[i]);
        return 2;
      }
      if (a[2] == 't') {
        options.prefault_threads = std::max(1, static_cast<int>(n));
      } else {
        options.numa_node = static_cast<int>(n);
      }
    } else if (std::strcmp(a, "--help") == 0) {
      PrintUsage();
      return 0;
    } else {
      std::fprintf(stderr, "startup: unknown flag '%s'\n", a);
      PrintUsage();
      return 2;
    }
  }
  const uint64_t page = SystemPageBytes();
  options.size_bytes = options.size_bytes / page * page;
  options.chunk_size_bytes = std::min(options.chunk_size_bytes, options.size_bytes);
  const int threads = options.prefault_threads;

  const double memset_before = TimeParallelMemset(options.size_bytes, threads);
  daemon::ArenaBuildReport report;
  double build_seconds = 0;
  {
    const auto start = Clock::now();
    Result<std::unique_ptr<daemon::Arena>> arena = daemon::Arena::Build(options, &report);
    build_seconds = SecondsSince(start);
    if (!arena.ok()) {
      std::fprintf(stderr, "startup: building the arena failed: %s\n",
                   arena.status().ToString().c_str());
      return 1;
    }
  }  // the arena is released before the second baseline run
  const double memset_after = TimeParallelMemset(options.size_bytes, threads);
  if (memset_before < 0 || memset_after < 0) {
    std::fprintf(stderr, "startup: mmap of %s for the memset baseline failed\n",
                 FormatSize(options.size_bytes).c_str());
    return 1;
  }
  const double gb = static_cast<double>(options.size_bytes) / 1e9;
  const double build_gbps = gb / build_seconds;
  const double memset_gbps = (gb / memset_before + gb / memset_after) / 2;
  const std::string pages =
      daemon::DescribePages(options.size_bytes, report.hugetlb_bytes, report.thp_bytes);
  if (json) {
    std::printf(
        "{\"bench\":\"startup\",\"arena_bytes\":%llu,\"chunk_bytes\":%llu,\"threads\":%d,"
        "\"build_seconds\":%.4f,\"build_gbps\":%.3f,\"memset_gbps\":%.3f,"
        "\"memset_before_gbps\":%.3f,\"memset_after_gbps\":%.3f,\"ratio\":%.3f,"
        "\"mlocked\":%s,\"hugepage_chunks\":%u,\"numa_node\":%d,\"hugetlb_bytes\":%llu,"
        "\"thp_bytes\":%llu,\"pages\":\"%s\"}\n",
        static_cast<unsigned long long>(options.size_bytes),
        static_cast<unsigned long long>(options.chunk_size_bytes), threads, build_seconds,
        build_gbps, memset_gbps, gb / memset_before, gb / memset_after, build_gbps / memset_gbps,
        report.mlocked ? "true" : "false", report.hugepage_chunks, options.numa_node,
        static_cast<unsigned long long>(report.hugetlb_bytes),
        static_cast<unsigned long long>(report.thp_bytes), pages.c_str());
  } else {
    std::printf("arena %s on %s, %d threads: build %.3f s = %.2f GB/s (mlock %s)\n",
                FormatSize(options.size_bytes).c_str(), pages.c_str(), threads, build_seconds,
                build_gbps, report.mlocked ? "yes" : "no");
    std::printf("parallel memset of fresh private memory: %.2f GB/s (before %.2f, after %.2f)\n",
                memset_gbps, gb / memset_before, gb / memset_after);
    std::printf("ratio build / memset: %.2f (target >= 0.8)\n", build_gbps / memset_gbps);
  }
  return 0;
}

}  // namespace memoffload::bench
