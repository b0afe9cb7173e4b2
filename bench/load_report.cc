#include "load_report.h"

#include <algorithm>
#include <cstdio>

namespace memoffload::bench {

void Merge(MethodStats* into, const MethodStats& s) {
  into->ops += s.ops;
  into->errors += s.errors;
  into->rejected += s.rejected;
  for (int b = 0; b < kBuckets; ++b) into->histogram[b] += s.histogram[b];
}

void Merge(PhaseTotals* into, const PhaseTotals& t) {
  for (int m = 0; m < kMethods; ++m) Merge(&into->total[m], t.total[m]);
  into->offloaded_bytes += t.offloaded_bytes;
  into->verify_failures += t.verify_failures;
  into->cycles += t.cycles;
  into->lost_workers += t.lost_workers;
  into->write_errors += t.write_errors;
  into->elapsed_max += t.elapsed_max;  // the phases run one after another
  into->clients += t.clients;
  into->server += t.server;
  into->server_known = (into->phases == 0 || into->server_known) && t.server_known;
  ++into->phases;
  for (const std::string& m : t.messages) {
    if (into->messages.size() < 10) into->messages.push_back(m);
  }
}

Spread SpreadOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

void PrintPairRatios(const LoadOptions& o, const std::vector<PairRatios>& pairs) {
  for (int m = 0; m < kMethods; ++m) {
    std::vector<double> p50, p99;
    for (const PairRatios& r : pairs) {
      p50.push_back(r.p50[m]);
      p99.push_back(r.p99[m]);
    }
    const Spread a = SpreadOf(p50), b = SpreadOf(p99);
    if (o.json) {
      std::printf(
          "{\"bench\":\"load\",\"method\":\"%s\",\"clients\":%d,\"pairs\":%zu,"
          "\"p50_vs_floor\":%.2f,\"p50_vs_floor_min\":%.2f,\"p50_vs_floor_max\":%.2f,"
          "\"p99_vs_floor\":%.2f,\"p99_vs_floor_min\":%.2f,\"p99_vs_floor_max\":%.2f}\n",
          kMethodNames[m], o.clients, pairs.size(), a.median, a.min, a.max, b.median, b.min, b.max);
    } else {
      std::printf("%-9s p50 %.2fx floor (%.2f..%.2f), p99 %.2fx floor (%.2f..%.2f), %zu pairs\n",
                  kMethodNames[m], a.median, a.min, a.max, b.median, b.min, b.max, pairs.size());
    }
  }
  std::vector<double> cpu;
  for (const PairRatios& r : pairs) {
    if (r.cpu > 0) cpu.push_back(r.cpu);
  }
  if (cpu.size() != pairs.size() || cpu.empty()) return;  // a server's CPU was unreadable
  const Spread c = SpreadOf(cpu);
  if (o.json) {
    std::printf(
        "{\"bench\":\"load\",\"cpu_per_call_vs_floor\":%.2f,\"cpu_per_call_vs_floor_min\":%.2f,"
        "\"cpu_per_call_vs_floor_max\":%.2f,\"clients\":%d,\"pairs\":%zu}\n",
        c.median, c.min, c.max, o.clients, pairs.size());
  } else {
    std::printf("CPU per call (clients and server) %.2fx floor (%.2f..%.2f), %zu pairs\n", c.median,
                c.min, c.max, pairs.size());
  }
}

uint64_t Calls(const PhaseTotals& t) {
  uint64_t calls = 0;
  for (const MethodStats& s : t.total) calls += s.ops + s.errors + s.rejected;
  return calls;
}

double CpuPerCallUs(const PhaseTotals& t) {
  const double calls = static_cast<double>(std::max<uint64_t>(Calls(t), 1));
  return (t.clients.user + t.clients.sys + t.server.user + t.server.sys) / calls * 1e6;
}

void PrintCpuUse(const LoadOptions& o, const char* what, const PhaseTotals& t) {
  const double calls = static_cast<double>(std::max<uint64_t>(Calls(t), 1));
  const double client_us = (t.clients.user + t.clients.sys) / calls * 1e6;
  const double copy_us = t.clients.copy / calls * 1e6;
  const double server_us = (t.server.user + t.server.sys) / calls * 1e6;
  if (o.json) {
    std::printf(
        "{\"bench\":\"load\",\"cpu\":\"%s\",\"clients\":%d,\"calls\":%lu,"
        "\"client_user_s\":%.3f,\"client_sys_s\":%.3f,\"client_copy_s\":%.3f,"
        "\"client_us_per_call\":%.1f,\"client_copy_us_per_call\":%.1f,",
        what, o.clients, static_cast<unsigned long>(Calls(t)), t.clients.user, t.clients.sys,
        t.clients.copy, client_us, copy_us);
    if (t.server_known) {
      std::printf("\"server_user_s\":%.3f,\"server_sys_s\":%.3f,\"server_us_per_call\":%.1f}\n",
                  t.server.user, t.server.sys, server_us);
    } else {
      std::printf("\"server_user_s\":null,\"server_sys_s\":null,\"server_us_per_call\":null}\n");
    }
    return;
  }
  std::printf(
      "cpu %-6s clients %.1f us/call (user %.2f s, sys %.2f s; copies and verify %.1f "
      "us/call)",
      what, client_us, t.clients.user, t.clients.sys, copy_us);
  if (t.server_known) {
    std::printf("; server %.1f us/call (user %.2f s, sys %.2f s)\n", server_us, t.server.user,
                t.server.sys);
  } else {
    std::printf("; server not readable (its pid from memoffloadd.lock, /proc/PID/stat)\n");
  }
}

}  // namespace memoffload::bench
