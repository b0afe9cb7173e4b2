// memoffload-bench load --runtime-dir DIR --clients N --seconds S [--json]
//     [--max-bytes B] [--min-group B] [--max-group B] [--window N]
//     [--job-id ID] [--seed N] [--baseline [--pairs N] [--floor-copies]] [--warm]
//     [--no-copies]
//
// A traffic generator against a running memoffloadd. Starts N client
// processes (fork + exec of this binary with the hidden `load-worker`
// subcommand, so no gRPC state crosses a fork). Each attaches as rank i of
// job ID, runs one untimed warm-up cycle (the first chunk mapping is not a
// request-path cost), waits until all are ready, then for S seconds runs cycles of
// Reserve / write / Commit, and, WINDOW groups later, Prefetch / read and
// verify every byte / Release, with group sizes log-uniform in
// [min-group, max-group]. --max-bytes asks for a lower session limit, so
// that some Reserves are refused with RESOURCE_EXHAUSTED: those count as
// `rejected`, not errors. Copy times are reported to the daemon with Commit
// and Release (its client copy throughput metric).
//
// The phase has two barriers: every client's timed window ends before any
// client drains its held groups or reports, and every client has reported
// before any exits, so that no drain, unmapping or session reclaim of one
// client falls in the window of another (the floor's clients, which hold
// nothing, would not pay for them).
//
// Reports per method: ops, ops/s, client-side latency p50/p90/p99, errors and
// rejections, then a summary (one JSON object per line with --json). A
// failed Release counts as an error even in the untimed final drain; a failed
// copy into the arena is a `write_errors`, not a Commit error. Exit 0 when
// no error, write error or verify failure happened (and, with --baseline,
// the floor was measured without errors), 1 otherwise, 2 on usage.
//
// --warm claims the chunks for the bench's tenant first, so that every
// client maps and populates them at attach (untimed). Both phases report
// the CPU per call of the clients (their copies apart) and of the server,
// and each pair the ratio of the two (docs/history/request_path.md, "Where the gap
// comes from").
//
// --baseline also measures the plain gRPC floor in the same run: a trivial
// unary service (GetStatus answered at once, nothing else) served by this
// process on its own Unix socket, called in a loop by the same number of
// client processes for the same time. Each method's p50/p99 is then printed
// next to the floor's, as a ratio. --pairs N runs N such (daemon, floor)
// pairs one after the other and prints each ratio as the median over the
// pairs with its min..max. --floor-copies makes the floor's clients do the
// same copies between their calls (grpc_floor.h). --no-copies makes the
// load's clients copy nothing (no write, read back or verify; Prefetch's
// size is still checked), so that both sides run only their calls: the
// request path next to the trivial one. With 256 clients on 2 cores the
// copies' CPU and cache misses, not the calls, set the plain-floor ratio
// (docs/history/request_path.md, "Where the gap comes from").
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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
#include "load_options.h"
#include "load_report.h"
#include "memoffload/client/client.h"
#include "memoffload/common/units.h"

namespace memoffload::bench {
namespace {

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
  if (o.warm) args.push_back("--warm");
  if (o.floor_copies) args.push_back("--floor-copies");
  if (o.no_copies) args.push_back("--no-copies");
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

// The CPU time of the server the workers call: the daemon's, from the pid in
// its instance lock (/proc/PID/stat), or, for the floor served by this
// process, this process's own. False when it cannot be read.
bool ServerCpu(const LoadOptions& o, CpuTime* out) {
  if (!o.floor_socket.empty()) {
    *out = SelfCpu();
    return true;
  }
  FILE* lock = std::fopen((o.runtime_dir + "/memoffloadd.lock").c_str(), "r");
  if (lock == nullptr) return false;
  long pid = 0;
  const bool have_pid = std::fscanf(lock, "%ld", &pid) == 1 && pid > 0;
  std::fclose(lock);
  if (!have_pid) return false;
  FILE* stat = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (stat == nullptr) return false;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, stat);
  std::fclose(stat);
  buf[n] = '\0';
  // Fields after the command name (which may hold spaces): state is the
  // 3rd field, utime and stime the 14th and 15th.
  const char* p = std::strrchr(buf, ')');
  unsigned long utime = 0, stime = 0;
  if (p == nullptr || std::sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu",
                                  &utime, &stime) != 2) {
    return false;
  }
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  *out = {static_cast<double>(utime) / tick, static_cast<double>(stime) / tick};
  return true;
}

// Adds worker `index`'s report (its lines up to END) to *t. False when its
// output ended before END.
bool ReadReport(FILE* from, int index, PhaseTotals* t) {
  char line[4096];
  while (std::fgets(line, sizeof line, from) != nullptr) {
    int m = 0, b = 0;
    unsigned long a1 = 0, a2 = 0, a3 = 0, a4 = 0;
    double secs = 0;
    if (std::sscanf(line, "M %d %lu %lu %lu", &m, &a1, &a2, &a3) == 4 && m >= 0 && m < kMethods) {
      t->total[m].ops += a1;
      t->total[m].errors += a2;
      t->total[m].rejected += a3;
    } else if (std::sscanf(line, "H %d %d %lu", &m, &b, &a1) == 3 && m >= 0 && m < kMethods &&
               b >= 0 && b < kBuckets) {
      t->total[m].histogram[b] += a1;
    } else if (std::sscanf(line, "S %lu %lu %lu %lf %lu", &a1, &a2, &a3, &secs, &a4) == 5) {
      t->offloaded_bytes += a1;
      t->verify_failures += a2;
      t->cycles += a3;
      t->write_errors += a4;
      t->elapsed_max = std::max(t->elapsed_max, secs);
    } else if (CpuTime c; std::sscanf(line, "C %lf %lf %lf", &c.user, &c.sys, &c.copy) == 3) {
      t->clients += c;
    } else if (std::strncmp(line, "E ", 2) == 0) {
      std::string msg(line + 2);
      if (!msg.empty() && msg.back() == '\n') msg.pop_back();
      if (t->messages.size() < 10) {
        t->messages.push_back("worker " + std::to_string(index) + ": " + msg);
      }
    } else if (std::strcmp(line, "END\n") == 0) {
      return true;
    }
  }
  return false;
}

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
  CpuTime server0;
  t->server_known = ServerCpu(o, &server0);
  for (Worker& w : workers) {
    if (write(w.to_child, "g", 1) != 1) {
      std::fprintf(stderr, "memoffload-bench load: cannot start a worker: %s\n",
                   std::strerror(errno));
    }
  }

  // Every worker's window first (TIMED), then the server's CPU, then the
  // word to go on: drains and reports fall in nobody's window. A worker
  // whose output ends early is lost.
  std::vector<bool> open(o.clients, true);
  for (int i = 0; i < o.clients; ++i) {
    while (true) {
      if (std::fgets(line, sizeof line, workers[i].from_child) == nullptr) {
        open[i] = false;
        break;
      }
      if (std::strcmp(line, "TIMED\n") == 0) break;
    }
  }
  CpuTime server1;
  t->server_known = t->server_known && ServerCpu(o, &server1);
  if (t->server_known) t->server = server1 - server0;
  for (int i = 0; i < o.clients; ++i) {
    if (open[i] && write(workers[i].to_child, "d", 1) != 1) open[i] = false;
  }

  std::vector<bool> ended(o.clients, false);
  for (int i = 0; i < o.clients; ++i) {
    if (open[i]) ended[i] = ReadReport(workers[i].from_child, i, t);
  }
  // Now they may all exit (their unmapping and the daemon's reclaims
  // after every window and report).
  for (Worker& w : workers) {
    close(w.to_child);
    w.to_child = -1;
  }
  for (int i = 0; i < o.clients; ++i) {
    int status = 0;
    waitpid(workers[i].pid, &status, 0);
    workers[i].pid = -1;
    if (!ended[i] || !WIFEXITED(status) || WEXITSTATUS(status) != 0) ++t->lost_workers;
  }
  StopWorkers(&workers);
  return true;
}

// Measures the floor with the same clients and time; fills *t (its calls
// in t->total[0]).
bool RunFloor(const LoadOptions& o, PhaseTotals* t) {
  Result<std::unique_ptr<GrpcFloorServer>> server = GrpcFloorServer::Start();
  if (!server.ok()) return false;
  LoadOptions f = o;
  f.floor_socket = (*server)->socket_path();
  return RunPhase(f, t) && t->lost_workers == 0;
}

// With --warm: takes every chunk it can for the bench's tenant (whole chunks
// reserved, then released; a tenant keeps its chunks after), so that each
// client is handed them all at attach and populates its page tables there,
// before the timed window, as a trainer that ran for a while has. Without
// it, a 5 s window of hundreds of new processes pays that first use on
// nearly every cycle (docs/arena.md, first write). Returns false after a
// message when it cannot attach.
bool ClaimChunks(const LoadOptions& o) {
  if (!o.warm) return true;
  client::AttachOptions attach;
  attach.runtime_dir = o.runtime_dir;
  attach.job_id = o.job_id;
  auto attached = client::Client::Attach(attach);
  if (!attached.ok()) {
    std::fprintf(stderr, "memoffload-bench load: cannot attach to claim the chunks: %s\n",
                 attached.status().ToString().c_str());
    return false;
  }
  client::Client& c = **attached;
  std::vector<uint64_t> groups;
  for (uint32_t k = 0; k < c.chunk_count(); ++k) {
    client::ReserveOptions one;
    one.single_extent = true;
    if (!c.Reserve(k + 1, c.chunk_size_bytes(k), one).ok()) break;
    groups.push_back(k + 1);
  }
  for (uint64_t g : groups) {
    if (Status st = c.Release(g); !st.ok()) {
      std::fprintf(stderr, "memoffload-bench load: releasing claim group %lu: %s\n",
                   static_cast<unsigned long>(g), st.ToString().c_str());
      return false;
    }
  }
  if (o.json) {
    std::printf("{\"bench\":\"load\",\"warmup\":true,\"claimed_chunks\":%zu,\"chunks\":%u}\n",
                groups.size(), c.chunk_count());
  } else {
    std::printf(
        "warm-up: %zu of %u chunks claimed for this tenant; each client maps and populates them "
        "at attach (without --warm: on first use, in the timed window)\n",
        groups.size(), c.chunk_count());
  }
  return true;
}

int RunParent(const LoadOptions& o) {
  if (!ClaimChunks(o)) return 1;
  // With --baseline, `pairs` rounds of the daemon's load then the floor, so
  // that whatever else the machine does hits both alike; the tables merge
  // every round, the ratios are per pair.
  PhaseTotals t, floor_totals;
  const MethodStats& floor = floor_totals.total[0];
  std::vector<PairRatios> pairs;
  bool have_floor = o.baseline;
  for (int p = 0; p < (o.baseline ? o.pairs : 1); ++p) {
    PhaseTotals one;
    if (!RunPhase(o, &one)) return 1;
    Merge(&t, one);
    if (!o.baseline) break;
    PhaseTotals ft;
    if (!RunFloor(o, &ft)) {
      have_floor = false;
      break;
    }
    Merge(&floor_totals, ft);
    const MethodStats& f = ft.total[0];
    PairRatios r;
    for (int m = 0; m < kMethods; ++m) {
      r.p50[m] = one.total[m].PercentileUs(0.5) / f.PercentileUs(0.5);
      r.p99[m] = one.total[m].PercentileUs(0.99) / f.PercentileUs(0.99);
    }
    if (one.server_known && ft.server_known) r.cpu = CpuPerCallUs(one) / CpuPerCallUs(ft);
    pairs.push_back(r);
  }
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
        std::printf("load: %d clients, %.1f s, groups %s..%s, window %d%s%s\n", o.clients, seconds,
                    FormatSize(o.min_group).c_str(), FormatSize(o.max_group).c_str(), o.window,
                    o.max_bytes ? (", session limit " + FormatSize(o.max_bytes)).c_str() : "",
                    o.no_copies ? ", no copies (the request path alone)" : "");
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
    const double floor_seconds = o.seconds * o.pairs;
    if (o.json) {
      std::printf(
          "{\"bench\":\"load\",\"method\":\"grpc_floor\",\"clients\":%d,\"ops\":%lu,"
          "\"ops_per_second\":%.1f,\"p50_us\":%.1f,\"p90_us\":%.1f,\"p99_us\":%.1f,"
          "\"errors\":%lu,\"floor_copies\":%s}\n",
          o.clients, static_cast<unsigned long>(floor.ops),
          static_cast<double>(floor.ops) / floor_seconds, f50, floor.PercentileUs(0.9), f99,
          static_cast<unsigned long>(floor.errors), o.floor_copies ? "true" : "false");
    } else {
      std::printf(
          "%-9s %10lu %10.0f %9.1f %9.1f %9.1f %7lu   (trivial unary gRPC, same clients%s)\n",
          "floor", static_cast<unsigned long>(floor.ops),
          static_cast<double>(floor.ops) / floor_seconds, f50, floor.PercentileUs(0.9), f99,
          static_cast<unsigned long>(floor.errors), o.floor_copies ? " doing the same copies" : "");
    }
    PrintPairRatios(o, pairs);
  }
  PrintCpuUse(o, "daemon", t);
  if (have_floor) PrintCpuUse(o, "floor", floor_totals);
  const double bytes_per_second = static_cast<double>(offloaded_bytes) / seconds;
  if (o.json) {
    std::printf(
        "{\"bench\":\"load\",\"summary\":true,\"clients\":%d,\"seconds\":%.3f,\"ops\":%lu,"
        "\"ops_per_second\":%.1f,\"cycles\":%lu,\"cycles_per_second\":%.1f,"
        "\"offloaded_bytes\":%lu,\"offload_bytes_per_second\":%.0f,\"errors\":%lu,"
        "\"rejected\":%lu,\"verify_failures\":%lu,\"write_errors\":%lu,\"failed_workers\":%lu,"
        "\"copies\":%s,\"floor_ok\":%s,\"messages\":[",
        o.clients, seconds, static_cast<unsigned long>(ops), static_cast<double>(ops) / seconds,
        static_cast<unsigned long>(cycles), static_cast<double>(cycles) / seconds,
        static_cast<unsigned long>(offloaded_bytes), bytes_per_second,
        static_cast<unsigned long>(errors), static_cast<unsigned long>(rejected),
        static_cast<unsigned long>(verify_failures), static_cast<unsigned long>(t.write_errors),
        static_cast<unsigned long>(lost_workers), o.no_copies ? "false" : "true",
        !o.baseline ? "null"
        : floor_ok  ? "true"
                    : "false");
    for (size_t i = 0; i < messages.size(); ++i) {
      std::printf("%s\"%s\"", i ? "," : "", JsonEscape(messages[i]).c_str());
    }
    std::printf("]}\n");
  } else {
    std::printf(
        "total: %lu ops (%.0f ops/s), %lu cycles (%.0f/s), %s %s (%s/s), "
        "%lu errors, %lu rejected, %lu verify failures, %lu write errors, %lu failed workers\n",
        static_cast<unsigned long>(ops), static_cast<double>(ops) / seconds,
        static_cast<unsigned long>(cycles), static_cast<double>(cycles) / seconds,
        o.no_copies ? "committed, nothing copied," : "offloaded",
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
  if (o.floor_copies && !o.baseline) {
    return Usage("--floor-copies changes the floor, which only --baseline runs");
  }
  signal(SIGPIPE, SIG_IGN);
  return RunParent(o);
}

}  // namespace memoffload::bench
