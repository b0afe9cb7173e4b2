// The LibTorch GroupOffloader's explicit API (OffloadGroup / PrefetchGroup /
// GetGroup / ReleaseGroup) against the real daemon, with CPU tensors.
#include "memoffload/torch/group_offloader.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/daemon_status.h"

namespace memoffload::testing {
namespace {

using torch::GroupOffloader;
using torch::OffloaderOptions;
using torch::OffloaderStats;

// Byte-for-byte equality of the elements (NaN payloads and -0.0 included).
bool BitwiseEqual(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype()) return false;
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  const size_t n = ca.numel() * ca.element_size();
  return n == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), n) == 0;
}

// The whole storage, also the bytes no view shows.
bool SameStorageBytes(const at::Tensor& a, const at::Tensor& b) {
  const size_t n = a.storage().nbytes();
  return n == b.storage().nbytes() &&
         (n == 0 || std::memcmp(a.storage().data(), b.storage().data(), n) == 0);
}

class GroupOffloaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    daemon_ = DaemonProcess::Start(DaemonProcess::Options{}, &error);
    ASSERT_NE(daemon_, nullptr) << error;
    OffloaderOptions options;
    options.runtime_dir = daemon_->runtime_dir();
    options.use_cuda = false;
    offloader_ = GroupOffloader::Create(options);
    ASSERT_TRUE(offloader_->stats().connected) << offloader_->stats().last_skip_reason;
  }

  // The daemon's status through the client's plain-struct query (this test
  // is compiled with torch's include dirs, which hide the system protobuf).
  client::DaemonStatus Status() const {
    Result<client::DaemonStatus> s = client::QueryDaemonStatus(daemon_->runtime_dir());
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? *s : client::DaemonStatus{};
  }

  void ExpectArenaEmpty() {
    offloader_->Flush();
    const client::DaemonStatus s = Status();
    EXPECT_EQ(s.used_bytes, 0u);
    EXPECT_EQ(s.reserved_bytes, 0u);
    EXPECT_EQ(s.committed_bytes, 0u);
    EXPECT_EQ(s.read_bytes, 0u);
    EXPECT_EQ(s.groups, 0u);
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::shared_ptr<GroupOffloader> offloader_;
};

TEST_F(GroupOffloaderTest, RestoresDtypesViewsZeroSizeAndNonContiguousBitwise) {
  at::manual_seed(0);
  const at::Tensor f32 = at::randn({64, 32});
  // NaN with a payload, -0.0 and infinities must come back as the same bits.
  at::Tensor special = at::randn({4, 256});
  const uint32_t nan_bits = 0x7fc12345u;
  float payload_nan = 0;
  std::memcpy(&payload_nan, &nan_bits, sizeof(payload_nan));
  special[0][0] = payload_nan;
  special[0][1] = -0.0f;
  special[0][2] = std::numeric_limits<float>::infinity();
  const at::Tensor bf16 = at::randn({33, 17}).to(at::kBFloat16);
  const at::Tensor f16 = at::randn({33, 17}).to(at::kHalf);
  const at::Tensor i64 = at::randint(-(int64_t{1} << 40), int64_t{1} << 40, {100}, at::kLong);
  const at::Tensor b = at::rand({57}) > 0.5;
  const at::Tensor u8 = at::randint(0, 256, {300}, at::kByte);
  const at::Tensor base = at::randn({10, 12});
  const at::Tensor expanded = at::randn({1, 6}).expand({4, 6});
  const at::Tensor empty = at::empty({0, 5});

  const std::vector<at::Tensor> tensors = {
      f32,                                      // 0
      f32.t(),                                  // 1: a view of 0's storage
      f32.narrow(0, 5, 10),                     // 2: a view with a storage offset
      special,                                  // 3
      bf16,                                     // 4
      f16,                                      // 5
      i64,                                      // 6
      b,                                        // 7
      u8,                                       // 8
      base.slice(1, 0, 12, 3),                  // 9: non-contiguous
      base.t().narrow(0, 2, 3),                 // 10: transposed, offset, same storage as 9
      expanded,                                 // 11: stride 0
      empty,                                    // 12: zero-size
      at::randn({3, 4, 5}).permute({2, 0, 1}),  // 13
  };
  const int64_t f32_uses = f32.storage().use_count();

  // Distinct storages: what must go through the arena.
  std::set<const c10::StorageImpl*> impls;
  uint64_t unique_bytes = 0;
  for (const at::Tensor& t : tensors) {
    if (impls.insert(t.storage().unsafeGetStorageImpl()).second) {
      unique_bytes += t.storage().nbytes();
    }
  }
  const OffloaderStats before = offloader_->stats();
  constexpr uint64_t kKey = 42;
  ASSERT_TRUE(offloader_->OffloadGroup(kKey, tensors).ok());
  offloader_->Flush();

  OffloaderStats s = offloader_->stats();
  EXPECT_EQ(s.offloaded_bytes - before.offloaded_bytes, unique_bytes);
  EXPECT_EQ(s.skipped_bytes, before.skipped_bytes) << s.last_skip_reason;
  EXPECT_EQ(s.deduplicated - before.deduplicated, tensors.size() - impls.size());
  EXPECT_EQ(s.tensors - before.tensors, tensors.size());
  // Committed: the daemon holds the bytes, the group let go of the sources.
  client::DaemonStatus status = Status();
  EXPECT_GE(status.committed_bytes, unique_bytes);
  EXPECT_EQ(status.reserved_bytes, 0u);
  EXPECT_EQ(status.groups, 1u);
  EXPECT_EQ(f32.storage().use_count(), f32_uses);

  offloader_->PrefetchGroup(kKey);
  Result<std::vector<at::Tensor>> got = offloader_->GetGroup(kKey);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& want = tensors[i];
    const at::Tensor& have = (*got)[i];
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_EQ(have.dtype(), want.dtype());
    EXPECT_EQ(have.device(), want.device());
    EXPECT_EQ(have.sizes(), want.sizes());
    EXPECT_EQ(have.strides(), want.strides());
    EXPECT_EQ(have.storage_offset(), want.storage_offset());
    EXPECT_TRUE(BitwiseEqual(have, want));
    EXPECT_TRUE(SameStorageBytes(have, want));
    // Restored from the arena into a storage of its own, not the source.
    EXPECT_NE(have.storage().unsafeGetStorageImpl(), want.storage().unsafeGetStorageImpl());
  }
  const auto impl_of = [&](size_t i) { return (*got)[i].storage().unsafeGetStorageImpl(); };
  EXPECT_EQ(impl_of(1), impl_of(0));
  EXPECT_EQ(impl_of(2), impl_of(0));
  EXPECT_EQ(impl_of(10), impl_of(9));
  EXPECT_NE(impl_of(3), impl_of(0));
  // Writing through one restored view shows in the other: one storage.
  (*got)[0][0][1].fill_(123.0f);
  EXPECT_EQ((*got)[1][1][0].item<float>(), 123.0f);

  offloader_->Flush();
  s = offloader_->stats();
  EXPECT_EQ(s.prefetched_bytes - before.prefetched_bytes, unique_bytes);
  status = Status();
  EXPECT_EQ(status.committed_bytes, 0u);
  EXPECT_GE(status.read_bytes, unique_bytes);

  offloader_->ReleaseGroup(kKey);
  ExpectArenaEmpty();
  // The restored tensors outlive the group.
  EXPECT_TRUE(BitwiseEqual((*got)[3], special));
  EXPECT_FALSE(offloader_->GetGroup(kKey).ok());
}

TEST_F(GroupOffloaderTest, SlotReservesAheadAndGroupsStayApart) {
  // Two groups alive at once on the same slot (gradient accumulation): each
  // comes back with its own data; from the second use the slot is reserved
  // at begin.
  const at::Tensor a = at::randn({256, 64});
  const at::Tensor b = at::randn({256, 64});
  ASSERT_TRUE(offloader_->OffloadGroup(1, {a}, 0, /*slot=*/7).ok());
  ASSERT_TRUE(offloader_->BeginGroup(2, 7).ok());
  offloader_->Flush();
  EXPECT_GE(Status().reserved_bytes, a.nbytes());
  ASSERT_TRUE(offloader_->Add(2, b).ok());
  ASSERT_TRUE(offloader_->CloseGroup(2).ok());
  offloader_->PrefetchGroup(2);
  offloader_->PrefetchGroup(1);
  Result<std::vector<at::Tensor>> got_b = offloader_->GetGroup(2);
  Result<std::vector<at::Tensor>> got_a = offloader_->GetGroup(1);
  ASSERT_TRUE(got_a.ok() && got_b.ok());
  EXPECT_TRUE(BitwiseEqual((*got_a)[0], a));
  EXPECT_TRUE(BitwiseEqual((*got_b)[0], b));
  EXPECT_EQ(offloader_->stats().blocking_rpcs, 1u);  // the attach only
  offloader_->ReleaseGroup(1);
  offloader_->ReleaseGroup(2);
  // Group 2 (BeginGroup) came back over the arena bytes: its space stays
  // until its tensor dies; group 1 (OffloadGroup) came back as a copy.
  offloader_->Flush();
  EXPECT_EQ(Status().groups, 1u);
  got_b = Result<std::vector<at::Tensor>>(std::vector<at::Tensor>{});
  ExpectArenaEmpty();
  EXPECT_TRUE(BitwiseEqual((*got_a)[0], a));
}

TEST_F(GroupOffloaderTest, ReleaseWithoutPrefetchFreesTheArena) {
  ASSERT_TRUE(offloader_->OffloadGroup(5, {at::randn({1024})}).ok());
  offloader_->Flush();
  EXPECT_GT(Status().committed_bytes, 0u);
  offloader_->ReleaseGroup(5);
  ExpectArenaEmpty();
}

TEST_F(GroupOffloaderTest, GroupWithoutLiveEntryGoesAtClose) {
  // The saved-tensor hooks release a BeginGroup group through its entries'
  // DropEntry. One that has no live entry at close (every saved tensor stayed
  // in place, or was dropped while the group was open) goes at close: it had
  // no entry left whose drop would release it.
  const at::Tensor a = at::randn({256, 64});
  ASSERT_TRUE(offloader_->OffloadGroup(1, {a}, 0, /*slot=*/3).ok());
  offloader_->ReleaseGroup(1);
  ASSERT_TRUE(offloader_->BeginGroup(2, 3).ok());  // reserved at begin
  offloader_->Flush();
  EXPECT_GE(Status().reserved_bytes, a.nbytes());
  ASSERT_TRUE(offloader_->CloseGroup(2).ok());
  ExpectArenaEmpty();
  EXPECT_EQ(offloader_->stats().groups_live, 0u);
  EXPECT_EQ(offloader_->slot_stats(3, 4).groups_live, 0u);

  ASSERT_TRUE(offloader_->BeginGroup(4, 3).ok());
  Result<int64_t> entry = offloader_->Add(4, a);
  ASSERT_TRUE(entry.ok());
  ASSERT_TRUE(offloader_->DropEntry(4, *entry).ok());  // dropped while open
  EXPECT_EQ(offloader_->slot_stats(3, 4).groups_live, 1u);
  ASSERT_TRUE(offloader_->CloseGroup(4).ok());
  ExpectArenaEmpty();
  EXPECT_EQ(offloader_->slot_stats(3, 4).groups_live, 0u);
}

TEST_F(GroupOffloaderTest, ArenaHeldBytesFollowTheDaemonsCountAndThePeakIsPerWindow) {
  // arena_held_bytes is what the daemon counts for the session: the
  // reservation at BeginGroup, what the Commit kept, 0 after the release.
  // TakeArenaHeldPeak gives the most held at once since the previous call.
  const at::Tensor a = at::randn({256, 64});
  const at::Tensor b = at::randn({512, 64});
  EXPECT_EQ(offloader_->stats().arena_held_bytes, 0u);
  EXPECT_EQ(offloader_->TakeArenaHeldPeak(), 0u);
  ASSERT_TRUE(offloader_->OffloadGroup(1, {a}, 0, /*slot=*/5).ok());
  ASSERT_TRUE(offloader_->OffloadGroup(2, {b}).ok());
  offloader_->Flush();
  const uint64_t both = offloader_->stats().arena_held_bytes;
  EXPECT_EQ(both, Status().used_bytes);
  EXPECT_GE(both, a.nbytes() + b.nbytes());
  offloader_->ReleaseGroup(2);
  offloader_->Flush();
  const uint64_t one = offloader_->stats().arena_held_bytes;
  EXPECT_EQ(one, Status().used_bytes);
  EXPECT_GE(one, a.nbytes());
  EXPECT_LT(one, both);
  EXPECT_EQ(offloader_->TakeArenaHeldPeak(), both);
  EXPECT_EQ(offloader_->TakeArenaHeldPeak(), one);  // a new window starts at what is held
  // A reservation made at BeginGroup counts while it is only reserved.
  ASSERT_TRUE(offloader_->BeginGroup(3, 5).ok());
  offloader_->Flush();
  EXPECT_EQ(offloader_->stats().arena_held_bytes, Status().used_bytes);
  EXPECT_GT(offloader_->stats().arena_held_bytes, one);
  ASSERT_TRUE(offloader_->CloseGroup(3).ok());  // nothing added: released at close
  offloader_->ReleaseGroup(1);
  ExpectArenaEmpty();
  EXPECT_EQ(offloader_->stats().arena_held_bytes, 0u);
  EXPECT_GE(offloader_->TakeArenaHeldPeak(), one + a.nbytes());
  EXPECT_EQ(offloader_->TakeArenaHeldPeak(), 0u);
}

}  // namespace
}  // namespace memoffload::testing
