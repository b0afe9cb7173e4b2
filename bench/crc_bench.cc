// memoffload-bench crc: the cost of the optional per-extent CRC32C check.
// Measures CRC32C throughput over a buffer next to a memcpy of the same
// buffer in the same run: with checksums on, the client pays one extra pass
// at Commit and one at Prefetch, so offload and prefetch copy time grows by
// about memcpy_gbps / crc_gbps.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "benches.h"
#include "memoffload/common/crc32c.h"

namespace memoffload::bench {
namespace {

using Clock = std::chrono::steady_clock;

template <typename Fn>
double BestGbps(uint64_t bytes, int repeats, Fn fn) {
  double best = 0;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, bytes / s / 1e9);
  }
  return best;
}

}  // namespace

int RunCrcBench(int argc, char** argv) {
  bool json = false;
  uint64_t bytes = 256ull << 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "--bytes") == 0 && i + 1 < argc) {
      bytes = std::stoull(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: memoffload-bench crc [--bytes N] [--json]\n");
      return 2;
    }
  }
  std::vector<uint8_t> src(bytes), dst(bytes);
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(&src[i], &v, 8);
  }
  std::memset(dst.data(), 1, bytes);  // fault it in before timing
  volatile uint32_t sink = 0;
  const double memcpy_gbps =
      BestGbps(bytes, 5, [&] { std::memcpy(dst.data(), src.data(), bytes); });
  const double crc_gbps = BestGbps(bytes, 5, [&] { sink = Crc32c(src.data(), bytes); });
  const double portable_gbps =
      BestGbps(bytes / 8, 3, [&] { sink = Crc32cPortable(src.data(), bytes / 8); });
  (void)sink;
  const double overhead = memcpy_gbps / crc_gbps;
  if (json) {
    std::printf(
        "{\"bench\":\"crc\",\"bytes\":%llu,\"hardware\":%s,\"crc_gbps\":%.2f,"
        "\"portable_crc_gbps\":%.2f,\"memcpy_gbps\":%.2f,\"copy_time_overhead\":%.3f}\n",
        static_cast<unsigned long long>(bytes), Crc32cIsHardware() ? "true" : "false", crc_gbps,
        portable_gbps, memcpy_gbps, overhead);
  } else {
    std::printf("crc32c (%s): %.2f GB/s, portable %.2f GB/s, memcpy %.2f GB/s\n",
                Crc32cIsHardware() ? "sse4.2" : "table", crc_gbps, portable_gbps, memcpy_gbps);
    std::printf("checksums add about %.0f%% to each copy (one extra pass per direction)\n",
                overhead * 100);
  }
  return 0;
}

}  // namespace memoffload::bench
