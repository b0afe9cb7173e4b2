// A daemon restart under a live client (issue 13 item 7), C++ level: the
// client's session is gone, which its calls say as UNAVAILABLE (attach
// again), never as NOT_FOUND; a group committed before the restart is read
// back from the process's own mapping; a new Client attaches to the new
// instance and offloads again. (The torch-level test, restart between
// steps and between forward and backward, lives in tests/python.)
#include <gtest/gtest.h>
#include <signal.h>

#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"

namespace memoffload::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

class Restart : public ::testing::TestWithParam<bool> {};

TEST_P(Restart, CommittedGroupReadsBackAfterRestartAndNewSessionsOffloadAgain) {
  const bool checksums = GetParam();
  std::string error;
  DaemonProcess::Options options;
  options.arena_size = "64MiB";
  options.chunk_size = "16MiB";
  auto first = DaemonProcess::Start(options, &error);
  ASSERT_NE(first, nullptr) << error;

  client::AttachOptions attach;
  attach.runtime_dir = first->runtime_dir();
  attach.checksums = checksums;
  auto c = client::Client::Attach(attach);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  client::Client* client = c->get();
  // Group 1 committed (forward done, backward pending); group 2 committed
  // and prefetched (being read); group 3 only reserved.
  std::vector<uint8_t> one(3 * kMiB + 17), two(kMiB);
  for (size_t i = 0; i < one.size(); ++i) one[i] = static_cast<uint8_t>(i * 7 + 1);
  for (size_t i = 0; i < two.size(); ++i) two[i] = static_cast<uint8_t>(i * 13 + 5);
  auto r1 = client->Reserve(1, one.size());
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  ASSERT_TRUE(client->Write(r1->extents, 0, one.data(), one.size()).ok());
  ASSERT_TRUE(client->Commit(1, one.size()).ok());
  auto r2 = client->Reserve(2, two.size());
  ASSERT_TRUE(r2.ok());
  ASSERT_TRUE(client->Write(r2->extents, 0, two.data(), two.size()).ok());
  ASSERT_TRUE(client->Commit(2, two.size()).ok());
  ASSERT_TRUE(client->Prefetch(2).ok());
  ASSERT_TRUE(client->Reserve(3, kMiB).ok());
  const uint64_t old_instance = client->instance_id();
  EXPECT_FALSE(client->session_lost());

  // The daemon dies and a new one starts on the same runtime dir.
  first->Stop(SIGKILL, 10000);
  options.runtime_dir = first->runtime_dir();
  auto second = DaemonProcess::Start(options, &error);
  ASSERT_NE(second, nullptr) << error;

  // The old session is gone: UNAVAILABLE (attach again), not NOT_FOUND.
  auto refused = client->Reserve(4, kMiB);
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().ToString();
  EXPECT_TRUE(client->session_lost());
  EXPECT_EQ(client->Commit(3, kMiB).status().code(), StatusCode::kUnavailable);

  // The committed group reads back from this process's own mapping, byte
  // for byte (checksums verified when it was committed with them).
  auto p1 = client->Prefetch(1);
  ASSERT_TRUE(p1.ok()) << p1.status().ToString();
  EXPECT_EQ(p1->used_bytes, one.size());
  std::vector<uint8_t> back(one.size());
  ASSERT_TRUE(client->Read(p1->extents, 0, back.data(), back.size()).ok());
  EXPECT_TRUE(back == one) << "group 1 changed across the restart";
  EXPECT_TRUE(client->Release(1).ok());
  EXPECT_TRUE(client->Release(2).ok());  // was being read: nothing left to release
  EXPECT_TRUE(client->Release(3).ok());
  // A group that was only reserved was never committed: not readable.
  EXPECT_EQ(client->Prefetch(3).status().code(), StatusCode::kUnavailable);

  // A new session on the new instance offloads again.
  auto fresh = client::Client::Attach(attach);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_NE((*fresh)->instance_id(), old_instance);
  auto r = (*fresh)->Reserve(1, one.size());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE((*fresh)->Write(r->extents, 0, one.data(), one.size()).ok());
  ASSERT_TRUE((*fresh)->Commit(1, one.size()).ok());
  auto p = (*fresh)->Prefetch(1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  std::vector<uint8_t> again(one.size());
  ASSERT_TRUE((*fresh)->Read(p->extents, 0, again.data(), again.size()).ok());
  EXPECT_TRUE(again == one);
  ASSERT_TRUE((*fresh)->Release(1).ok());
  // The old client's mapping is still its own: reading it again is fine.
  ASSERT_TRUE(client->Read(p1->extents, 0, back.data(), back.size()).ok());
  EXPECT_TRUE(back == one);
}

INSTANTIATE_TEST_SUITE_P(Checksums, Restart, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "with_checksums" : "plain");
                         });

}  // namespace
}  // namespace memoffload::testing
