// RegionStore, RegionWriter and RegionReader (client/region_io.h) against
// the real daemon, with chunks small enough that a region spans several
// extents: appends land in order across extents, device sources are copied
// per extent, the checksums the writer computes catch a changed byte at open
// or as the reader reads, and every misuse is the status the header names.
#include "memoffload/client/region_io.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"

namespace memoffload::testing {
namespace {

using client::RegionReader;
using client::RegionStore;
using client::RegionWriter;

constexpr uint64_t kMiB = 1 << 20;

DaemonProcess::Options SmallChunks() {
  DaemonProcess::Options options;
  options.arena_size = "256MiB";
  options.chunk_size = "4MiB";
  return options;
}

std::unique_ptr<RegionStore> Store(const DaemonProcess& d, bool checksums = true) {
  client::RegionStoreOptions options;
  options.runtime_dir = d.runtime_dir();
  options.job_id = "train";
  options.checksums = checksums;
  auto store = RegionStore::Attach(options);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  return store.ok() ? std::move(store).value() : nullptr;
}

std::vector<uint8_t> Pattern(uint64_t size, uint32_t seed) {
  std::vector<uint8_t> out(size);
  uint32_t x = seed;
  for (uint8_t& b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

// Writes `data` in pieces of `piece` bytes (the odd ones through a
// DeviceCopy) and commits.
void WriteRegion(RegionStore* store, const std::string& name, const std::vector<uint8_t>& data,
                 uint64_t piece) {
  auto writer = store->Create(name, data.size());
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  for (uint64_t at = 0, i = 0; at < data.size(); at += piece, ++i) {
    const uint64_t n = std::min(piece, data.size() - at);
    Result<uint64_t> offset = InvalidArgument("not appended");
    if (i % 2 == 0) {
      offset = (*writer)->Append(data.data() + at, n);
    } else {
      offset = (*writer)->Append(n, [&](uint64_t from, uint8_t* dst, uint64_t k) {
        EXPECT_LE(from + k, n);
        std::memcpy(dst, data.data() + at + from, k);
        return Status::Ok();
      });
    }
    ASSERT_TRUE(offset.ok()) << offset.status().ToString();
    EXPECT_EQ(*offset, at);
  }
  auto used = (*writer)->Commit();
  ASSERT_TRUE(used.ok()) << used.status().ToString();
  EXPECT_EQ(*used, data.size());
}

TEST(RegionIo, AppendsAcrossExtentsReadBackExactlyAndChecked) {
  std::string error;
  auto daemon = DaemonProcess::Start(SmallChunks(), &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto store = Store(*daemon);
  ASSERT_NE(store, nullptr);
  // 9 MiB and change: at least three 4 MiB chunks' extents.
  const std::vector<uint8_t> data = Pattern(9 * kMiB + 12345, 1);
  for (uint64_t piece : {data.size(), 3 * kMiB + 7, uint64_t{1000003}}) {
    const std::string name = "ckpt/" + std::to_string(piece);
    WriteRegion(store.get(), name, data, piece);
    auto reader = store->Open(name);  // checksums verified at open
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();
    EXPECT_EQ((*reader)->size_bytes(), data.size());
    std::vector<uint8_t> back(data.size());
    ASSERT_TRUE((*reader)->Read(0, back.data(), back.size()).ok());
    EXPECT_TRUE(back == data) << name;
    auto tail = (*reader)->Read(data.size() - 100, 100);
    ASSERT_TRUE(tail.ok()) << tail.status().ToString();
    EXPECT_EQ(0, std::memcmp(tail->data(), data.data() + data.size() - 100, 100));
    EXPECT_TRUE((*reader)->Read(data.size(), 0).ok());
  }
  auto listed = store->List("ckpt/");
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), 3u);
  for (const client::RegionInfo& info : *listed) {
    EXPECT_EQ(info.used_bytes, data.size());
    EXPECT_TRUE(info.checksummed);
  }
}

TEST(RegionIo, MisuseIsTheStatusTheHeaderNames) {
  std::string error;
  auto daemon = DaemonProcess::Start(SmallChunks(), &error);
  ASSERT_NE(daemon, nullptr) << error;
  client::RegionStoreOptions no_job;
  no_job.runtime_dir = daemon->runtime_dir();
  EXPECT_EQ(RegionStore::Attach(no_job).status().code(), StatusCode::kInvalidArgument);

  auto store = Store(*daemon);
  ASSERT_NE(store, nullptr);
  auto writer = store->Create("w", 5 * kMiB);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  RegionWriter& w = **writer;
  const std::vector<uint8_t> data = Pattern(5 * kMiB + 1, 2);
  EXPECT_EQ(w.Append(data.data(), data.size()).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(w.written(), 0u);
  ASSERT_TRUE(w.Append(data.data(), 4 * kMiB).ok());
  EXPECT_EQ(w.Append(data.data(), kMiB + 1).status().code(), StatusCode::kOutOfRange);
  // A device copy that fails fails the append with its status.
  auto failed = w.Append(10, [](uint64_t, uint8_t*, uint64_t) { return Internal("no device"); });
  EXPECT_EQ(failed.status().code(), StatusCode::kInternal);
  auto used = w.Commit();
  ASSERT_TRUE(used.ok()) << used.status().ToString();
  EXPECT_EQ(*used, w.written());
  EXPECT_EQ(w.Append(data.data(), 1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(w.Commit().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(w.Abort().ok());  // nothing to abort once committed

  auto reader = store->Open("w");
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  RegionReader& r = **reader;
  std::vector<uint8_t> back(16);
  EXPECT_EQ(r.Read(r.size_bytes() - 8, back.data(), 16).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(r.Read(r.size_bytes() + 1, 0).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(r.Read(0, uint64_t{1} << 62).status().code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(r.Close().ok());
  EXPECT_TRUE(r.Close().ok());
  EXPECT_EQ(r.Read(0, back.data(), 1).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.VerifyRest().code(), StatusCode::kFailedPrecondition);

  EXPECT_EQ(store->Open("missing").status().code(), StatusCode::kNotFound);
  store->Close();
  EXPECT_TRUE(store->closed());
  EXPECT_EQ(store->Create("x", kMiB).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->Open("w").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->Delete("w").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->List().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->session_id().status().code(), StatusCode::kFailedPrecondition);
}

TEST(RegionIo, AWriterKeepsItsSessionAfterTheStoreClosesAndAbortsWhenDropped) {
  std::string error;
  auto daemon = DaemonProcess::Start(SmallChunks(), &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto store = Store(*daemon);
  ASSERT_NE(store, nullptr);
  const std::vector<uint8_t> data = Pattern(6 * kMiB, 3);
  auto kept = store->Create("kept", data.size());
  auto dropped = store->Create("dropped", data.size());
  auto aborted = store->Create("aborted", data.size());
  ASSERT_TRUE(kept.ok() && dropped.ok() && aborted.ok());
  store->Close();
  ASSERT_TRUE((*kept)->Append(data.data(), data.size()).ok());
  ASSERT_TRUE((*kept)->Commit().ok());
  ASSERT_TRUE((*aborted)->Append(data.data(), kMiB).ok());
  ASSERT_TRUE((*aborted)->Abort().ok());
  EXPECT_TRUE((*aborted)->Abort().ok());
  EXPECT_EQ((*aborted)->Commit().status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*dropped)->Append(data.data(), kMiB).ok());
  dropped->reset();  // uncommitted: aborted now, not when the session ends
  // Only the committed region holds arena bytes, while `kept` and `aborted`
  // (and with them the session) are still alive.
  for (int i = 0; i < 100 && daemon->Status().region_bytes() != data.size(); ++i) usleep(20000);
  EXPECT_EQ(daemon->Status().region_bytes(), data.size());

  auto again = Store(*daemon);
  ASSERT_NE(again, nullptr);
  auto names = again->List();
  ASSERT_TRUE(names.ok()) << names.status().ToString();
  ASSERT_EQ(names->size(), 1u);
  EXPECT_EQ((*names)[0].name, "kept");
  auto freed = again->Delete("kept");
  ASSERT_TRUE(freed.ok()) << freed.status().ToString();
  EXPECT_EQ(*freed, data.size());
}

TEST(RegionIo, ChecksumsCatchAChangedByteAtOpenOrAsTheReaderReads) {
  std::string error;
  auto daemon = DaemonProcess::Start(SmallChunks(), &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto store = Store(*daemon);
  ASSERT_NE(store, nullptr);
  const std::vector<uint8_t> data = Pattern(9 * kMiB, 4);
  WriteRegion(store.get(), "ckpt", data, 2 * kMiB + 1);
  // A stray write into the region's last extent, through another session's
  // mapping.
  client::AttachOptions options;
  options.runtime_dir = daemon->runtime_dir();
  options.job_id = "train";
  auto other = client::Client::Attach(options);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  auto placement = (*other)->OpenRegion("ckpt", /*verify=*/false);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  ASSERT_GE(placement->extents.size(), 3u);
  uint8_t* last = (*other)->Address(placement->extents.back());
  ASSERT_NE(last, nullptr);
  last[17] ^= 0x01;
  ASSERT_TRUE((*other)->CloseRegion("ckpt").ok());

  EXPECT_EQ(store->Open("ckpt").status().code(), StatusCode::kDataLoss);
  std::vector<uint8_t> back(data.size());
  {  // verify_as_read: the read that crosses the changed byte fails
    auto reader = store->Open("ckpt", /*verify=*/true, /*verify_as_read=*/true);
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();
    EXPECT_EQ((*reader)->Read(0, back.data(), back.size()).code(), StatusCode::kDataLoss);
  }
  {  // an in-order read of the front, then the rest checked at the end
    auto reader = store->Open("ckpt", /*verify=*/true, /*verify_as_read=*/true);
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();
    EXPECT_TRUE((*reader)->Read(0, back.data(), 4 * kMiB).ok());
    EXPECT_EQ((*reader)->VerifyRest().code(), StatusCode::kDataLoss);
  }
  {  // not verified: the bytes as they are
    auto reader = store->Open("ckpt", /*verify=*/false);
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();
    ASSERT_TRUE((*reader)->Read(0, back.data(), back.size()).ok());
    EXPECT_EQ(std::mismatch(back.begin(), back.end(), data.begin()).first - back.begin(),
              static_cast<ptrdiff_t>(data.size() - placement->extents.back().length + 17));
    EXPECT_TRUE((*reader)->VerifyRest().ok());
  }
}

TEST(RegionIo, WithoutChecksumsNothingIsStoredOrChecked) {
  std::string error;
  auto daemon = DaemonProcess::Start(SmallChunks(), &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto store = Store(*daemon, /*checksums=*/false);
  ASSERT_NE(store, nullptr);
  const std::vector<uint8_t> data = Pattern(5 * kMiB, 5);
  WriteRegion(store.get(), "plain", data, data.size());
  auto listed = store->List();
  ASSERT_TRUE(listed.ok() && listed->size() == 1u);
  EXPECT_FALSE((*listed)[0].checksummed);
  auto reader = store->Open("plain", /*verify=*/true, /*verify_as_read=*/true);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto all = (*reader)->Read(0, data.size());
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(0, std::memcmp(all->data(), data.data(), data.size()));
}

}  // namespace
}  // namespace memoffload::testing
