// Kill soak: N client processes run checksummed offload cycles against the
// real daemon while a chaos loop SIGKILLs random clients and starts new ones.
// At the end nothing is held, every completed read matched, the daemon's
// anonymous memory did not grow beyond a bound, and no unexpected error was
// seen. SOAK_SECONDS (default 60) and SOAK_CLIENTS (default 16) tune it.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "daemon_process.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

using Clock = std::chrono::steady_clock;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' ? std::atoi(v) : fallback;
}

// RssAnon of a process in KiB: the daemon's own heap, not the shared arena.
long RssAnonKiB(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  long value = -1;
  while (in >> key) {
    if (key == "RssAnon:") {
      in >> value;
      return value;
    }
    std::getline(in, key);
  }
  return -1;
}

// Lines of the daemon's log at WARN or ERROR level other than those a
// SIGKILLed client can cause: it died before sending its hello, while being
// sent the chunk table, or while being sent chunk fds; and the start-up
// warning when the arena cannot be mlock'ed (unprivileged CI).
std::string UnexpectedLogLines(const std::string& log) {
  static const char* const kExpected[] = {
      "no hello within",
      "failed while sending the chunk table",
      "sending chunk fds failed",
      "mlock failed",
  };
  std::string out;
  std::istringstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    const bool error = line.find("] ERROR ") != std::string::npos;
    const bool warn = line.find("] WARN ") != std::string::npos;
    if (!error && !warn) continue;
    bool expected = false;
    for (const char* e : kExpected)
      expected = expected || (warn && line.find(e) != std::string::npos);
    if (!expected) out += line + "\n";
  }
  return out;
}

struct Worker {
  pid_t pid;
  int out_fd;
};

std::string ReadAll(int fd) {
  std::string s;
  char buf[512];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) s.append(buf, static_cast<size_t>(n));
  close(fd);
  return s;
}

TEST(Soak, ClientsKilledAtRandomLoseNothingAndLeakNothing) {
  const int seconds = EnvInt("SOAK_SECONDS", 60);
  const int clients = EnvInt("SOAK_CLIENTS", 16);
  constexpr long kRssGrowthBoundKiB = 32 * 1024;

  std::string error;
  DaemonProcess::Options options;
  options.arena_size = "512MiB";
  options.chunk_size = "64MiB";
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;

  uint64_t next_seed = 1;
  auto start_worker = [&](int run_seconds) {
    int fd = -1;
    pid_t pid = Spawn({BinDir() + "/offload_worker", "soak", daemon->runtime_dir(),
                       std::to_string(next_seed++), std::to_string(run_seconds)},
                      &fd);
    return Worker{pid, fd};
  };
  std::map<pid_t, Worker> live;
  for (int i = 0; i < clients; ++i) {
    Worker w = start_worker(seconds);
    live[w.pid] = w;
  }
  std::this_thread::sleep_for(std::chrono::seconds(std::min(3, seconds / 4)));
  const long rss_start = RssAnonKiB(daemon->pid());

  std::mt19937 rng(42);
  int killed = 0;
  const auto end = Clock::now() + std::chrono::seconds(seconds - 5);
  while (Clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(150 + rng() % 200));
    auto it = live.begin();
    std::advance(it, rng() % live.size());
    kill(it->first, SIGKILL);
    WaitFor(it->first, 5000);
    close(it->second.out_fd);
    live.erase(it);
    ++killed;
    const int left =
        static_cast<int>(
            std::chrono::duration_cast<std::chrono::seconds>(end - Clock::now()).count()) +
        2;
    Worker w = start_worker(std::max(1, left));
    live[w.pid] = w;
  }

  uint64_t verified = 0, cycles = 0;
  for (auto& [pid, w] : live) {
    const std::string out = ReadAll(w.out_fd);
    const int status = WaitFor(pid, 60000);
    ASSERT_NE(status, -1) << "soak worker " << pid << " did not finish";
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "soak worker failed: " << out << "\n"
        << daemon->Log().substr(0, 4000);
    unsigned long c = 0, v = 0, x = 0;
    if (std::sscanf(out.c_str(), "DONE cycles=%lu verified=%lu exhausted=%lu", &c, &v, &x) == 3) {
      cycles += c;
      verified += v;
    }
  }
  EXPECT_GT(killed, 0);
  EXPECT_GT(verified, 0u);

  // Everything comes back once the last clients are gone.
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  v1::GetStatusResponse s = daemon->Status();
  while ((s.used_bytes() != 0 || s.sessions() != 0) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    s = daemon->Status();
  }
  EXPECT_EQ(s.used_bytes(), 0u);
  EXPECT_EQ(s.sessions(), 0u);
  EXPECT_EQ(s.groups(), 0u);
  const long rss_end = RssAnonKiB(daemon->pid());
  EXPECT_LT(rss_end - rss_start, kRssGrowthBoundKiB)
      << "daemon anonymous RSS grew from " << rss_start << " KiB to " << rss_end << " KiB";
  std::printf(
      "soak: %d s, %d clients, %d killed, %lu cycles verified (%lu completed), daemon "
      "RssAnon %ld -> %ld KiB\n",
      seconds, clients, killed, static_cast<unsigned long>(verified),
      static_cast<unsigned long>(cycles), rss_start, rss_end);
  const int status = daemon->Stop(SIGTERM, 10000);
  EXPECT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "daemon wait status " << status << "\n"
      << daemon->Log().substr(0, 4000);
  const std::string unexpected = UnexpectedLogLines(daemon->Log());
  EXPECT_EQ(unexpected, "") << "the daemon logged errors the soak does not expect";
}

}  // namespace
}  // namespace memoffload::testing
