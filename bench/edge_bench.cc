// memoffload-bench edge: the three HTTP/2 attacks of issue 29 item 3 against
// a running daemon, each next to a window without it, measured in the same
// run. For every attack one JSON line: whether the daemon closed the
// attacker's connection, the daemon's RssAnon before, at its peak during the
// attack and 2 s after the attacker is gone, and the p50/p99 of the victims'
// calls (a few clients cycling Reserve, Commit, Prefetch, Release) with and
// without the attack, and their ratio. Nothing is asserted here; the
// edge_attacks test asserts the memory, and the ratio is printed.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "benches.h"
#include "h2_peer.h"
#include "memoffload/client/client.h"
#include "memoffload/common/runtime_dir.h"
#include "memoffload/common/units.h"

namespace memoffload::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct EdgeOptions {
  std::string runtime_dir;
  int daemon_pid = 0;
  std::vector<std::string> attacks = {"rapid-reset", "continuation", "trickle"};
  uint64_t pairs = 150000;
  uint64_t continuation_bytes = uint64_t{1} << 30;
  double trickle_seconds = 10;
  int victims = 4;
  double window_seconds = 3;
  // The attacker's uid (it runs in a child process). A uid whose connection
  // breaks the rules has its new connections refused for a while, so the
  // victims must not share it: as root the default is 65534 (the daemon must
  // allow it: access.allowed_uids, socket_mode 0666).
  int attacker_uid = -1;
};

long RssAnonKiB(int pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stol(line.substr(8));
  }
  return -1;
}

struct VictimStats {
  std::vector<double> latencies_us;
  uint64_t errors = 0;
  double Percentile(double p) {
    if (latencies_us.empty()) return 0;
    std::sort(latencies_us.begin(), latencies_us.end());
    const size_t i = static_cast<size_t>(p * static_cast<double>(latencies_us.size() - 1));
    return latencies_us[i];
  }
};

// `victims` clients, each cycling Reserve, Commit, Prefetch, Release of
// 64 KiB until *stop, every call timed.
VictimStats RunVictims(const EdgeOptions& o, const std::atomic<bool>* stop) {
  std::vector<VictimStats> per(static_cast<size_t>(o.victims));
  std::vector<std::thread> threads;
  for (int v = 0; v < o.victims; ++v) {
    threads.emplace_back([&, v] {
      VictimStats& s = per[static_cast<size_t>(v)];
      client::AttachOptions attach;
      attach.runtime_dir = o.runtime_dir;
      attach.job_id = "edge-victims";
      attach.rank = v;
      auto c = client::Client::Attach(attach);
      if (!c.ok()) {
        ++s.errors;
        return;
      }
      uint64_t group = 1;
      auto timed = [&](auto&& call) {
        const auto t0 = Clock::now();
        const bool ok = call();
        s.latencies_us.push_back(
            std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        if (!ok) ++s.errors;
        return ok;
      };
      while (!stop->load()) {
        const uint64_t g = group++;
        if (!timed([&] { return (*c)->Reserve(g, 64 * 1024).ok(); })) continue;
        timed([&] { return (*c)->Commit(g, 64 * 1024).ok(); });
        timed([&] { return (*c)->Prefetch(g).ok(); });
        timed([&] { return (*c)->Release(g).ok(); });
      }
    });
  }
  for (auto& t : threads) t.join();
  VictimStats all;
  for (auto& s : per) {
    all.errors += s.errors;
    all.latencies_us.insert(all.latencies_us.end(), s.latencies_us.begin(), s.latencies_us.end());
  }
  return all;
}

AttackResult Attack(const EdgeOptions& o, const std::string& name) {
  const std::string socket = o.runtime_dir + "/" + kGrpcSocketName;
  if (name == "rapid-reset") return RapidReset(socket, o.pairs);
  if (name == "continuation") return ContinuationFlood(socket, o.continuation_bytes);
  if (name == "trickle") return TrickledHeader(socket, 2, o.trickle_seconds);
  AttackResult r;
  r.error = "unknown attack '" + name + "' (rapid-reset, continuation, trickle)";
  return r;
}

AttackResult RunAttack(const EdgeOptions& o, const std::string& name) {
  return RunAsUid(static_cast<uid_t>(o.attacker_uid), [&] { return Attack(o, name); });
}

int Usage(const char* why) {
  std::fprintf(stderr,
               "memoffload-bench edge: %s\n"
               "usage: memoffload-bench edge --runtime-dir DIR --daemon-pid PID\n"
               "  [--attacks rapid-reset,continuation,trickle] [--pairs N]\n"
               "  [--continuation-bytes SIZE] [--trickle-seconds S] [--victims N]\n"
               "  [--window-seconds S] [--attacker-uid UID]\n",
               why);
  return 2;
}

}  // namespace

int RunEdgeBench(int argc, char** argv) {
  EdgeOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return Usage(("missing value for " + flag).c_str());
    const std::string value = argv[++i];
    if (flag == "--runtime-dir") {
      o.runtime_dir = value;
    } else if (flag == "--daemon-pid") {
      o.daemon_pid = std::atoi(value.c_str());
    } else if (flag == "--attacks") {
      o.attacks.clear();
      size_t start = 0;
      while (start <= value.size()) {
        const size_t comma = std::min(value.find(',', start), value.size());
        o.attacks.push_back(value.substr(start, comma - start));
        start = comma + 1;
      }
    } else if (flag == "--pairs") {
      o.pairs = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--continuation-bytes") {
      auto bytes = ParseSize(value);
      if (!bytes.ok()) return Usage(bytes.status().message().c_str());
      o.continuation_bytes = *bytes;
    } else if (flag == "--trickle-seconds") {
      o.trickle_seconds = std::atof(value.c_str());
    } else if (flag == "--victims") {
      o.victims = std::atoi(value.c_str());
    } else if (flag == "--window-seconds") {
      o.window_seconds = std::atof(value.c_str());
    } else if (flag == "--attacker-uid") {
      o.attacker_uid = std::atoi(value.c_str());
    } else {
      return Usage(("unknown flag " + flag).c_str());
    }
  }
  if (o.runtime_dir.empty() || o.daemon_pid <= 0) {
    return Usage("--runtime-dir and --daemon-pid are required");
  }
  if (o.victims < 1 || o.window_seconds <= 0) return Usage("--victims and --window-seconds > 0");
  if (o.attacker_uid < 0) o.attacker_uid = getuid() == 0 ? 65534 : static_cast<int>(getuid());
  if (static_cast<uid_t>(o.attacker_uid) == getuid()) {
    std::fprintf(stderr,
                 "memoffload-bench edge: the attacker runs as the victims' uid %u: once it breaks "
                 "a rule the victims' new connections are refused too\n",
                 getuid());
  }
  int status = 0;
  for (const std::string& attack : o.attacks) {
    // The same victims without the attack, just before.
    std::atomic<bool> stop{false};
    std::thread timer([&] {
      std::this_thread::sleep_for(std::chrono::duration<double>(o.window_seconds));
      stop = true;
    });
    VictimStats quiet = RunVictims(o, &stop);
    timer.join();

    const long before = RssAnonKiB(o.daemon_pid);
    std::atomic<long> peak{before};
    std::atomic<bool> attack_done{false};
    std::thread sampler([&] {
      while (!attack_done.load()) {
        peak = std::max(peak.load(), RssAnonKiB(o.daemon_pid));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
    stop = false;
    AttackResult result;
    std::thread attacker([&] {
      result = RunAttack(o, attack);
      attack_done = true;
    });
    // The victims run while the attack does, and at least one window.
    const auto started = Clock::now();
    std::thread stopper([&] {
      while (!attack_done.load() ||
             Clock::now() - started < std::chrono::duration<double>(o.window_seconds)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      stop = true;
    });
    VictimStats attacked = RunVictims(o, &stop);
    stopper.join();
    attacker.join();
    sampler.join();
    std::this_thread::sleep_for(std::chrono::seconds(2));
    const long after = RssAnonKiB(o.daemon_pid);
    if (!result.error.empty()) {
      std::fprintf(stderr, "memoffload-bench edge: %s: %s\n", attack.c_str(), result.error.c_str());
      status = 1;
      continue;
    }
    const double p99_quiet = quiet.Percentile(0.99);
    const double p99_attacked = attacked.Percentile(0.99);
    std::printf(
        "{\"bench\":\"edge\",\"attack\":\"%s\",\"attacker_uid\":%d,\"closed_by_daemon\":%s,"
        "\"attack_seconds\":%.3f,"
        "\"bytes_sent\":%llu,\"frames_sent\":%llu,\"rss_anon_before_kib\":%ld,"
        "\"rss_anon_peak_kib\":%ld,\"rss_anon_after_kib\":%ld,\"rss_anon_growth_after_mib\":%.1f,"
        "\"victim_calls_quiet\":%zu,\"victim_calls_attacked\":%zu,\"victim_errors\":%llu,"
        "\"victim_p50_us_quiet\":%.1f,\"victim_p50_us_attacked\":%.1f,"
        "\"victim_p99_us_quiet\":%.1f,\"victim_p99_us_attacked\":%.1f,"
        "\"victim_p99_ratio\":%.2f}\n",
        attack.c_str(), o.attacker_uid, result.closed_by_daemon ? "true" : "false", result.seconds,
        static_cast<unsigned long long>(result.bytes_sent),
        static_cast<unsigned long long>(result.frames_sent), before, peak.load(), after,
        static_cast<double>(after - before) / 1024.0, quiet.latencies_us.size(),
        attacked.latencies_us.size(),
        static_cast<unsigned long long>(quiet.errors + attacked.errors), quiet.Percentile(0.5),
        attacked.Percentile(0.5), p99_quiet, p99_attacked,
        p99_quiet > 0 ? p99_attacked / p99_quiet : 0.0);
    std::fflush(stdout);
  }
  return status;
}

}  // namespace memoffload::bench
