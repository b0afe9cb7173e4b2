// Issue 29 item 3: a second uid the daemon allows speaks raw HTTP/2 to the
// gRPC socket (bench/h2_peer.h). Before the edge relay, gRPC 1.51 kept
// ~19.5 KiB per HEADERS+RST_STREAM pair and ~2x the bytes of an unfinished
// header block, after the attacker left, and never closed the connection.
// Now the connection is closed, the daemon's RssAnon is back within 64 MiB
// of where it was 2 s after the attacker is gone, and other clients go on.
// (Sized down for CI; `memoffload-bench edge` runs the full sizes and prints
// the victims' p99 next to a window without the attack.)
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "daemon_process.h"
#include "h2_peer.h"
#include "memoffload/client/client.h"
#include "memoffload/common/runtime_dir.h"

namespace memoffload::testing {
namespace {

constexpr uid_t kAttacker = 65534;
constexpr long kMaxGrowthKiB = 64 * 1024;

// Under AddressSanitizer (scripts/sanitize.sh builds the daemon and this
// test with it) freed memory waits in ASan's quarantine (256 MiB) instead of
// going back: the RssAnon bound is checked in the plain build only.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kHeapReturnsMemory = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kHeapReturnsMemory = false;
#else
constexpr bool kHeapReturnsMemory = true;
#endif
#else
constexpr bool kHeapReturnsMemory = true;
#endif

long RssAnonKiB(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stol(line.substr(8));
  }
  return -1;
}

std::unique_ptr<DaemonProcess> StartOpenDaemon() {
  DaemonProcess::Options options;
  options.open_permissions = true;
  options.metrics_address = "127.0.0.1:0";
  options.extra_args = {"--allowed-uids=" + std::to_string(kAttacker)};
  std::string error;
  auto daemon = DaemonProcess::Start(options, &error);
  EXPECT_NE(daemon, nullptr) << error;
  return daemon;
}

// memoffload_grpc_connections_closed_total{reason=...} as scraped, or -1.
long ClosedCount(const DaemonProcess& daemon, const std::string& reason) {
  const std::string addr = daemon.Status().metrics_address();
  if (addr.empty()) return -1;
  const std::string body = HttpGet(std::stoi(addr.substr(addr.rfind(':') + 1)), "/metrics");
  const std::string series = "memoffload_grpc_connections_closed_total{reason=\"" + reason + "\"} ";
  const size_t at = body.find(series);
  if (at == std::string::npos) return -1;
  return std::stol(body.substr(at + series.size()));
}

// A full cycle by a client of the daemon's own uid.
bool VictimCycle(const std::string& runtime_dir) {
  client::AttachOptions options;
  options.runtime_dir = runtime_dir;
  auto c = client::Client::Attach(options);
  if (!c.ok()) return false;
  return (*c)->Reserve(1, 1 << 20).ok() && (*c)->Commit(1, 1 << 20).ok() &&
         (*c)->Prefetch(1).ok() && (*c)->Release(1).ok();
}

void ExpectContained(const char* attack, DaemonProcess& daemon,
                     const std::function<bench::AttackResult(const std::string&)>& run) {
  const std::string socket = daemon.runtime_dir() + "/" + kGrpcSocketName;
  ASSERT_TRUE(VictimCycle(daemon.runtime_dir()));
  const long before = RssAnonKiB(daemon.pid());
  const bench::AttackResult r = bench::RunAsUid(kAttacker, [&] { return run(socket); });
  ASSERT_TRUE(r.error.empty()) << attack << ": " << r.error;
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const long after = RssAnonKiB(daemon.pid());
  std::printf(
      "%s: sent %llu bytes in %llu frames over %.3f s; closed by the daemon: %s; "
      "daemon RssAnon %ld KiB -> %ld KiB 2 s after\n",
      attack, static_cast<unsigned long long>(r.bytes_sent),
      static_cast<unsigned long long>(r.frames_sent), r.seconds, r.closed_by_daemon ? "yes" : "no",
      before, after);
  EXPECT_TRUE(r.closed_by_daemon) << attack << ": the daemon kept the attacker's connection";
  if (kHeapReturnsMemory) {
    EXPECT_LE(after - before, kMaxGrowthKiB)
        << attack << ": RssAnon " << before << " KiB -> " << after << " KiB";
  } else {
    std::printf(
        "%s: RssAnon not checked under AddressSanitizer (its quarantine keeps freed "
        "memory)\n",
        attack);
  }
  EXPECT_TRUE(VictimCycle(daemon.runtime_dir())) << attack;
}

TEST(EdgeAttacks, RapidResetIsClosedAndItsMemoryReturned) {
  auto daemon = StartOpenDaemon();
  ASSERT_NE(daemon, nullptr);
  ExpectContained("rapid reset", *daemon,
                  [](const std::string& socket) { return bench::RapidReset(socket, 20000); });
  EXPECT_NE(daemon->Log().find("(resets)"), std::string::npos) << daemon->Log();
  EXPECT_EQ(ClosedCount(*daemon, "resets"), 1) << daemon->Log();
  EXPECT_EQ(ClosedCount(*daemon, "header_block"), 0);
}

TEST(EdgeAttacks, ContinuationFloodIsClosedAndItsMemoryReturned) {
  auto daemon = StartOpenDaemon();
  ASSERT_NE(daemon, nullptr);
  ExpectContained("CONTINUATION flood", *daemon, [](const std::string& socket) {
    return bench::ContinuationFlood(socket, 64 << 20);
  });
  EXPECT_NE(daemon->Log().find("(header_block)"), std::string::npos) << daemon->Log();
  EXPECT_EQ(ClosedCount(*daemon, "header_block"), 1) << daemon->Log();
}

TEST(EdgeAttacks, TrickledHeaderIsClosed) {
  auto daemon = StartOpenDaemon();
  ASSERT_NE(daemon, nullptr);
  ExpectContained("trickled header", *daemon,
                  [](const std::string& socket) { return bench::TrickledHeader(socket, 2, 5.0); });
}

// The uid that broke a rule waits before it may connect again; others do
// not (here: the daemon's own uid).
TEST(EdgeAttacks, TheOffendingUidIsRefusedForAWhileAndOthersAreNot) {
  auto daemon = StartOpenDaemon();
  ASSERT_NE(daemon, nullptr);
  const std::string socket = daemon->runtime_dir() + "/" + kGrpcSocketName;
  const bench::AttackResult first =
      bench::RunAsUid(kAttacker, [&] { return bench::RapidReset(socket, 2000); });
  ASSERT_TRUE(first.closed_by_daemon) << first.error;
  // Once the daemon has counted the strike (its event loop may take it
  // after the attacker saw the close), the uid's next connection, well
  // within the strike's second, is refused.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (daemon->Log().find("broke the HTTP/2 rules") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const bench::AttackResult again = bench::RunAsUid(kAttacker, [&] {
    bench::AttackResult r;
    auto peer = bench::H2Peer::Connect(socket);
    r.closed_by_daemon = !peer.ok() || (*peer)->WaitClosed(2000);
    return r;
  });
  EXPECT_TRUE(again.closed_by_daemon) << daemon->Log();
  EXPECT_TRUE(VictimCycle(daemon->runtime_dir()));
  EXPECT_NE(daemon->Log().find("HTTP/2 rules; refused for"), std::string::npos) << daemon->Log();
}

}  // namespace
}  // namespace memoffload::testing
