// memoffload-bench attach [--arena-size SIZE] [--write-size SIZE]
//                         [--attach-samples N] [--hugepages] [--json]
//
// Starts the real memoffloadd (the binary next to this one) with a temporary
// runtime dir, then measures in the same run:
//  - attach_ms / attach_p99_ms: p50 and p99 of N fresh clients from connect
//    to the first writable extent, next to attach_floor_ms /
//    attach_floor_p99_ms, a raw Unix-socket connect+sendmsg+reply
//    (attach_latency.cc).
//  - first_write_gbps: a fresh client attaches, reserves write-size bytes and
//    writes them with Client::Write (64 MiB source buffer, repeated); timed
//    from Attach to the end of the writes, so all mapping work counts.
//  - baselines: memcpy of the same pattern into already-faulted private
//    memory (prefaulted_memcpy_gbps) and into fresh private memory
//    (fresh_private_write_gbps).
//  - the mapping alternatives: lazy_first_write_gbps (one write fault per
//    page) and map_populate_first_write_gbps (MAP_POPULATE of each chunk when
//    it is mapped), and rewrite_gbps (second write into the same extents).
// Write measurements run 3 rounds, interleaved; each metric is the median.
// --hugepages starts the daemon with --hugepages (MFD_HUGETLB chunks); where
// too few hugepages are free the daemon falls back to 4 KiB pages, and the
// result says so (hugepage_fallback, from the daemon's log).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
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

#include "attach_latency.h"
#include "benches.h"
#include "memoffload/client/daemon_status.h"
#include "memoffload/common/units.h"

namespace memoffload::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kSourceBytes = 64 * kMiB;
constexpr int kWriteRounds = 3;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string BinDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// The daemon child process; stopped with SIGTERM (then SIGKILL) on scope exit.
class Daemon {
 public:
  ~Daemon() { Stop(); }

  bool Start(const std::string& binary, const std::string& runtime_dir,
             const std::string& arena_size, const std::string& log_path, bool hugepages) {
    pid_ = fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (log >= 0) {
        dup2(log, STDOUT_FILENO);
        dup2(log, STDERR_FILENO);
      }
      const std::string dir_flag = "--runtime-dir=" + runtime_dir;
      const std::string size_flag = "--arena-size=" + arena_size;
      execl(binary.c_str(), binary.c_str(), dir_flag.c_str(), size_flag.c_str(),
            "--metrics-address=none", hugepages ? "--hugepages" : "--log-level=info",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    return true;
  }

  bool Alive() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
    return true;
  }

  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Copies `bytes` from the source buffer into dst in source-sized pieces.
double TimeCopy(uint8_t* dst, uint64_t bytes, const uint8_t* src) {
  const auto start = Clock::now();
  for (uint64_t off = 0; off < bytes; off += kSourceBytes) {
    std::memcpy(dst + off, src, std::min(kSourceBytes, bytes - off));
  }
  return static_cast<double>(bytes) / 1e9 / SecondsSince(start);
}

struct WriteResult {
  double first_gbps = -1;
  double rewrite_gbps = -1;
};

// A fresh client reserves `bytes` and writes them twice; see the file comment.
Result<WriteResult> MeasureWrites(client::AttachOptions options, uint64_t bytes,
                                  const uint8_t* src) {
  auto start = Clock::now();
  Result<std::unique_ptr<client::Client>> c = client::Client::Attach(options);
  if (!c.ok()) return c.status();
  client::Client& cl = **c;
  WriteResult result;
  Result<client::Reservation> r = cl.Reserve(1, bytes);
  if (!r.ok()) return r.status();
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) start = Clock::now();
    for (uint64_t off = 0; off < bytes; off += kSourceBytes) {
      MEMOFFLOAD_RETURN_IF_ERROR(
          cl.Write(r->extents, off, src, std::min(kSourceBytes, bytes - off)));
    }
    const double gbps = static_cast<double>(bytes) / 1e9 / SecondsSince(start);
    (pass == 0 ? result.first_gbps : result.rewrite_gbps) = gbps;
  }
  MEMOFFLOAD_RETURN_IF_ERROR(cl.Release(1));
  return result;
}

// Whether the daemon's log says --hugepages fell back to 4 KiB pages.
bool LogSaysHugepageFallback(const std::string& log_path) {
  FILE* f = std::fopen(log_path.c_str(), "r");
  if (f == nullptr) return false;
  char line[1024];
  bool fallback = false;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strstr(line, "--hugepages: using normal pages") != nullptr) fallback = true;
  }
  std::fclose(f);
  return fallback;
}

// Everything after the daemon is up; returns the exit code.
int MeasureAll(const client::AttachOptions& options, const std::string& scratch_dir,
               int attach_samples, uint64_t arena_bytes, uint64_t write_bytes, bool json,
               bool hugepages, bool hugepage_fallback) {
  // The pages the daemon's arena got (what the kernel gave, as it reports).
  Result<client::DaemonStatus> status = client::QueryDaemonStatus(options.runtime_dir);
  const std::string pages = status.ok() ? status->pages : "unknown";
  Result<AttachLatency> latency = MeasureAttachLatency(options, scratch_dir, attach_samples);
  if (!latency.ok()) {
    std::fprintf(stderr, "attach: %s\n", latency.status().ToString().c_str());
    return 1;
  }

  // Source buffer, faulted and warm.
  std::vector<uint8_t> src(kSourceBytes);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131);

  // Rounds of every write measurement, interleaved so that load from other
  // processes hits all of them alike; each metric is the median of its rounds.
  std::vector<double> prefaulted_v, fresh_v, ours_v, rewrite_v, lazy_v, populate_v;
  for (int round = 0; round < kWriteRounds; ++round) {
    void* priv = mmap(nullptr, write_bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    void* fresh =
        mmap(nullptr, write_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (priv == MAP_FAILED || fresh == MAP_FAILED) {
      std::fprintf(stderr, "attach: mmap of %s failed\n", FormatSize(write_bytes).c_str());
      return 1;
    }
    std::memset(priv, 0, write_bytes);  // faulted for writing
    prefaulted_v.push_back(TimeCopy(static_cast<uint8_t*>(priv), write_bytes, src.data()));
    munmap(priv, write_bytes);
    fresh_v.push_back(TimeCopy(static_cast<uint8_t*>(fresh), write_bytes, src.data()));
    munmap(fresh, write_bytes);

    // Client writes: our default, then the alternatives.
    Result<WriteResult> ours = MeasureWrites(options, write_bytes, src.data());
    client::AttachOptions lazy = options;
    lazy.populate_on_first_use = false;
    Result<WriteResult> lazy_result = MeasureWrites(lazy, write_bytes, src.data());
    client::AttachOptions populate = options;
    populate.populate = true;
    Result<WriteResult> populate_result = MeasureWrites(populate, write_bytes, src.data());
    for (const auto* r : {&ours, &lazy_result, &populate_result}) {
      if (!r->ok()) {
        std::fprintf(stderr, "attach: writing through the client failed: %s\n",
                     r->status().ToString().c_str());
        return 1;
      }
    }
    ours_v.push_back(ours->first_gbps);
    rewrite_v.push_back(ours->rewrite_gbps);
    lazy_v.push_back(lazy_result->first_gbps);
    populate_v.push_back(populate_result->first_gbps);
  }
  const double prefaulted = Median(prefaulted_v);
  const double fresh_private = Median(fresh_v);
  const double first_write = Median(ours_v);
  const AttachLatency& a = *latency;
  if (json) {
    std::printf(
        "{\"bench\":\"attach\",\"arena_bytes\":%llu,\"write_bytes\":%llu,"
        "\"attach_samples\":%d,\"attach_ms\":%.3f,\"attach_p99_ms\":%.3f,\"attach_call_ms\":%.3f,"
        "\"attach_floor_ms\":%.4f,\"attach_floor_p99_ms\":%.4f,\"attach_floor_ratio\":%.1f,"
        "\"first_write_gbps\":%.3f,\"prefaulted_memcpy_gbps\":%.3f,"
        "\"fresh_private_write_gbps\":%.3f,\"ratio\":%.3f,\"rewrite_gbps\":%.3f,"
        "\"lazy_first_write_gbps\":%.3f,\"map_populate_first_write_gbps\":%.3f,"
        "\"hugepages\":%s,\"hugepage_fallback\":%s,\"pages\":\"%s\"}\n",
        static_cast<unsigned long long>(arena_bytes), static_cast<unsigned long long>(write_bytes),
        a.samples, a.p50_ms, a.p99_ms, a.call_p50_ms, a.floor_p50_ms, a.floor_p99_ms,
        a.p50_ms / a.floor_p50_ms, first_write, prefaulted, fresh_private, first_write / prefaulted,
        Median(rewrite_v), Median(lazy_v), Median(populate_v), hugepages ? "true" : "false",
        hugepage_fallback ? "true" : "false", pages.c_str());
  } else {
    std::printf("arena %s on %s%s, writes of %s\n", FormatSize(arena_bytes).c_str(), pages.c_str(),
                hugepages && hugepage_fallback ? " (--hugepages fell back to 4 KiB pages)" : "",
                FormatSize(write_bytes).c_str());
    std::printf(
        "attach to the first writable extent: p50 %.3f ms, p99 %.3f ms (%d samples; Attach "
        "alone p50 %.3f ms); raw Unix socket connect+sendmsg+reply: p50 %.4f ms, p99 %.4f ms\n",
        a.p50_ms, a.p99_ms, a.samples, a.call_p50_ms, a.floor_p50_ms, a.floor_p99_ms);
    std::printf("first write (populate on first use): %.2f GB/s = %.2f of prefaulted memcpy\n",
                first_write, first_write / prefaulted);
    std::printf("  lazy (fault per page): %.2f GB/s, MAP_POPULATE per chunk: %.2f GB/s\n",
                Median(lazy_v), Median(populate_v));
    std::printf("memcpy into prefaulted private memory: %.2f GB/s, into fresh: %.2f GB/s\n",
                prefaulted, fresh_private);
  }
  return 0;
}

void PrintUsage() {
  std::fprintf(stderr,
               "usage: memoffload-bench attach [--arena-size SIZE] [--write-size SIZE]\n"
               "                               [--attach-samples N] [--hugepages] [--json]\n"
               "Starts memoffloadd (next to this binary) with a temporary runtime dir and\n"
               "measures attach latency (p50/p99 of N, next to a raw Unix-socket floor) and\n"
               "first-write bandwidth next to private-memory baselines. Defaults: 4GiB arena,\n"
               "write min(arena/4, 1GiB), 200 attach samples. --hugepages: the daemon's\n"
               "arena on hugepages (it falls back to 4 KiB pages, and says so, without).\n");
}

}  // namespace

int RunAttachBench(int argc, char** argv) {
  bool json = false;
  bool hugepages = false;
  uint64_t arena_bytes = 4 * kGiB;
  uint64_t write_bytes = 0;
  int attach_samples = 200;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--json") == 0) {
      json = true;
    } else if (std::strcmp(a, "--hugepages") == 0) {
      hugepages = true;
    } else if ((std::strcmp(a, "--arena-size") == 0 || std::strcmp(a, "--write-size") == 0) &&
               i + 1 < argc) {
      Result<uint64_t> r = ParseSize(argv[++i]);
      if (!r.ok() || *r == 0) {
        std::fprintf(stderr, "attach: %s wants a size like 4GiB, got '%s'\n", a, argv[i]);
        return 2;
      }
      (a[2] == 'a' ? arena_bytes : write_bytes) = *r;
    } else if (std::strcmp(a, "--attach-samples") == 0 && i + 1 < argc) {
      attach_samples = std::atoi(argv[++i]);
      if (attach_samples < 1 || attach_samples > 100000) {
        std::fprintf(stderr, "attach: --attach-samples wants 1..100000, got '%s'\n", argv[i]);
        return 2;
      }
    } else if (std::strcmp(a, "--help") == 0) {
      PrintUsage();
      return 0;
    } else {
      std::fprintf(stderr, "attach: unknown flag '%s'\n", a);
      PrintUsage();
      return 2;
    }
  }
  if (write_bytes == 0) write_bytes = std::min(arena_bytes / 4, kGiB);
  write_bytes = std::min(write_bytes, arena_bytes) / kMiB * kMiB;

  char dir_template[] = "/tmp/memoffload-attach-bench-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) {
    std::fprintf(stderr, "attach: mkdtemp failed: %s\n", std::strerror(errno));
    return 1;
  }
  const std::string scratch = dir_template;
  const std::string runtime_dir = scratch + "/run";
  const std::string log_path = scratch + "/memoffloadd.log";
  const std::string binary = BinDir() + "/memoffloadd";
  auto cleanup = [&] {
    unlink(log_path.c_str());
    rmdir(runtime_dir.c_str());
    rmdir(scratch.c_str());
  };
  if (access(binary.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "attach: %s not found (build the memoffloadd target)\n", binary.c_str());
    cleanup();
    return 1;
  }
  int rc = 1;
  {
    Daemon daemon;
    if (!daemon.Start(binary, runtime_dir, std::to_string(arena_bytes), log_path, hugepages)) {
      std::fprintf(stderr, "attach: fork failed\n");
      cleanup();
      return 1;
    }
    client::AttachOptions options;
    options.runtime_dir = runtime_dir;
    options.job_id = "attach-bench";
    // Wait for the daemon to serve (it builds the arena first).
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    bool up = false;
    while (!up && Clock::now() < deadline && daemon.Alive()) {
      up = client::Client::Attach(options).ok();
      if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!up) {
      std::fprintf(stderr, "attach: memoffloadd did not come up; its log (%s):\n",
                   log_path.c_str());
      if (FILE* f = std::fopen(log_path.c_str(), "r")) {
        char line[512];
        while (std::fgets(line, sizeof(line), f) != nullptr) std::fputs(line, stderr);
        std::fclose(f);
      }
      daemon.Stop();
      cleanup();
      return 1;
    }

    rc = MeasureAll(options, scratch, attach_samples, arena_bytes, write_bytes, json, hugepages,
                    hugepages && LogSaysHugepageFallback(log_path));
  }
  cleanup();
  return rc;
}

}  // namespace memoffload::bench
