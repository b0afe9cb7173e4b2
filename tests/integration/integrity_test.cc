// Optional CRC32C integrity against the real daemon: a group committed with
// checksums reads back fine, and one flipped byte in the arena is DATA_LOSS
// naming the group, the session, the chunk and the offset.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "daemon_process.h"
#include "memoffload/client/client.h"

namespace memoffload::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

class Integrity : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    DaemonProcess::Options options;
    options.arena_size = "32MiB";
    options.chunk_size = "4MiB";
    daemon_ = DaemonProcess::Start(options, &error);
    ASSERT_NE(daemon_, nullptr) << error;
    client::AttachOptions attach;
    attach.runtime_dir = daemon_->runtime_dir();
    attach.checksums = true;
    auto c = client::Client::Attach(attach);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
  }

  // Offloads `bytes` of a pattern as group `group` (reserve, write, commit
  // with checksums); returns the data, empty on failure.
  std::vector<uint8_t> Offload(uint64_t group, uint64_t bytes) {
    std::vector<uint8_t> data(bytes);
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
    auto r = client_->Reserve(group, bytes);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return {};
    EXPECT_TRUE(client_->Write(r->extents, 0, data.data(), data.size()).ok());
    auto c = client_->Commit(group, bytes);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return data;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(Integrity, UntouchedGroupVerifiesAndReadsBack) {
  // 6 MiB + 100 bytes over 4 MiB chunks: at least two extents, the last one
  // partly used.
  const uint64_t bytes = 6 * kMiB + 100;
  std::vector<uint8_t> data = Offload(5, bytes);
  ASSERT_FALSE(data.empty());
  auto p = client_->Prefetch(5);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_GE(p->extents.size(), 2u);
  EXPECT_EQ(p->extent_crc32c.size(), p->extents.size());
  std::vector<uint8_t> back(bytes);
  ASSERT_TRUE(client_->Read(p->extents, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
  EXPECT_TRUE(client_->Release(5).ok());
}

TEST_F(Integrity, OneFlippedByteIsDataLossNamingGroupSessionChunkAndOffset) {
  const uint64_t bytes = 6 * kMiB + 100;
  ASSERT_FALSE(Offload(9, bytes).empty());
  // Where the daemon keeps the group: ask (a first Prefetch verifies clean).
  auto clean = client_->Prefetch(9);
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  ASSERT_GE(clean->extents.size(), 2u);

  // Corrupt one byte of the second extent through this process's mapping.
  const Extent& e = clean->extents[1];
  uint8_t* p = client_->Address(e);
  ASSERT_NE(p, nullptr);
  const uint64_t at = std::min<uint64_t>(4096, e.length - 1);
  p[at] ^= 0x01;

  auto corrupt = client_->Prefetch(9);
  ASSERT_FALSE(corrupt.ok()) << "a flipped byte passed the checksum";
  EXPECT_EQ(corrupt.status().code(), StatusCode::kDataLoss) << corrupt.status().ToString();
  const std::string& m = corrupt.status().message();
  EXPECT_NE(m.find("group 9"), std::string::npos) << m;
  EXPECT_NE(m.find("session " + std::to_string(client_->session_id())), std::string::npos) << m;
  EXPECT_NE(m.find("chunk " + std::to_string(e.chunk)), std::string::npos) << m;
  EXPECT_NE(m.find("offset " + std::to_string(e.offset)), std::string::npos) << m;
  EXPECT_NE(m.find("extent 1"), std::string::npos) << m;

  // Flipping it back makes the group whole again; the error was no guess.
  p[at] ^= 0x01;
  EXPECT_TRUE(client_->Prefetch(9).ok());
  EXPECT_TRUE(client_->Release(9).ok());
}

TEST_F(Integrity, FlippedByteInThePartlyUsedLastExtentIsCaught) {
  const uint64_t bytes = 6 * kMiB + 100;
  ASSERT_FALSE(Offload(3, bytes).empty());
  auto clean = client_->Prefetch(3);
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  // The last used byte of the group.
  uint64_t before_last = 0;
  for (size_t i = 0; i + 1 < clean->extents.size(); ++i) before_last += clean->extents[i].length;
  const Extent& last = clean->extents.back();
  uint8_t* p = client_->Address(last);
  ASSERT_NE(p, nullptr);
  p[bytes - before_last - 1] ^= 0x80;
  auto corrupt = client_->Prefetch(3);
  ASSERT_FALSE(corrupt.ok());
  EXPECT_EQ(corrupt.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(corrupt.status().message().find("offset " + std::to_string(last.offset)),
            std::string::npos)
      << corrupt.status().message();
  EXPECT_TRUE(client_->Release(3).ok());
}

// A refused Commit (here: more used bytes than reserved) must not lose the
// group's checksum bookkeeping: the retried Commit still sends checksums, so
// a flipped byte is caught. (It used to drop them, and Prefetch then skipped
// the check without a word.)
TEST_F(Integrity, RetriedCommitStillChecksums) {
  const uint64_t bytes = kMiB + 10;
  std::vector<uint8_t> data(bytes, 0x3C);
  auto r = client_->Reserve(4, bytes);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(client_->Write(r->extents, 0, data.data(), data.size()).ok());
  auto refused = client_->Commit(4, r->reserved_bytes + 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().ToString();
  ASSERT_TRUE(client_->Commit(4, bytes).ok());
  auto clean = client_->Prefetch(4);
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  EXPECT_EQ(clean->extent_crc32c.size(), clean->extents.size());
  uint8_t* p = client_->Address(clean->extents[0]);
  ASSERT_NE(p, nullptr);
  p[0] ^= 0xFF;
  auto corrupt = client_->Prefetch(4);
  ASSERT_FALSE(corrupt.ok()) << "a flipped byte passed the checksum";
  EXPECT_EQ(corrupt.status().code(), StatusCode::kDataLoss) << corrupt.status().ToString();
  EXPECT_TRUE(client_->Release(4).ok());
}

}  // namespace
}  // namespace memoffload::testing
