// The Reserve path through SessionTable, tenant-restricted vs unrestricted
// (part of `memoffload-bench allocator`; the ≤ 1 µs target of
// docs/DECISIONS "Request path" is measured here, not on AllocateIn alone).
//
// Two session tables over two real (memfd, pre-faulted) arenas of 32 chunks
// of 4 MiB, each with 8 sessions of 8 uids: one with TenantMode::kUid (each
// uid a tenant allocating only in the chunks it owns, claiming empty ones),
// the baseline with TenantMode::kNone (every chunk shared). Both replay the
// same seeded workload (log-uniform sizes from 16 KiB to 1 MiB, random
// sessions) through ReserveAsync (answered inline, as the service calls it)
// and Release:
//  - utilisation: from empty, before each reserve a live group is released
//    with probability 0.3; live requested bytes / capacity at the first
//    RESOURCE_EXHAUSTED, averaged over kFillRounds rounds;
//  - latency: the arena kept between 50% and 75% full; one sample is the
//    time of a Reserve plus the later Release of its group. The two tables
//    take turns in kLatencyTurns turns so machine noise hits both alike.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_arena.h"
#include "benches.h"
#include "core/session_table.h"
#include "memoffload/common/units.h"
#include "memory/fresh_backing.h"

namespace memoffload::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kChunkBytes = 4 * kMiB;
constexpr uint32_t kChunks = 32;
constexpr uint32_t kSessions = 8;
constexpr uint64_t kMinBytes = 16 * kKiB;
constexpr uint64_t kMaxBytes = kMiB;
constexpr int kFillRounds = 8;
constexpr int kLatencyTurns = 8;

struct Live {
  uint32_t session = 0;
  uint64_t group = 0;
  uint64_t bytes = 0;
  uint64_t reserve_ns = 0;
};

// One session table over its own arena, and what its sessions hold.
class Table {
 public:
  static std::unique_ptr<Table> Make(daemon::TenantMode mode) {
    std::unique_ptr<daemon::Arena> arena = BuildBenchArena("allocator", kChunkBytes, kChunks);
    if (arena == nullptr) return nullptr;
    auto t = std::unique_ptr<Table>(new Table);
    t->arena_ = std::move(arena);
    // New memfds for chunks that change tenant, as the daemon makes them
    // (Daemon::Serve): one spare kept pre-faulted by a background thread.
    daemon::FreshBackingOptions fresh;
    fresh.chunk_size_bytes = kChunkBytes;
    fresh.spares = mode == daemon::TenantMode::kNone ? 0 : 1;
    t->fresh_ = std::make_unique<daemon::FreshBacking>(fresh);
    t->table_ = std::make_unique<daemon::SessionTable>(t->arena_.get(), daemon::Policy{}, mode,
                                                       t->fresh_.get());
    for (uint32_t s = 0; s < kSessions; ++s) {
      Hello hello;
      hello.job_id = "bench";
      auto grant = t->table_->Open(hello, daemon::PeerCredentials{1234, 1000 + s, 1000 + s});
      if (!grant.ok()) {
        std::fprintf(stderr, "allocator: open: %s\n", grant.status().ToString().c_str());
        return nullptr;
      }
      t->sessions_.push_back(std::move(grant).value());
    }
    return t;
  }

  uint64_t capacity_bytes() const { return arena_->capacity_bytes(); }
  uint64_t live_bytes() const { return live_bytes_; }
  bool empty() const { return live_.empty(); }

  // Reserves `bytes` for `session`; false on RESOURCE_EXHAUSTED (any other
  // failure aborts: the workload never asks for anything invalid).
  bool Reserve(uint32_t session, uint64_t bytes) {
    const daemon::SessionGrant& g = sessions_[session];
    const uint64_t group = next_group_++;
    bool ok = false;
    StatusCode code = StatusCode::kOk;
    const Clock::time_point start = Clock::now();
    table_->ReserveAsync(g.session_id, g.token, group, bytes, false, std::nullopt,
                         [&](Result<daemon::ReserveResult> r, daemon::RejectReason) {
                           ok = r.ok();
                           code = r.status().code();
                         });
    const uint64_t ns = (Clock::now() - start).count();
    if (!ok && code != StatusCode::kResourceExhausted) std::abort();
    if (ok) {
      live_.push_back(Live{session, group, bytes, ns});
      live_bytes_ += bytes;
    }
    return ok;
  }

  // Releases live group `k`; appends its reserve + release time.
  void Release(size_t k, std::vector<uint64_t>* latencies_ns) {
    const Live l = live_[k];
    live_[k] = live_.back();
    live_.pop_back();
    live_bytes_ -= l.bytes;
    const daemon::SessionGrant& g = sessions_[l.session];
    const Clock::time_point start = Clock::now();
    const bool ok = table_->Release(g.session_id, g.token, l.group).ok();
    const uint64_t ns = (Clock::now() - start).count();
    if (!ok) std::abort();
    if (latencies_ns != nullptr) latencies_ns->push_back(l.reserve_ns + ns);
  }
  size_t live_count() const { return live_.size(); }

  void ReleaseAll() {
    while (!live_.empty()) Release(live_.size() - 1, nullptr);
  }
  uint64_t claims() const { return table_->Snapshot().replaced_backings; }
  bool Healthy() const { return table_->CheckInvariants().ok(); }

 private:
  Table() = default;
  std::unique_ptr<daemon::Arena> arena_;
  std::unique_ptr<daemon::FreshBacking> fresh_;
  std::unique_ptr<daemon::SessionTable> table_;
  std::vector<daemon::SessionGrant> sessions_;
  std::vector<Live> live_;
  uint64_t live_bytes_ = 0;
  uint64_t next_group_ = 1;
};

uint64_t RandomBytes(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> log_size(std::log(static_cast<double>(kMinBytes)),
                                                  std::log(static_cast<double>(kMaxBytes)));
  return static_cast<uint64_t>(std::exp(log_size(rng)));
}

// Mean live/capacity at the first RESOURCE_EXHAUSTED over kFillRounds.
double Utilization(Table& t, uint64_t seed) {
  double sum = 0;
  for (int round = 0; round < kFillRounds; ++round) {
    std::mt19937_64 rng(seed * 1000 + round);
    std::uniform_real_distribution<double> coin(0, 1);
    while (true) {
      if (t.live_count() > 0 && coin(rng) < 0.3) {
        t.Release(std::uniform_int_distribution<size_t>(0, t.live_count() - 1)(rng), nullptr);
      }
      const uint32_t session = std::uniform_int_distribution<uint32_t>(0, kSessions - 1)(rng);
      if (!t.Reserve(session, RandomBytes(rng))) break;
    }
    sum += static_cast<double>(t.live_bytes()) / t.capacity_bytes();
    t.ReleaseAll();
  }
  return sum / kFillRounds;
}

// Runs the steady-state workload until `samples` more alloc+free pairs were
// timed; counts reserves refused for lack of room.
void Steady(Table& t, std::mt19937_64& rng, size_t samples, std::vector<uint64_t>* latencies,
            uint64_t* refused) {
  std::uniform_real_distribution<double> coin(0, 1);
  const uint64_t low = t.capacity_bytes() / 2, high = t.capacity_bytes() * 3 / 4;
  const size_t target = latencies->size() + samples;
  while (latencies->size() < target) {
    if (t.live_count() == 0 || t.live_bytes() < low || (t.live_bytes() < high && coin(rng) < 0.5)) {
      const uint32_t session = std::uniform_int_distribution<uint32_t>(0, kSessions - 1)(rng);
      if (t.Reserve(session, RandomBytes(rng))) continue;
      ++*refused;  // no room for it: release something instead
    }
    t.Release(std::uniform_int_distribution<size_t>(0, t.live_count() - 1)(rng), latencies);
  }
}

struct Percentiles {
  uint64_t p50 = 0;
  uint64_t p99 = 0;
};
Percentiles Of(std::vector<uint64_t> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v[v.size() * 99 / 100]};
}

// What one Clock::now() costs on this machine (a VM's clock read can be
// ~100 ns): each sample holds about two of them (the reads that close the
// Reserve's and the Release's intervals), so the harness's share of a
// sample is about twice this.
uint64_t ClockReadNs() {
  constexpr int kReads = 200000;
  const Clock::time_point start = Clock::now();
  Clock::time_point last = start;
  for (int i = 0; i < kReads; ++i) last = Clock::now();
  return static_cast<uint64_t>((last - start).count()) / kReads;
}

}  // namespace

int PrintReservePathBench(bool json, uint64_t seed, uint64_t samples) {
  std::unique_ptr<Table> restricted = Table::Make(daemon::TenantMode::kUid);
  std::unique_ptr<Table> shared = Table::Make(daemon::TenantMode::kNone);
  if (restricted == nullptr || shared == nullptr) return 1;
  const double restricted_util = Utilization(*restricted, seed);
  const double shared_util = Utilization(*shared, seed);
  std::vector<uint64_t> restricted_ns, shared_ns;
  uint64_t restricted_refused = 0, shared_refused = 0;
  const uint64_t claims_before = restricted->claims();
  std::mt19937_64 restricted_rng(seed), shared_rng(seed);
  const size_t per_turn = std::max<size_t>(1, samples / kLatencyTurns);
  for (int turn = 0; turn < kLatencyTurns; ++turn) {
    Steady(*restricted, restricted_rng, per_turn, &restricted_ns, &restricted_refused);
    Steady(*shared, shared_rng, per_turn, &shared_ns, &shared_refused);
  }
  const uint64_t claims = restricted->claims() - claims_before;
  if (!restricted->Healthy() || !shared->Healthy()) {
    std::fprintf(stderr, "allocator: reserve path: session table invariants broken\n");
    return 1;
  }
  const Percentiles r = Of(restricted_ns), u = Of(shared_ns);
  const uint64_t clock_read_ns = ClockReadNs();
  const double p50_ratio = static_cast<double>(r.p50) / u.p50;
  const double p99_ratio = static_cast<double>(r.p99) / u.p99;
  if (json) {
    std::printf(
        "{\"bench\":\"reserve_path\",\"arena_bytes\":%llu,\"chunks\":%u,\"tenants\":%u,"
        "\"samples\":%zu,\"restricted_p50_ns\":%llu,\"restricted_p99_ns\":%llu,"
        "\"unrestricted_p50_ns\":%llu,\"unrestricted_p99_ns\":%llu,\"p50_ratio\":%.3f,"
        "\"p99_ratio\":%.3f,\"p99_target_ns\":1000,\"restricted_utilization\":%.4f,"
        "\"unrestricted_utilization\":%.4f,\"utilization_ratio\":%.4f,"
        "\"restricted_refused\":%llu,\"unrestricted_refused\":%llu,\"chunk_claims\":%llu,"
        "\"clock_read_ns\":%llu}\n",
        static_cast<unsigned long long>(restricted->capacity_bytes()), kChunks, kSessions,
        restricted_ns.size(), static_cast<unsigned long long>(r.p50),
        static_cast<unsigned long long>(r.p99), static_cast<unsigned long long>(u.p50),
        static_cast<unsigned long long>(u.p99), p50_ratio, p99_ratio, restricted_util, shared_util,
        restricted_util / shared_util, static_cast<unsigned long long>(restricted_refused),
        static_cast<unsigned long long>(shared_refused), static_cast<unsigned long long>(claims),
        static_cast<unsigned long long>(clock_read_ns));
  } else {
    std::printf(
        "\nReserve+Release through SessionTable (%u x %s chunks, %u tenants, %zu samples):\n"
        "%-24s %8s %8s %12s %8s\n"
        "%-24s %8llu %8llu %12.4f %8llu\n"
        "%-24s %8llu %8llu %12.4f %8llu\n"
        "%-24s %7.2fx %7.2fx %11.4fx   (p99 target 1000 ns; %llu chunk claims)\n"
        "(one clock read costs %llu ns here; a sample holds about two)\n",
        kChunks, FormatSize(kChunkBytes).c_str(), kSessions, restricted_ns.size(), "path", "p50 ns",
        "p99 ns", "utilization", "refused", "restricted (uid tenants)",
        static_cast<unsigned long long>(r.p50), static_cast<unsigned long long>(r.p99),
        restricted_util, static_cast<unsigned long long>(restricted_refused), "unrestricted (none)",
        static_cast<unsigned long long>(u.p50), static_cast<unsigned long long>(u.p99), shared_util,
        static_cast<unsigned long long>(shared_refused), "ratio", p50_ratio, p99_ratio,
        restricted_util / shared_util, static_cast<unsigned long long>(claims),
        static_cast<unsigned long long>(clock_read_ns));
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace memoffload::bench
