// One memoffload::client::Client shared by several threads against the real
// daemon: concurrent Reserve/Write/Commit/Prefetch/Read/Release on disjoint
// groups, with chunks mapped on demand (a fresh daemon hands a new tenant no
// chunk at attach, so every chunk is first mapped by whichever thread's
// reservation lands there) and pages populated on first use. Built as its own
// binary so scripts/sanitize.sh runs it under ThreadSanitizer.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {
namespace {

constexpr uint64_t kKiB = 1 << 10;
constexpr uint64_t kMiB = 1 << 20;

class ClientThreads : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    std::string error;
    DaemonProcess::Options options;
    options.arena_size = "96MiB";
    options.chunk_size = "4MiB";  // 24 chunks, each mapped on first use
    daemon_ = DaemonProcess::Start(options, &error);
    ASSERT_NE(daemon_, nullptr) << error;
    client::AttachOptions attach;
    attach.runtime_dir = daemon_->runtime_dir();
    attach.checksums = GetParam();
    auto c = client::Client::Attach(attach);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

// Runs `cycles` offload cycles on groups thread * 1'000'000 + i; returns ""
// or the first failure.
std::string Cycles(client::Client* c, int thread, int cycles, uint64_t max_bytes) {
  std::mt19937_64 rng(1000 + thread);
  std::vector<uint8_t> data, back;
  for (int i = 0; i < cycles; ++i) {
    const uint64_t group = static_cast<uint64_t>(thread) * 1000000 + i;
    const uint64_t size = 1 + rng() % max_bytes;
    data.resize(size);
    for (size_t k = 0; k < size; k += 8) {
      const uint64_t v = rng();
      std::memcpy(data.data() + k, &v, std::min<size_t>(8, size - k));
    }
    auto r = c->Reserve(group, size, client::ReserveOptions{false, true, 20000});
    if (!r.ok()) return "reserve " + std::to_string(group) + ": " + r.status().ToString();
    if (Status st = c->Write(r->extents, 0, data.data(), size); !st.ok()) {
      return "write: " + st.ToString();
    }
    auto cm = c->Commit(group, size);
    if (!cm.ok()) return "commit: " + cm.status().ToString();
    auto p = c->Prefetch(group);
    if (!p.ok()) return "prefetch: " + p.status().ToString();
    if (p->used_bytes != size) return "prefetch: used_bytes " + std::to_string(p->used_bytes);
    back.assign(size, 0);
    if (Status st = c->Read(p->extents, 0, back.data(), size); !st.ok()) {
      return "read: " + st.ToString();
    }
    if (back != data) return "group " + std::to_string(group) + " came back different";
    if (Status st = c->Release(group); !st.ok()) return "release: " + st.ToString();
  }
  return "";
}

TEST_P(ClientThreads, DisjointGroupsFromEightThreadsAllReadBack) {
  constexpr int kThreads = 8;
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] { errors[t] = Cycles(client_.get(), t, 25, 2 * kMiB); });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  v1::GetStatusResponse s = daemon_->Status();
  EXPECT_EQ(s.used_bytes(), 0u);
  EXPECT_EQ(s.groups(), 0u);
}

TEST_P(ClientThreads, FirstUseOfTheSameChunksRacesSafely) {
  // Every thread's first reservation is small and lands in the first chunk
  // at about the same time: they race to map it (and populate its pages).
  constexpr int kThreads = 8;
  std::atomic<int> ready{0};
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      errors[t] = Cycles(client_.get(), t, 10, 64 * kKiB);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
}

TEST_P(ClientThreads, AddressAndMapChunksWhileOthersOffload) {
  // One thread keeps asking for every chunk's mapping and address while
  // others reserve into them.
  std::atomic<bool> stop{false};
  std::string mapper_error;
  std::thread mapper([&] {
    while (!stop.load()) {
      for (uint32_t chunk = 0; chunk < client_->chunk_count(); ++chunk) {
        Status st = client_->MapChunks({chunk});
        // Chunks no tenant owns yet are refused; that is the only refusal.
        if (!st.ok() && st.code() != StatusCode::kPermissionDenied) {
          mapper_error = st.ToString();
          return;
        }
        if (st.ok() && client_->Address({chunk, 0, 4096}) == nullptr) {
          mapper_error = "chunk " + std::to_string(chunk) + " mapped but has no address";
          return;
        }
      }
    }
  });
  std::vector<std::string> errors(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] { errors[t] = Cycles(client_.get(), t, 20, kMiB); });
  }
  for (auto& th : threads) th.join();
  stop = true;
  mapper.join();
  EXPECT_EQ(mapper_error, "");
  for (int t = 0; t < 4; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
}

INSTANTIATE_TEST_SUITE_P(Checksums, ClientThreads, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("On") : std::string("Off");
                         });

}  // namespace
}  // namespace memoffload::testing
