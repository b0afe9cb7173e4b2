// RegionWriter::Place and CommitRegion's rename_to (client/region_io.h)
// against the real daemon, with chunks small enough that a region spans
// several extents: placed bytes are contiguous, aligned, never cross an
// extent, and checksummed at commit from the mapping (a changed byte is
// DATA_LOSS at open); a region staged under one name is committed under
// another, which must be free.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/client/region_io.h"
#include "region_stores.h"

namespace memoffload::testing {
namespace {

using client::RegionStore;

constexpr uint64_t kMiB = 1 << 20;

std::unique_ptr<DaemonProcess> Start() { return StartSmallChunks(); }

std::unique_ptr<RegionStore> Store(const DaemonProcess& d) { return TrainStore(d); }

TEST(RegionPlace, PlacedBytesAreContiguousAlignedAndCheckedAtCommit) {
  auto daemon = Start();
  ASSERT_NE(daemon, nullptr);
  auto store = Store(*daemon);
  ASSERT_NE(store, nullptr);
  // Three 4 MiB chunks' worth: 3 MiB pieces cannot share an extent.
  auto writer = store->Create("staged", 12 * kMiB);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  client::RegionWriter& w = **writer;
  std::vector<std::pair<uint64_t, uint64_t>> pieces;  // offset, size
  uint64_t previous_end = 0;
  for (uint64_t size : {uint64_t{100}, 3 * kMiB, 3 * kMiB, uint64_t{4096 + 3}}) {
    uint8_t* address = nullptr;
    auto at = w.Place(size, 64, &address);
    ASSERT_TRUE(at.ok()) << size << ": " << at.status().ToString();
    EXPECT_EQ(*at % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(address) % 64, 0u);
    EXPECT_GE(*at, previous_end);
    std::memset(address, static_cast<int>(pieces.size() + 1), size);  // contiguous
    pieces.emplace_back(*at, size);
    previous_end = *at + size;
  }
  EXPECT_EQ(w.written(), previous_end);
  // Larger than any extent: never contiguous.
  uint8_t* address = nullptr;
  EXPECT_EQ(w.Place(4 * kMiB + 1, 64, &address).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(w.Place(8, 3, &address).status().code(), StatusCode::kInvalidArgument);
  // An append goes after the placed bytes.
  const char tail[] = "tail";
  auto appended = w.Append(tail, sizeof(tail));
  ASSERT_TRUE(appended.ok()) << appended.status().ToString();
  EXPECT_EQ(*appended, previous_end);
  ASSERT_TRUE(w.Commit().ok());

  auto reader = store->Open("staged");  // checksums (from the mapping) verified
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  for (size_t i = 0; i < pieces.size(); ++i) {
    std::vector<uint8_t> back(pieces[i].second);
    ASSERT_TRUE((*reader)->Read(pieces[i].first, back.data(), back.size()).ok());
    EXPECT_EQ(back, std::vector<uint8_t>(back.size(), static_cast<uint8_t>(i + 1))) << i;
  }
  auto t = (*reader)->Read(previous_end, sizeof(tail));
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(0, std::memcmp(t->data(), tail, sizeof(tail)));
  ASSERT_TRUE((*reader)->Close().ok());

  // A placed byte changed after the commit: DATA_LOSS at the next open.
  auto other = Store(*daemon);
  ASSERT_NE(other, nullptr);
  auto second = other->Create("second", 4 * kMiB);
  ASSERT_TRUE(second.ok());
  uint8_t* p = nullptr;
  ASSERT_TRUE((*second)->Place(kMiB, 64, &p).ok());
  std::memset(p, 7, kMiB);
  ASSERT_TRUE((*second)->Commit().ok());
  p[12345] ^= 1;
  EXPECT_EQ(other->Open("second").status().code(), StatusCode::kDataLoss);
}

TEST(RegionPlace, AStagedRegionIsCommittedUnderItsFinalName) {
  auto daemon = Start();
  ASSERT_NE(daemon, nullptr);
  auto store = Store(*daemon);
  ASSERT_NE(store, nullptr);
  {
    auto taken = store->Create("dcp/step-1/__0_0.distcp", kMiB);
    ASSERT_TRUE(taken.ok());
    ASSERT_TRUE((*taken)->Append("x", 1).ok());
    ASSERT_TRUE((*taken)->Commit().ok());
  }
  auto writer = store->Create("dcp/.staging/abc/__0_0.distcp", kMiB);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Append("staged", 6).ok());
  // The final name is taken: nothing is committed, the writer stays open.
  auto clash = (*writer)->Commit("dcp/step-1/__0_0.distcp");
  ASSERT_EQ(clash.status().code(), StatusCode::kAlreadyExists) << clash.status().ToString();
  EXPECT_NE(clash.status().message().find("nothing was committed"), std::string::npos);
  EXPECT_EQ((*writer)->Commit("bad name").status().code(), StatusCode::kInvalidArgument);
  auto used = (*writer)->Commit("dcp/step-2/__0_0.distcp");
  ASSERT_TRUE(used.ok()) << used.status().ToString();
  EXPECT_EQ(*used, 6u);
  EXPECT_EQ(store->Open("dcp/.staging/abc/__0_0.distcp").status().code(), StatusCode::kNotFound);
  auto reader = store->Open("dcp/step-2/__0_0.distcp");
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto bytes = (*reader)->Read(0, 6);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, "staged");
  auto listed = store->List("dcp/");
  ASSERT_TRUE(listed.ok());
  std::vector<std::string> names;
  for (const auto& info : *listed) names.push_back(info.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"dcp/step-1/__0_0.distcp", "dcp/step-2/__0_0.distcp"}));
  // The staging name is free again.
  EXPECT_TRUE(store->Create("dcp/.staging/abc/__0_0.distcp", kMiB).ok());
}

}  // namespace
}  // namespace memoffload::testing
