// memoffload-bench allocator [--json] [--seed N] [--samples N]
//
// Replays each trace of traces.h into an arena of the trace's capacity and
// reports, for ExtentAllocator and for a model of PyTorch's pinned-memory
// CachingHostAllocator measured in the same run, the utilisation at the
// first failed reserve: live requested bytes / capacity. Also reports the
// p50/p99 latency of one Allocate plus the Free of everything it returned.
// Each trace runs unrestricted and restricted (8 tenants, each allocating
// only in the chunks it owns, as the daemon's default tenant mode does), and
// with single_extent for the single-extent utilisation. A restricted trace
// also runs through the old vector<bool> path (bitmap_*), same run: same
// placement, the latency baseline of the chunk list (AllocateIn).
// Only bookkeeping runs here; no memory is touched. Then the Reserve path
// through SessionTable (reserve_path_bench.cc), over real arenas.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benches.h"
#include "memory/allocator.h"
#include "traces.h"

namespace memoffload::bench {
namespace {

using daemon::Extent;
using daemon::ExtentAllocator;
using Clock = std::chrono::steady_clock;

// Latency samples are collected over repeated replays until at least this
// many alloc+free pairs were timed.
constexpr size_t kMinLatencySamples = 200000;

int CeilLog2(uint64_t v) { return v <= 1 ? 0 : 64 - __builtin_clzll(v - 1); }

// PyTorch's CachingHostAllocator as the benchmark models it: a request is
// rounded up to a power of two; a released block is cached and later reused
// whole by a request that fits it (the smallest such block), never split and
// never returned; new blocks are carved from the budget until it runs out.
class Pow2CachingModel {
 public:
  Pow2CachingModel(uint64_t budget_bytes, uint32_t ids)
      : budget_bytes_(budget_bytes), block_log2_(ids, -1) {}

  bool Reserve(uint32_t id, uint64_t bytes) {
    const int need = CeilLog2(bytes);
    for (int e = need; e < 64; ++e) {
      if (cached_[e] > 0) {
        --cached_[e];
        block_log2_[id] = static_cast<int8_t>(e);
        return true;
      }
    }
    const uint64_t block = uint64_t{1} << need;
    if (block > budget_bytes_ - carved_bytes_) return false;
    carved_bytes_ += block;
    block_log2_[id] = static_cast<int8_t>(need);
    return true;
  }

  void Release(uint32_t id) { ++cached_[block_log2_[id]]; }

 private:
  uint64_t budget_bytes_;
  uint64_t carved_bytes_ = 0;
  uint64_t cached_[64] = {};  // cached blocks per log2 size
  std::vector<int8_t> block_log2_;
};

struct Outcome {
  double utilization = 1.0;  // at the first failure
  uint32_t requests = 0;     // reserves served before the first failure
  uint64_t extents = 0;      // extents handed out for those reserves
};

Outcome ReplayPow2(const Trace& trace) {
  Pow2CachingModel model(trace.capacity_bytes, trace.reserve_count);
  std::vector<uint64_t> sizes(trace.reserve_count, 0);
  uint64_t live_bytes = 0;
  Outcome out;
  for (const TraceEvent& ev : trace.events) {
    if (ev.kind == TraceEvent::Kind::kRelease) {
      model.Release(ev.id);
      live_bytes -= sizes[ev.id];
      continue;
    }
    if (!model.Reserve(ev.id, ev.bytes)) break;
    sizes[ev.id] = ev.bytes;
    live_bytes += ev.bytes;
    ++out.requests;
  }
  out.utilization = static_cast<double>(live_bytes) / trace.capacity_bytes;
  return out;
}

// How ReplayOurs places requests.
struct Placement {
  // Each trace tenant (rank) is a tenant of the daemon's default mode: it
  // may use only the chunks it owns (Allocate with allowed_chunks) and, when
  // a request does not fit, takes over a wholly free chunk it does not own
  // (never-used chunks first) and retries, as SessionTable::TryReserve does.
  // It passes its chunks as an ascending list (AllocateIn), as SessionTable
  // keeps them; with `bitmap`, as SessionTable did before, it builds a
  // vector<bool> over every chunk per request (timed) and calls Allocate.
  bool restricted = false;
  bool single_extent = false;
  bool bitmap = false;
};

// Replays `trace` into a fresh ExtentAllocator up to the first failure, then
// frees what is still live. Appends one alloc+free latency per served reserve
// when `latencies_ns` is non-null; a restricted sample includes the retries
// after taking over a chunk, not the takeover's own search.
Outcome ReplayOurs(const Trace& trace, Placement placement, std::vector<uint64_t>* latencies_ns) {
  const uint32_t chunks = static_cast<uint32_t>(trace.capacity_bytes / trace.chunk_bytes);
  ExtentAllocator alloc(std::vector<uint64_t>(chunks, trace.chunk_bytes), trace.page_bytes);
  std::vector<std::vector<Extent>> extents(trace.reserve_count);
  std::vector<uint64_t> sizes(trace.reserve_count, 0);
  std::vector<uint64_t> alloc_ns(trace.reserve_count, 0);
  // Restricted placement: owner of each chunk (-1 never used) and the list
  // of chunks each tenant owns (passed to AllocateIn), kept up to date as
  // chunks change hands.
  std::vector<int> owner(chunks, -1);
  std::vector<std::vector<uint32_t>> owned(kTraceTenants);
  auto take_over = [&](uint32_t tenant) {
    int64_t reused = -1;
    for (uint32_t c = 0; c < chunks; ++c) {
      if (owner[c] == static_cast<int>(tenant) || alloc.chunk_free_bytes(c) != trace.chunk_bytes) {
        continue;
      }
      if (owner[c] < 0) {
        reused = c;
        break;
      }
      if (reused < 0) reused = c;
    }
    if (reused < 0) return false;
    if (owner[reused] >= 0) {
      std::vector<uint32_t>& list = owned[owner[reused]];
      list.erase(std::find(list.begin(), list.end(), static_cast<uint32_t>(reused)));
    }
    owner[reused] = static_cast<int>(tenant);
    std::vector<uint32_t>& list = owned[tenant];
    list.insert(std::upper_bound(list.begin(), list.end(), static_cast<uint32_t>(reused)),
                static_cast<uint32_t>(reused));
    return true;
  };
  uint64_t live_bytes = 0;
  Outcome out;
  auto release = [&](uint32_t id) {
    const Clock::time_point start = Clock::now();
    for (const Extent& e : extents[id]) {
      if (!alloc.Free(e).ok()) std::abort();
    }
    const Clock::time_point end = Clock::now();
    if (latencies_ns != nullptr) latencies_ns->push_back(alloc_ns[id] + (end - start).count());
    live_bytes -= sizes[id];
    extents[id].clear();
  };
  for (const TraceEvent& ev : trace.events) {
    if (ev.kind == TraceEvent::Kind::kRelease) {
      release(ev.id);
      continue;
    }
    uint64_t ns = 0;
    Result<std::vector<Extent>> r = ResourceExhausted("not tried");
    while (true) {
      const Clock::time_point start = Clock::now();
      if (!placement.restricted) {
        r = alloc.Allocate(ev.bytes, placement.single_extent);
      } else if (placement.bitmap) {
        std::vector<bool> allowed(chunks);
        for (uint32_t c = 0; c < chunks; ++c) allowed[c] = owner[c] == static_cast<int>(ev.tenant);
        r = alloc.Allocate(ev.bytes, placement.single_extent, &allowed);
      } else {
        r = alloc.AllocateIn(ev.bytes, placement.single_extent, owned[ev.tenant]);
      }
      ns += (Clock::now() - start).count();
      if (r.ok() || !placement.restricted || !take_over(ev.tenant)) break;
    }
    if (!r.ok()) break;
    alloc_ns[ev.id] = ns;
    extents[ev.id] = std::move(*r);
    sizes[ev.id] = ev.bytes;
    live_bytes += ev.bytes;
    out.extents += extents[ev.id].size();
    ++out.requests;
  }
  out.utilization = static_cast<double>(live_bytes) / trace.capacity_bytes;
  for (uint32_t id = 0; id < trace.reserve_count; ++id) {
    if (!extents[id].empty()) release(id);
  }
  return out;
}

struct Report {
  std::string trace;
  bool restricted = false;
  double capacity_gib = 0;
  Outcome ours;
  Outcome single;  // ours with single_extent
  Outcome pow2;
  uint64_t p50_ns = 0;
  uint64_t p99_ns = 0;
  // Restricted only: the same replay through the old vector<bool> path.
  Outcome bitmap;
  uint64_t bitmap_p50_ns = 0;
  uint64_t bitmap_p99_ns = 0;
};

// Replays until at least `min_samples` latencies; returns the first replay's
// outcome and the p50/p99.
Outcome Timed(const Trace& trace, Placement placement, size_t min_samples, uint64_t* p50_ns,
              uint64_t* p99_ns) {
  std::vector<uint64_t> latencies;
  const Outcome first = ReplayOurs(trace, placement, &latencies);
  while (latencies.size() < min_samples) ReplayOurs(trace, placement, &latencies);
  std::sort(latencies.begin(), latencies.end());
  *p50_ns = latencies[latencies.size() / 2];
  *p99_ns = latencies[latencies.size() * 99 / 100];
  return first;
}

Report Measure(const Trace& trace, bool restricted, const Outcome& pow2,
               size_t min_latency_samples) {
  Report report;
  report.trace = trace.name;
  report.restricted = restricted;
  report.capacity_gib = static_cast<double>(trace.capacity_bytes) / (1 << 30);
  report.pow2 = pow2;
  report.single = ReplayOurs(trace, Placement{restricted, true, false}, nullptr);
  report.ours = Timed(trace, Placement{restricted, false, false}, min_latency_samples,
                      &report.p50_ns, &report.p99_ns);
  if (restricted) {
    report.bitmap = Timed(trace, Placement{true, false, true}, min_latency_samples,
                          &report.bitmap_p50_ns, &report.bitmap_p99_ns);
  }
  return report;
}

void PrintUsage() {
  std::fprintf(stderr,
               "usage: memoffload-bench allocator [--json] [--seed N] [--samples N]\n"
               "Replays activation traces (llama-7b, llama-70b-tp8, random) "
               "and reports the\narena utilisation at the first failed "
               "request for our allocator and for a\npower-of-two caching "
               "model, plus alloc+free latency percentiles (at least\n--samples "
               "alloc+free pairs, default 200000). Each trace runs twice: "
               "unrestricted,\nand restricted (8 tenants, each allocating only in "
               "the chunks it owns; also\nthrough the old vector<bool> path). Then "
               "Reserve+Release through SessionTable,\nrestricted vs unrestricted "
               "(latency and utilisation).\n");
}

bool ParseCount(const char* flag, const char* text, uint64_t* out) {
  char* end = nullptr;
  *out = std::strtoull(text, &end, 10);
  if (end == text || *end != '\0') {
    std::fprintf(stderr, "allocator: %s wants a number, got '%s'\n", flag, text);
    return false;
  }
  return true;
}

void Print(const Report& r, bool json) {
  const double extents_per_request = static_cast<double>(r.ours.extents) / r.ours.requests;
  const double bitmap_p50_ratio =
      static_cast<double>(r.p50_ns) / std::max<uint64_t>(1, r.bitmap_p50_ns);
  const double bitmap_p99_ratio =
      static_cast<double>(r.p99_ns) / std::max<uint64_t>(1, r.bitmap_p99_ns);
  if (json) {
    char bitmap[256] = "";
    if (r.restricted) {
      std::snprintf(bitmap, sizeof(bitmap),
                    ",\"bitmap_utilization\":%.4f,\"bitmap_alloc_free_p50_ns\":%llu,"
                    "\"bitmap_alloc_free_p99_ns\":%llu,\"bitmap_p50_ratio\":%.3f,"
                    "\"bitmap_p99_ratio\":%.3f",
                    r.bitmap.utilization, static_cast<unsigned long long>(r.bitmap_p50_ns),
                    static_cast<unsigned long long>(r.bitmap_p99_ns), bitmap_p50_ratio,
                    bitmap_p99_ratio);
    }
    std::printf(
        "{\"bench\":\"allocator\",\"trace\":\"%s\",\"restricted\":%s,\"tenants\":%u,"
        "\"utilization\":%.4f,\"pow2_utilization\":%.4f,\"single_extent_utilization\":%.4f,"
        "\"alloc_free_p50_ns\":%llu,\"alloc_free_p99_ns\":%llu,\"requests\":%u,"
        "\"extents_per_request\":%.4f%s}\n",
        r.trace.c_str(), r.restricted ? "true" : "false", r.restricted ? kTraceTenants : 1,
        r.ours.utilization, r.pow2.utilization, r.single.utilization,
        static_cast<unsigned long long>(r.p50_ns), static_cast<unsigned long long>(r.p99_ns),
        r.ours.requests, extents_per_request, bitmap);
  } else {
    std::printf("%-14s %-10s %5.0fGiB %9u %8.4f %8.4f %8.4f %7.2fx %11.2f %8llu %8llu\n",
                r.trace.c_str(), r.restricted ? "8 tenants" : "-", r.capacity_gib, r.ours.requests,
                r.ours.utilization, r.single.utilization, r.pow2.utilization,
                r.ours.utilization / r.pow2.utilization, extents_per_request,
                static_cast<unsigned long long>(r.p50_ns),
                static_cast<unsigned long long>(r.p99_ns));
    if (r.restricted) {
      std::printf(
          "%-14s %-10s %8s %9u %8.4f %8s %8s %8s %11s %8llu %8llu  (p99 list/bitmap %.2fx)\n", "",
          " bitmap", "", r.bitmap.requests, r.bitmap.utilization, "", "", "", "",
          static_cast<unsigned long long>(r.bitmap_p50_ns),
          static_cast<unsigned long long>(r.bitmap_p99_ns), bitmap_p99_ratio);
    }
  }
  std::fflush(stdout);
}

}  // namespace

int RunAllocatorBench(int argc, char** argv) {
  bool json = false;
  uint64_t seed = 1;
  uint64_t samples = kMinLatencySamples;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      if (!ParseCount("--seed", argv[++i], &seed)) return 2;
    } else if (std::strcmp(argv[i], "--samples") == 0 && i + 1 < argc) {
      if (!ParseCount("--samples", argv[++i], &samples)) return 2;
    } else if (std::strcmp(argv[i], "--help") == 0) {
      PrintUsage();
      return 0;
    } else {
      std::fprintf(stderr, "allocator: unknown flag '%s'\n", argv[i]);
      PrintUsage();
      return 2;
    }
  }
  if (!json) {
    std::printf("%-14s %-10s %8s %9s %8s %8s %8s %8s %10s %8s %8s\n", "trace", "tenants",
                "capacity", "requests", "ours", "single", "pow2", "ratio", "extents/req", "p50 ns",
                "p99 ns");
  }
  for (const Trace& trace : MakeAllTraces(seed)) {
    const Outcome pow2 = ReplayPow2(trace);
    for (bool restricted : {false, true}) Print(Measure(trace, restricted, pow2, samples), json);
  }
  return PrintReservePathBench(json, seed, samples);
}

}  // namespace memoffload::bench
