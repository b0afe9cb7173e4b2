// memoffload-bench load-worker: one client process of `memoffload-bench load`
// (load_bench.cc explains the traffic).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "benches.h"
#include "grpc_floor.h"
#include "latency_stats.h"
#include "load_options.h"
#include "memoffload/client/client.h"
#include "memoffload/common/units.h"

namespace memoffload::bench {
namespace {

struct Held {
  uint64_t group_id;
  uint64_t bytes;
};

int RunWorker(const LoadOptions& o) {
  if (!o.floor_socket.empty()) return RunGrpcFloorWorker(o);
  client::AttachOptions attach;
  attach.runtime_dir = o.runtime_dir;
  attach.job_id = o.job_id;
  attach.rank = o.index;
  attach.local_rank = o.index;
  attach.max_bytes = o.max_bytes;
  attach.populate = o.warm;  // the chunks its tenant owns, mapped and populated at attach
  auto attached = client::Client::Attach(attach);
  if (!attached.ok()) {
    std::fprintf(stderr, "load-worker %d: attach failed: %s\n", o.index,
                 attached.status().ToString().c_str());
    return 1;
  }
  client::Client& c = **attached;

  WorkerData data(o);
  std::vector<uint8_t> readback(o.max_group);

  // One untimed cycle first: attaching and mapping the first chunk are not
  // request-path costs (memoffload-bench attach measures them), and the
  // floor's clients have nothing like them.
  {
    constexpr uint64_t kWarmupGroup = uint64_t{1} << 62;
    const uint64_t bytes = o.min_group;
    Result<client::Reservation> r = c.Reserve(kWarmupGroup, bytes);
    if (r.ok()) {
      Status st = c.Write(r->extents, 0, data.BytesOf(0), bytes);
      if (st.ok()) st = c.Commit(kWarmupGroup, bytes).status();
      if (st.ok()) st = c.Prefetch(kWarmupGroup).status();
      const Status released = c.Release(kWarmupGroup);
      if (!st.ok() || !released.ok()) {
        std::fprintf(stderr, "load-worker %d: warm-up cycle failed: %s\n", o.index,
                     (st.ok() ? released : st).ToString().c_str());
        return 1;
      }
    } else if (r.status().code() != StatusCode::kResourceExhausted) {
      std::fprintf(stderr, "load-worker %d: warm-up reserve failed: %s\n", o.index,
                   r.status().ToString().c_str());
      return 1;
    }
  }
  std::printf("READY\n");
  std::fflush(stdout);
  char go = 0;
  if (read(STDIN_FILENO, &go, 1) != 1) return 1;  // the parent gave up

  MethodStats stats[kMethods];
  uint64_t offloaded_bytes = 0, verify_failures = 0, cycles = 0, write_errors = 0;
  std::vector<std::string> messages;
  auto note = [&](const char* what, const Status& st) {
    if (messages.size() < 5) messages.push_back(std::string(what) + ": " + st.ToString());
  };
  auto count_error = [&](MethodIndex m, const Status& st) {
    if (st.code() == StatusCode::kResourceExhausted) {
      ++stats[m].rejected;
    } else {
      ++stats[m].errors;
      note(kMethodNames[m], st);
    }
  };
  std::deque<Held> held;
  double copy_seconds = 0;  // CPU in Write, Read and the verify, timed window only

  // Prefetch, read and verify, Release the oldest held group.
  auto read_back = [&](bool timed) {
    const Held h = held.front();
    held.pop_front();
    auto t0 = Clock::now();
    Result<client::Placement> p = c.Prefetch(h.group_id);
    auto t1 = Clock::now();
    if (timed) stats[kPrefetch].Record(t1 - t0);
    client::CopyStats copy;
    if (!p.ok()) {
      count_error(kPrefetch, p.status());
    } else {
      ++stats[kPrefetch].ops;
      // With --no-copies only the size is checked: nothing was written.
      Status st = p->used_bytes == h.bytes
                      ? Status::Ok()
                      : InvalidArgument("prefetch says " + std::to_string(p->used_bytes) +
                                        " bytes, committed " + std::to_string(h.bytes));
      if (st.ok() && !o.no_copies) {
        const double c0 = ThreadCpuSeconds();
        const auto r0 = Clock::now();
        st = c.Read(p->extents, 0, readback.data(), h.bytes);
        copy = {h.bytes, std::chrono::duration<double>(Clock::now() - r0).count()};
        if (st.ok() && std::memcmp(readback.data(), data.BytesOf(h.group_id), h.bytes) != 0) {
          st = Internal("group " + std::to_string(h.group_id) + " read back different bytes");
        }
        if (timed) copy_seconds += ThreadCpuSeconds() - c0;
      }
      if (!st.ok()) {
        ++verify_failures;
        note("verify", st);
      }
    }
    t0 = Clock::now();
    Status st = c.Release(h.group_id, copy);
    t1 = Clock::now();
    if (timed) stats[kRelease].Record(t1 - t0);
    // Ops and latency only count within the timed window; a failed Release
    // is an error wherever it happens (the final drain included).
    if (!st.ok()) {
      count_error(kRelease, st);
    } else if (timed) {
      ++stats[kRelease].ops;
    }
  };

  const CpuTime cpu0 = SelfCpu();
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.seconds));
  uint64_t next_group = 1;
  while (Clock::now() < deadline) {
    const uint64_t g = next_group++;
    const uint64_t bytes = data.NextSize();
    auto t0 = Clock::now();
    Result<client::Reservation> r = c.Reserve(g, bytes);
    stats[kReserve].Record(Clock::now() - t0);
    if (!r.ok()) {
      count_error(kReserve, r.status());
      // Make room (the session limit was reached) and go on.
      if (!held.empty()) read_back(true);
      continue;
    }
    ++stats[kReserve].ops;
    Status st;
    client::CopyStats copy;
    if (!o.no_copies) {
      const double c0 = ThreadCpuSeconds();
      const auto w0 = Clock::now();
      st = c.Write(r->extents, 0, data.BytesOf(g), bytes);
      copy = {bytes, std::chrono::duration<double>(Clock::now() - w0).count()};
      copy_seconds += ThreadCpuSeconds() - c0;
    }
    if (!st.ok()) {
      ++write_errors;  // the client's copy into the arena, not an RPC
      note("write", st);
    }
    t0 = Clock::now();
    Result<client::CommitInfo> ci = c.Commit(g, bytes, copy);
    stats[kCommit].Record(Clock::now() - t0);
    if (!ci.ok() || !st.ok()) {
      if (!ci.ok()) count_error(kCommit, ci.status());
      if (ci.ok()) ++stats[kCommit].ops;
      if (Status released = c.Release(g); !released.ok()) count_error(kRelease, released);
      continue;
    }
    ++stats[kCommit].ops;
    offloaded_bytes += bytes;
    held.push_back({g, bytes});
    if (static_cast<int>(held.size()) >= o.window) read_back(true);
    ++cycles;
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  CpuTime cpu = SelfCpu() - cpu0;
  cpu.copy = copy_seconds;
  if (!WaitForEveryWindowToEnd()) return 1;  // the parent gave up
  while (!held.empty()) read_back(false);

  for (int m = 0; m < kMethods; ++m) PrintMethodStats(m, stats[m]);
  PrintCpu(cpu);
  std::printf("S %lu %lu %lu %.6f %lu\n", static_cast<unsigned long>(offloaded_bytes),
              static_cast<unsigned long>(verify_failures), static_cast<unsigned long>(cycles),
              elapsed, static_cast<unsigned long>(write_errors));
  for (const std::string& m : messages) std::printf("E %s\n", m.c_str());
  std::printf("END\n");
  StayUntilTheParentCloses();
  return 0;
}

// ---- parent ---------------------------------------------------------------

}  // namespace

int RunLoadWorker(int argc, char** argv) {
  LoadOptions o;
  std::string error;
  if (!ParseFlags(argc, argv, &o, &error)) return Usage(error.c_str());
  return RunWorker(o);
}

}  // namespace memoffload::bench
