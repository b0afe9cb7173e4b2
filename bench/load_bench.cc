// memoffload-bench load --runtime-dir DIR --clients N --seconds S [--json]
//     [--max-bytes B] [--min-group B] [--max-group B] [--window N]
//     [--job-id ID] [--seed N] [--baseline]
//
// A traffic generator against a running memoffloadd. Starts N client
// processes (fork + exec of this binary with the hidden `load-worker`
// subcommand, so no gRPC state crosses a fork). Each attaches as rank i of
// job ID, waits until all have attached, then for S seconds runs cycles of
// Reserve / write / Commit, and, WINDOW groups later, Prefetch / read and
// verify every byte / Release, with group sizes log-uniform in
// [min-group, max-group]. --max-bytes asks for a lower session limit, so
// that some Reserves are refused with RESOURCE_EXHAUSTED: those count as
// `rejected`, not errors. Copy times are reported to the daemon with Commit
// and Release (its client copy throughput metric).
//
// Reports per method: ops, ops/s, client-side latency p50/p90/p99, errors and
// rejections, then a summary (one JSON object per line with --json). A
// failed Release counts as an error even in the untimed final drain; a failed
// copy into the arena is a `write_errors`, not a Commit error. Exit 0 when
// no error, write error or verify failure happened (and, with --baseline,
// the floor was measured without errors), 1 otherwise, 2 on usage.
//
// --baseline also measures the plain gRPC floor in the same run: a trivial
// unary service (GetStatus answered at once, nothing else) served by this
// process on its own Unix socket, called in a loop by the same number of
// client processes for the same time. Each method's p50/p99 is then printed
// next to the floor's, as a ratio.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "benches.h"
#include "grpc_floor.h"
#include "latency_stats.h"
#include "memoffload/client/client.h"
#include "memoffload/shared_mem/units.h"

namespace memoffload::bench {
namespace {

constexpr int kMethods = 4;
const char* const kMethodNames[kMethods] = {"Reserve", "Commit", "Prefetch", "Release"};
enum MethodIndex { kReserve, kCommit, kPrefetch, kRelease };

struct LoadOptions {
  std::string runtime_dir;
  int clients = 4;
  double seconds = 5;
  bool json = false;
  uint64_t max_bytes = 0;
  uint64_t min_group = 4096;
  uint64_t max_group = 4 << 20;
  int window = 4;
  std::string job_id = "memoffload-bench-load";
  uint64_t seed = 1;
  bool baseline = false;
  std::string floor_socket;  // worker side: call the floor service here
  int index = 0;             // worker only
};

int Usage(const char* message) {
  std::fprintf(stderr,
               "memoffload-bench load: %s\n"
               "usage: memoffload-bench load --runtime-dir DIR --clients N --seconds S [--json]\n"
               "         [--max-bytes B] [--min-group B] [--max-group B] [--window N]\n"
               "         [--job-id ID] [--seed N] [--baseline]\n",
               message);
  return 2;
}

// Parses flags shared by `load` and `load-worker`; false with *error set on
// a bad flag.
bool ParseFlags(int argc, char** argv, LoadOptions* o, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--baseline") {
      o->baseline = true;
      continue;
    }
    if (flag == "--json") {
      o->json = true;
      continue;
    }
    if (i + 1 >= argc) {
      *error = "flag " + flag + " needs a value";
      return false;
    }
    const std::string value = argv[++i];
    auto size = [&](uint64_t* out) {
      Result<uint64_t> v = ParseSize(value);
      if (!v.ok()) *error = flag + ": " + v.status().message();
      if (v.ok()) *out = *v;
      return v.ok();
    };
    char* end = nullptr;
    if (flag == "--runtime-dir") {
      o->runtime_dir = value;
    } else if (flag == "--clients") {
      o->clients = static_cast<int>(std::strtol(value.c_str(), &end, 10));
      if (*end != '\0' || o->clients < 1 || o->clients > 1024) {
        *error = "--clients '" + value + "' is not an integer in 1..1024";
        return false;
      }
    } else if (flag == "--seconds") {
      o->seconds = std::strtod(value.c_str(), &end);
      if (*end != '\0' || !(o->seconds > 0) || o->seconds > 86400) {
        *error = "--seconds '" + value + "' is not a number in (0, 86400]";
        return false;
      }
    } else if (flag == "--window") {
      o->window = static_cast<int>(std::strtol(value.c_str(), &end, 10));
      if (*end != '\0' || o->window < 1 || o->window > 4096) {
        *error = "--window '" + value + "' is not an integer in 1..4096";
        return false;
      }
    } else if (flag == "--seed" || flag == "--index") {
      const uint64_t v = std::strtoull(value.c_str(), &end, 10);
      if (*end != '\0' || value.empty()) {
        *error = flag + " '" + value + "' is not a non-negative integer";
        return false;
      }
      if (flag == "--seed") o->seed = v;
      if (flag == "--index") o->index = static_cast<int>(v);
    } else if (flag == "--floor-socket") {
      o->floor_socket = value;
    } else if (flag == "--job-id") {
      o->job_id = value;
    } else if (flag == "--max-bytes") {
      if (!size(&o->max_bytes)) return false;
    } else if (flag == "--min-group") {
      if (!size(&o->min_group)) return false;
    } else if (flag == "--max-group") {
      if (!size(&o->max_group)) return false;
    } else {
      *error = "unknown flag '" + flag + "'";
      return false;
    }
  }
  if (o->runtime_dir.empty() && o->floor_socket.empty()) {
    *error = "--runtime-dir is required";
    return false;
  }
  if (o->min_group == 0 || o->min_group > o->max_group || o->max_group > (uint64_t{1} << 34)) {
    *error = "need 0 < --min-group <= --max-group <= 16GiB";
    return false;
  }
  return true;
}

// ---- worker ---------------------------------------------------------------

struct Held {
  uint64_t group_id;
  uint64_t bytes;
};

// Bytes of group g are source[offset(g) .. offset(g) + bytes): every group has
// distinct contents without generating data on the hot path.
constexpr uint64_t kShiftSpan = 65536;
uint64_t SourceOffset(uint64_t group_id) { return (group_id * 4099) % kShiftSpan; }

int RunWorker(const LoadOptions& o) {
  if (!o.floor_socket.empty()) return RunGrpcFloorWorker(o.floor_socket, o.seconds);
  client::AttachOptions attach;
  attach.runtime_dir = o.runtime_dir;
  attach.job_id = o.job_id;
  attach.rank = o.index;
  attach.local_rank = o.index;
  attach.max_bytes = o.max_bytes;
  auto attached = client::Client::Attach(attach);
  if (!attached.ok()) {
    std::fprintf(stderr, "load-worker %d: attach failed: %s\n", o.index,
                 attached.status().ToString().c_str());
    return 1;
  }
  client::Client& c = **attached;

  std::mt19937_64 rng(o.seed * 1000003 + static_cast<uint64_t>(o.index));
  std::vector<uint8_t> source(o.max_group + kShiftSpan);
  for (size_t i = 0; i < source.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(source.data() + i, &v, std::min<size_t>(8, source.size() - i));
  }
  std::vector<uint8_t> readback(o.max_group);
  std::uniform_real_distribution<double> log_size(std::log(static_cast<double>(o.min_group)),
                                                  std::log(static_cast<double>(o.max_group)));

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
      const auto r0 = Clock::now();
      Status st = p->used_bytes == h.bytes
                      ? c.Read(p->extents, 0, readback.data(), h.bytes)
                      : InvalidArgument("prefetch says " + std::to_string(p->used_bytes) +
                                        " bytes, committed " + std::to_string(h.bytes));
      copy = {h.bytes, std::chrono::duration<double>(Clock::now() - r0).count()};
      if (!st.ok() ||
          std::memcmp(readback.data(), source.data() + SourceOffset(h.group_id), h.bytes) != 0) {
        ++verify_failures;
        note("verify", st.ok() ? Internal("group " + std::to_string(h.group_id) +
                                          " read back different bytes")
                               : st);
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

  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.seconds));
  uint64_t next_group = 1;
  while (Clock::now() < deadline) {
    const uint64_t g = next_group++;
    const uint64_t bytes = std::min(o.max_group, static_cast<uint64_t>(std::exp(log_size(rng))));
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
    const auto w0 = Clock::now();
    Status st = c.Write(r->extents, 0, source.data() + SourceOffset(g), bytes);
    const client::CopyStats copy{bytes, std::chrono::duration<double>(Clock::now() - w0).count()};
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
  while (!held.empty()) read_back(false);

  for (int m = 0; m < kMethods; ++m) PrintMethodStats(m, stats[m]);
  std::printf("S %lu %lu %lu %.6f %lu\n", static_cast<unsigned long>(offloaded_bytes),
              static_cast<unsigned long>(verify_failures), static_cast<unsigned long>(cycles),
              elapsed, static_cast<unsigned long>(write_errors));
  for (const std::string& m : messages) std::printf("E %s\n", m.c_str());
  std::printf("END\n");
  std::fflush(stdout);
  return 0;
}

// ---- parent ---------------------------------------------------------------

struct Worker {
  pid_t pid = -1;
  int to_child = -1;           // write end of its stdin
  FILE* from_child = nullptr;  // its stdout
};

bool StartWorker(const LoadOptions& o, int index, Worker* w) {
  int in_pipe[2], out_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0) return false;
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    close(in_pipe[0]);
    close(in_pipe[1]);
    return false;
  }
  std::vector<std::string> args = {"memoffload-bench", "load-worker",
                                   "--runtime-dir",    o.runtime_dir,
                                   "--floor-socket",   o.floor_socket,
                                   "--seconds",        std::to_string(o.seconds),
                                   "--index",          std::to_string(index),
                                   "--seed",           std::to_string(o.seed),
                                   "--job-id",         o.job_id,
                                   "--max-bytes",      std::to_string(o.max_bytes),
                                   "--min-group",      std::to_string(o.min_group),
                                   "--max-group",      std::to_string(o.max_group),
                                   "--window",         std::to_string(o.window)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    dup2(in_pipe[0], STDIN_FILENO);
    dup2(out_pipe[1], STDOUT_FILENO);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  close(in_pipe[0]);
  close(out_pipe[1]);
  w->pid = pid;
  w->to_child = in_pipe[1];
  w->from_child = fdopen(out_pipe[0], "r");
  return w->from_child != nullptr;
}

void StopWorkers(std::vector<Worker>* workers) {
  for (Worker& w : *workers) {
    if (w.to_child >= 0) close(w.to_child);
    if (w.from_child != nullptr) fclose(w.from_child);
    if (w.pid > 0) {
      kill(w.pid, SIGKILL);
      waitpid(w.pid, nullptr, 0);
    }
  }
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += ' ';
    } else {
      out += ch;
    }
  }
  return out;
}

struct PhaseTotals {
  MethodStats total[kMethods];
  uint64_t offloaded_bytes = 0, verify_failures = 0, cycles = 0, lost_workers = 0;
  uint64_t write_errors = 0;
  double elapsed_max = 0;
  std::vector<std::string> messages;
};

// Starts o.clients workers, runs them together and merges their reports.
// Returns false (after a message) when they could not be started.
bool RunPhase(const LoadOptions& o, PhaseTotals* t) {
  std::vector<Worker> workers(o.clients);
  for (int i = 0; i < o.clients; ++i) {
    if (!StartWorker(o, i, &workers[i])) {
      std::fprintf(stderr, "memoffload-bench load: cannot start worker %d: %s\n", i,
                   std::strerror(errno));
      StopWorkers(&workers);
      return false;
    }
  }
  char line[4096];
  for (int i = 0; i < o.clients; ++i) {
    if (std::fgets(line, sizeof line, workers[i].from_child) == nullptr ||
        std::strcmp(line, "READY\n") != 0) {
      std::fprintf(stderr,
                   "memoffload-bench load: worker %d did not attach to the daemon in %s "
                   "(see its message above)\n",
                   i, o.floor_socket.empty() ? o.runtime_dir.c_str() : o.floor_socket.c_str());
      StopWorkers(&workers);
      return false;
    }
  }
  for (Worker& w : workers) {
    if (write(w.to_child, "g", 1) != 1) {
      std::fprintf(stderr, "memoffload-bench load: cannot start a worker: %s\n",
                   std::strerror(errno));
    }
  }

  MethodStats* total = t->total;
  uint64_t& offloaded_bytes = t->offloaded_bytes;
  uint64_t& verify_failures = t->verify_failures;
  uint64_t& cycles = t->cycles;
  uint64_t& lost_workers = t->lost_workers;
  double& elapsed_max = t->elapsed_max;
  std::vector<std::string>& messages = t->messages;
  for (int i = 0; i < o.clients; ++i) {
    bool ended = false;
    while (std::fgets(line, sizeof line, workers[i].from_child) != nullptr) {
      int m = 0, b = 0;
      unsigned long a1 = 0, a2 = 0, a3 = 0, a4 = 0;
      double secs = 0;
      if (std::sscanf(line, "M %d %lu %lu %lu", &m, &a1, &a2, &a3) == 4 && m >= 0 && m < kMethods) {
        total[m].ops += a1;
        total[m].errors += a2;
        total[m].rejected += a3;
      } else if (std::sscanf(line, "H %d %d %lu", &m, &b, &a1) == 3 && m >= 0 && m < kMethods &&
                 b >= 0 && b < kBuckets) {
        total[m].histogram[b] += a1;
      } else if (std::sscanf(line, "S %lu %lu %lu %lf %lu", &a1, &a2, &a3, &secs, &a4) == 5) {
        offloaded_bytes += a1;
        verify_failures += a2;
        cycles += a3;
        t->write_errors += a4;
        elapsed_max = std::max(elapsed_max, secs);
      } else if (std::strncmp(line, "E ", 2) == 0) {
        std::string msg(line + 2);
        if (!msg.empty() && msg.back() == '\n') msg.pop_back();
        if (messages.size() < 10) messages.push_back("worker " + std::to_string(i) + ": " + msg);
      } else if (std::strcmp(line, "END\n") == 0) {
        ended = true;
      }
    }
    int status = 0;
    waitpid(workers[i].pid, &status, 0);
    workers[i].pid = -1;
    if (!ended || !WIFEXITED(status) || WEXITSTATUS(status) != 0) ++lost_workers;
  }
  StopWorkers(&workers);
  return true;
}

// Measures the floor with the same clients and time; fills *floor.
bool RunFloor(const LoadOptions& o, MethodStats* floor) {
  Result<std::unique_ptr<GrpcFloorServer>> server = GrpcFloorServer::Start();
  if (!server.ok()) return false;
  LoadOptions f = o;
  f.floor_socket = (*server)->socket_path();
  PhaseTotals t;
  const bool ok = RunPhase(f, &t) && t.lost_workers == 0;
  *floor = t.total[0];
  return ok;
}

int RunParent(const LoadOptions& o) {
  PhaseTotals t;
  if (!RunPhase(o, &t)) return 1;
  MethodStats floor;
  const bool have_floor = o.baseline && RunFloor(o, &floor);
  if (o.baseline && !have_floor) {
    std::fprintf(stderr, "memoffload-bench load: the gRPC floor measurement failed\n");
  }
  // With --baseline, a floor that could not be measured or saw errors fails
  // the run too: the comparison is the point.
  const bool floor_ok = have_floor && floor.errors == 0;
  const MethodStats* total = t.total;
  const uint64_t offloaded_bytes = t.offloaded_bytes, verify_failures = t.verify_failures,
                 cycles = t.cycles, lost_workers = t.lost_workers;
  const std::vector<std::string>& messages = t.messages;
  const double seconds = t.elapsed_max > 0 ? t.elapsed_max : o.seconds;
  uint64_t errors = verify_failures + lost_workers + t.write_errors, rejected = 0, ops = 0;
  for (int m = 0; m < kMethods; ++m) {
    const MethodStats& s = total[m];
    errors += s.errors;
    rejected += s.rejected;
    ops += s.ops;
    const double rate = static_cast<double>(s.ops) / seconds;
    if (o.json) {
      std::printf(
          "{\"bench\":\"load\",\"method\":\"%s\",\"clients\":%d,\"seconds\":%.3f,\"ops\":%lu,"
          "\"ops_per_second\":%.1f,\"p50_us\":%.1f,\"p90_us\":%.1f,\"p99_us\":%.1f,"
          "\"errors\":%lu,\"rejected\":%lu}\n",
          kMethodNames[m], o.clients, seconds, static_cast<unsigned long>(s.ops), rate,
          s.PercentileUs(0.5), s.PercentileUs(0.9), s.PercentileUs(0.99),
          static_cast<unsigned long>(s.errors), static_cast<unsigned long>(s.rejected));
    } else {
      if (m == 0) {
        std::printf("load: %d clients, %.1f s, groups %s..%s, window %d%s\n", o.clients, seconds,
                    FormatSize(o.min_group).c_str(), FormatSize(o.max_group).c_str(), o.window,
                    o.max_bytes ? (", session limit " + FormatSize(o.max_bytes)).c_str() : "");
        std::printf("%-9s %10s %10s %9s %9s %9s %7s %9s\n", "method", "ops", "ops/s", "p50 us",
                    "p90 us", "p99 us", "errors", "rejected");
      }
      std::printf("%-9s %10lu %10.0f %9.1f %9.1f %9.1f %7lu %9lu\n", kMethodNames[m],
                  static_cast<unsigned long>(s.ops), rate, s.PercentileUs(0.5), s.PercentileUs(0.9),
                  s.PercentileUs(0.99), static_cast<unsigned long>(s.errors),
                  static_cast<unsigned long>(s.rejected));
    }
  }
  if (have_floor) {
    const double f50 = floor.PercentileUs(0.5), f99 = floor.PercentileUs(0.99);
    if (o.json) {
      std::printf(
          "{\"bench\":\"load\",\"method\":\"grpc_floor\",\"clients\":%d,\"ops\":%lu,"
          "\"ops_per_second\":%.1f,\"p50_us\":%.1f,\"p90_us\":%.1f,\"p99_us\":%.1f,"
          "\"errors\":%lu}\n",
          o.clients, static_cast<unsigned long>(floor.ops),
          static_cast<double>(floor.ops) / o.seconds, f50, floor.PercentileUs(0.9), f99,
          static_cast<unsigned long>(floor.errors));
      for (int m = 0; m < kMethods; ++m) {
        std::printf(
            "{\"bench\":\"load\",\"method\":\"%s\",\"p50_vs_floor\":%.2f,"
            "\"p99_vs_floor\":%.2f}\n",
            kMethodNames[m], total[m].PercentileUs(0.5) / f50, total[m].PercentileUs(0.99) / f99);
      }
    } else {
      std::printf("%-9s %10lu %10.0f %9.1f %9.1f %9.1f %7lu   (trivial unary gRPC, same clients)\n",
                  "floor", static_cast<unsigned long>(floor.ops),
                  static_cast<double>(floor.ops) / o.seconds, f50, floor.PercentileUs(0.9), f99,
                  static_cast<unsigned long>(floor.errors));
      for (int m = 0; m < kMethods; ++m) {
        std::printf("%-9s p50 %.2fx floor, p99 %.2fx floor\n", kMethodNames[m],
                    total[m].PercentileUs(0.5) / f50, total[m].PercentileUs(0.99) / f99);
      }
    }
  }
  const double bytes_per_second = static_cast<double>(offloaded_bytes) / seconds;
  if (o.json) {
    std::printf(
        "{\"bench\":\"load\",\"summary\":true,\"clients\":%d,\"seconds\":%.3f,\"ops\":%lu,"
        "\"ops_per_second\":%.1f,\"cycles\":%lu,\"cycles_per_second\":%.1f,"
        "\"offloaded_bytes\":%lu,\"offload_bytes_per_second\":%.0f,\"errors\":%lu,"
        "\"rejected\":%lu,\"verify_failures\":%lu,\"write_errors\":%lu,\"failed_workers\":%lu,"
        "\"floor_ok\":%s,\"messages\":[",
        o.clients, seconds, static_cast<unsigned long>(ops), static_cast<double>(ops) / seconds,
        static_cast<unsigned long>(cycles), static_cast<double>(cycles) / seconds,
        static_cast<unsigned long>(offloaded_bytes), bytes_per_second,
        static_cast<unsigned long>(errors), static_cast<unsigned long>(rejected),
        static_cast<unsigned long>(verify_failures), static_cast<unsigned long>(t.write_errors),
        static_cast<unsigned long>(lost_workers),
        !o.baseline ? "null"
        : floor_ok  ? "true"
                    : "false");
    for (size_t i = 0; i < messages.size(); ++i) {
      std::printf("%s\"%s\"", i ? "," : "", JsonEscape(messages[i]).c_str());
    }
    std::printf("]}\n");
  } else {
    std::printf(
        "total: %lu ops (%.0f ops/s), %lu cycles (%.0f/s), offloaded %s (%s/s), "
        "%lu errors, %lu rejected, %lu verify failures, %lu write errors, %lu failed workers\n",
        static_cast<unsigned long>(ops), static_cast<double>(ops) / seconds,
        static_cast<unsigned long>(cycles), static_cast<double>(cycles) / seconds,
        FormatSize(offloaded_bytes).c_str(),
        FormatSize(static_cast<uint64_t>(bytes_per_second)).c_str(),
        static_cast<unsigned long>(errors), static_cast<unsigned long>(rejected),
        static_cast<unsigned long>(verify_failures), static_cast<unsigned long>(t.write_errors),
        static_cast<unsigned long>(lost_workers));
    if (o.baseline && !floor_ok) std::printf("  the gRPC floor measurement failed or had errors\n");
    for (const std::string& m : messages) std::printf("  %s\n", m.c_str());
  }
  std::fflush(stdout);
  return errors == 0 && (!o.baseline || floor_ok) ? 0 : 1;
}

}  // namespace

int RunLoadBench(int argc, char** argv) {
  LoadOptions o;
  std::string error;
  if (!ParseFlags(argc, argv, &o, &error)) return Usage(error.c_str());
  signal(SIGPIPE, SIG_IGN);
  return RunParent(o);
}

int RunLoadWorker(int argc, char** argv) {
  LoadOptions o;
  std::string error;
  if (!ParseFlags(argc, argv, &o, &error)) return Usage(error.c_str());
  return RunWorker(o);
}

}  // namespace memoffload::bench
