// memoffload-bench zeroing: the cost of handing a chunk to another tenant.
// Drives the daemon's own SessionTable (with its FreshBacking) over a real
// (memfd, pre-faulted) arena: two tenants (uids) take turns filling every
// chunk, so every chunk changes tenant each round and gets a new memfd in
// SessionTable::Claim. Timed: each Reserve that changes tenant (what the
// session table lock is held for), per chunk. Next to it, in the same run, a
// memset of a private, pre-faulted buffer of the chunk size: what zeroing in
// place under the lock (the old way) cost at best. Reported: the median
// round per chunk (a round where the CPU was taken away from the bench, as
// on a loaded machine, would dominate a mean), the worst round, and how many
// changes found no pre-faulted spare (their backing is made inline, then
// faulted by the FreshBacking thread).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench_arena.h"
#include "benches.h"
#include "core/session_table.h"
#include "memoffload/common/units.h"

namespace memoffload::bench {
namespace {

using Clock = std::chrono::steady_clock;

int Usage() {
  std::fprintf(stderr,
               "usage: memoffload-bench zeroing [--chunk-size SIZE] [--chunks N] [--rounds N] "
               "[--json]\n");
  return 2;
}

}  // namespace

int RunZeroingBench(int argc, char** argv) {
  bool json = false;
  uint64_t chunk_bytes = 256ull << 20;
  uint64_t chunks = 4;
  int rounds = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json") {
      json = true;
    } else if (arg == "--chunk-size" && i + 1 < argc) {
      Result<uint64_t> v = ParseSize(argv[++i]);
      if (!v.ok() || *v == 0) return Usage();
      chunk_bytes = *v;
    } else if (arg == "--chunks" && i + 1 < argc) {
      chunks = std::stoull(argv[++i]);
    } else if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::stoi(argv[++i]);
    } else {
      return Usage();
    }
  }
  if (chunks == 0 || rounds <= 0) return Usage();

  std::unique_ptr<daemon::Arena> arena = BuildBenchArena("zeroing", chunk_bytes, chunks);
  if (arena == nullptr) return 1;
  daemon::FreshBackingOptions fresh_options;
  fresh_options.chunk_size_bytes = chunk_bytes;
  daemon::FreshBacking fresh(fresh_options);
  daemon::SessionTable table(arena.get(), daemon::Policy{}, daemon::TenantMode::kUid, &fresh);
  std::vector<double> round_seconds;  // per chunk, rounds 1..N

  // Round r: tenant (uid 1000 + r % 2) reserves the whole arena, then
  // releases it and goes away. From round 1 on, every chunk changes tenant.
  for (int r = 0; r <= rounds; ++r) {
    Hello hello;
    hello.job_id = "zeroing-bench";
    const uid_t uid = 1000 + r % 2;
    auto s = table.Open(hello, daemon::PeerCredentials{1, uid, uid});
    if (!s.ok()) {
      std::fprintf(stderr, "open: %s\n", s.status().ToString().c_str());
      return 1;
    }
    const auto start = Clock::now();
    auto g = table.Reserve(s->session_id, s->token, 1, chunk_bytes * chunks, false);
    if (r > 0) {
      round_seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count() /
                              static_cast<double>(chunks));
    }
    if (!g.ok()) {
      std::fprintf(stderr, "reserve: %s\n", g.status().ToString().c_str());
      return 1;
    }
    if (auto closed = table.Close(s->session_id, daemon::CloseReason::kLifelineClosed);
        !closed.ok()) {
      std::fprintf(stderr, "close: %s\n", closed.status().ToString().c_str());
      return 1;
    }
  }
  const daemon::ArenaSnapshot snap = table.Snapshot();
  if (snap.replaced_backings != chunks * rounds) {
    std::fprintf(stderr, "expected %llu new backings, the table counted %llu\n",
                 static_cast<unsigned long long>(chunks * rounds),
                 static_cast<unsigned long long>(snap.replaced_backings));
    return 1;
  }

  std::vector<uint8_t> buffer(chunk_bytes);
  std::memset(buffer.data(), 1, chunk_bytes);  // fault it in before timing
  double memset_seconds = 0;
  for (uint64_t i = 0; i < snap.replaced_backings; ++i) {
    buffer[i % chunk_bytes] = 1;
    const auto start = Clock::now();
    std::memset(buffer.data(), 0, chunk_bytes);
    memset_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (buffer[chunk_bytes / 2] != 0) return 1;  // keep the memset
  }
  const double n = static_cast<double>(snap.replaced_backings);
  std::sort(round_seconds.begin(), round_seconds.end());
  const double zero_per_chunk = round_seconds[round_seconds.size() / 2];
  const double worst_per_chunk = round_seconds.back();
  const double memset_per_chunk = memset_seconds / n;
  const double ratio = zero_per_chunk / memset_per_chunk;
  const auto unfaulted = static_cast<unsigned long long>(snap.unfaulted_backings);
  if (json) {
    std::printf(
        "{\"bench\":\"zeroing\",\"chunk_bytes\":%llu,\"chunks_replaced\":%llu,"
        "\"tenant_change_seconds_per_chunk\":%.6f,\"tenant_change_worst_round_seconds\":%.6f,"
        "\"without_spare\":%llu,\"memset_seconds_per_chunk\":%.6f,"
        "\"tenant_change_gbps\":%.2f,\"memset_gbps\":%.2f,\"ratio\":%.3f}\n",
        static_cast<unsigned long long>(chunk_bytes),
        static_cast<unsigned long long>(snap.replaced_backings), zero_per_chunk, worst_per_chunk,
        unfaulted, memset_per_chunk, chunk_bytes / zero_per_chunk / 1e9,
        chunk_bytes / memset_per_chunk / 1e9, ratio);
  } else {
    std::printf(
        "a %s chunk changing tenant (fresh backing, under the table lock): %.3f ms median round "
        "(worst %.3f ms; %llu of %llu changes without a ready spare); memset of a private buffer "
        "of the same size: %.1f ms (%.2f GB/s); ratio %.4f\n",
        FormatSize(chunk_bytes).c_str(), zero_per_chunk * 1e3, worst_per_chunk * 1e3, unfaulted,
        static_cast<unsigned long long>(snap.replaced_backings), memset_per_chunk * 1e3,
        chunk_bytes / memset_per_chunk / 1e9, ratio);
  }
  return 0;
}

}  // namespace memoffload::bench
