// Tenant isolation against the real daemon: another uid cannot obtain this
// tenant's chunk fds nor reach its groups whatever ids it sends, and a chunk
// that changes tenant reads as zeros.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <set>
#include <sstream>
#include <thread>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

// Parses offload_worker tenant-probe output: "REFUSED a,b GOT c,d ZEROS yes".
struct Probe {
  std::set<uint32_t> refused, got;
  bool zeros = false;
};

std::set<uint32_t> ParseList(const std::string& list) {
  std::set<uint32_t> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item != "-") out.insert(static_cast<uint32_t>(std::stoul(item)));
  }
  return out;
}

Probe ParseProbe(const std::string& out) {
  Probe p;
  char refused[256] = {}, got[256] = {}, zeros[8] = {};
  if (std::sscanf(out.c_str(), "REFUSED %255s GOT %255s ZEROS %7s", refused, got, zeros) == 3) {
    p.refused = ParseList(refused);
    p.got = ParseList(got);
    p.zeros = std::string(zeros) == "yes";
  }
  return p;
}

TEST(Tenants, OtherTenantGetsNeitherOurFdsNorOurBytes) {
  std::string error;
  DaemonProcess::Options options = TwoTenantOptions("64MiB", "16MiB");
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;

  // Tenant A (root, this process) fills two chunks with a pattern.
  client::AttachOptions attach;
  attach.runtime_dir = daemon->runtime_dir();
  auto a = client::Client::Attach(attach);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto r = (*a)->Reserve(1, 32 * kMiB);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::vector<uint8_t> pattern(32 * kMiB, 0xAB);
  ASSERT_TRUE((*a)->Write(r->extents, 0, pattern.data(), pattern.size()).ok());
  ASSERT_TRUE((*a)->Commit(1, pattern.size()).ok());
  std::set<uint32_t> a_chunks;
  for (const auto& e : r->extents) a_chunks.insert(e.chunk);

  // Tenant B (uid 65534) is refused A's chunks and gets zeroed memory.
  std::string out;
  ASSERT_EQ(RunCapture({BinDir() + "/offload_worker", "tenant-probe", daemon->runtime_dir(),
                        "65534", std::to_string(16 * kMiB)},
                       &out),
            0)
      << out << daemon->Log();
  Probe first = ParseProbe(out);
  for (uint32_t c : a_chunks) EXPECT_EQ(first.refused.count(c), 1u) << "chunk " << c << ": " << out;
  for (uint32_t c : first.got) EXPECT_EQ(a_chunks.count(c), 0u) << "chunk " << c << ": " << out;
  EXPECT_TRUE(first.zeros) << out;

  // B names A's groups: with A's session id and B's own token
  // (UNAUTHENTICATED), and from its own session (NOT_FOUND). Group 1 is
  // committed, group 2 still reserved (a Commit that got through would
  // change it).
  auto reserved = (*a)->Reserve(2, 4096);
  ASSERT_TRUE(reserved.ok()) << reserved.status().ToString();
  const uint8_t mark = 0x5C;
  ASSERT_TRUE((*a)->Write(reserved->extents, 0, &mark, 1).ok());
  ASSERT_EQ(RunCapture({BinDir() + "/offload_worker", "forge-probe", daemon->runtime_dir(), "65534",
                        std::to_string((*a)->session_id()), "1", "2"},
                       &out),
            0)
      << out << daemon->Log();
  int forged = 0;
  {
    std::istringstream lines(out);
    std::string method, which, group, code;
    while (lines >> method >> which >> group >> code) {
      ++forged;
      EXPECT_EQ(code, which == "a" ? "UNAUTHENTICATED" : "NOT_FOUND")
          << method << " of A's group " << group << " (case " << which << ")";
    }
  }
  EXPECT_EQ(forged, 12) << out;  // 3 methods x 2 cases x 2 groups
  // A's groups are untouched: group 1 reads back, group 2 is still reserved.
  auto p1 = (*a)->Prefetch(1);
  ASSERT_TRUE(p1.ok()) << p1.status().ToString();
  std::vector<uint8_t> back(pattern.size());
  ASSERT_TRUE((*a)->Read(p1->extents, 0, back.data(), back.size()).ok());
  EXPECT_TRUE(back == pattern) << "A's group 1 changed";
  ASSERT_TRUE((*a)->Commit(2, 1).ok()) << "A's group 2 is no longer reserved";
  auto p2 = (*a)->Prefetch(2);
  ASSERT_TRUE(p2.ok());
  uint8_t got = 0;
  ASSERT_TRUE((*a)->Read(p2->extents, 0, &got, 1).ok());
  EXPECT_EQ(got, mark);
  ASSERT_TRUE((*a)->Release(2).ok());

  // A releases everything and goes away; B may now take over A's chunks,
  // and must see zeros, never A's bytes.
  ASSERT_TRUE((*a)->Release(1).ok());
  a->reset();
  const auto start = std::chrono::steady_clock::now();
  while (daemon->Status().sessions() != 0 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(2)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(RunCapture({BinDir() + "/offload_worker", "tenant-probe", daemon->runtime_dir(),
                        "65534", std::to_string(64 * kMiB)},
                       &out),
            0)
      << out << daemon->Log();
  // Until B's reservation takes them over (new memfds), A's old chunks
  // still hold A's bytes, so their fds are still refused; then B's 64 MiB
  // reservation needs every chunk, A's old ones included, and reads zeros.
  Probe second = ParseProbe(out);
  for (uint32_t c : a_chunks) {
    EXPECT_EQ(second.refused.count(c), 1u) << "chunk " << c << ": " << out;
    EXPECT_EQ(second.got.count(c), 1u) << "chunk " << c << ": " << out;
  }
  EXPECT_EQ(second.got.size(), 4u) << out;
  EXPECT_TRUE(second.zeros) << out;
  // Every chunk that changed tenant got a new memfd, and was counted
  // (GetStatus and memoffload_chunk_backings_replaced_total read the same
  // counter).
  v1::GetStatusResponse status = daemon->Status();
  EXPECT_GE(status.replaced_backings(), 3u);
}

}  // namespace
}  // namespace memoffload::testing
