// What a restart keeps, on the table's side: every region commit and delete
// reaches the recorder before it is answered, and Recover places a kept
// state in a new table exactly (extents, tenants, TTL), refusing what would
// overlap or cross tenants.
#include <gtest/gtest.h>

#include <chrono>

#include "core/session_table.h"
#include "memoffload/common/units.h"
#include "test_arena.h"

namespace memoffload::daemon {
namespace {

using std::chrono::milliseconds;

// Keeps what the table tells it, as the state store's mirror does.
class Mirror : public StateRecorder {
 public:
  void RegionCommitted(const RegionRecord& r) override { regions[KeyOf(r)] = r; }
  void RegionDeleted(const RegionKey& key) override {
    EXPECT_EQ(regions.erase(key), 1u) << "deleted a region never committed";
  }
  void BackingReplaced(uint32_t index, const std::shared_ptr<const Chunk>& backing) override {
    replaced.push_back(index);
    EXPECT_NE(backing, nullptr);
  }
  void ChunksHanded(const std::vector<uint32_t>& chunks) override {
    handed.insert(handed.end(), chunks.begin(), chunks.end());
  }
  std::vector<RegionRecord> All() const {
    std::vector<RegionRecord> out;
    for (const auto& [k, r] : regions) out.push_back(r);
    return out;
  }
  std::map<RegionKey, RegionRecord> regions;
  std::vector<uint32_t> replaced;
  std::vector<uint32_t> handed;
};

Policy RegionPolicy() {
  Policy p;
  p.region_max_bytes = 3 * kMiB;
  return p;
}

void Save(SessionTable& table, const SessionGrant& s, const std::string& name, uint64_t size,
          uint64_t used, std::vector<uint32_t> crcs = {}) {
  auto c = table.CreateRegion(s.session_id, s.token, name, size, milliseconds(0));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto k = table.CommitRegion(s.session_id, s.token, name, used, std::move(crcs));
  ASSERT_TRUE(k.ok()) << k.status().ToString();
}

TEST(RecoverTest, EveryCommitAndDeleteIsRecordedAndANewTablePlacesThemExactly) {
  auto arena = MakeTestArena();
  ASSERT_NE(arena, nullptr);
  Mirror mirror;
  std::vector<RegionRecord> kept;
  {
    SessionTable table(arena.get(), RegionPolicy(), TenantMode::kUid);
    table.SetRecorder(&mirror);
    SessionGrant alice = OpenAs(table, 1000, "job-a");
    SessionGrant bob = OpenAs(table, 1001, "job-b");
    Save(table, alice, "a1", 300 * kKiB, 200 * kKiB, {7});
    Save(table, alice, "a2", 100 * kKiB, 100 * kKiB);
    Save(table, bob, "b1", 200 * kKiB, 150 * kKiB);
    Save(table, alice, "gone", 4 * kKiB, 4 * kKiB);
    // A region being written is never recorded; a deleted one is forgotten.
    ASSERT_TRUE(
        table.CreateRegion(bob.session_id, bob.token, "half", 4 * kKiB, milliseconds(0)).ok());
    ASSERT_TRUE(table.DeleteRegion(alice.session_id, alice.token, "gone").ok());
    EXPECT_EQ(mirror.regions.size(), 3u);
    std::vector<RegionRecord> listed = table.CommittedRegions();
    EXPECT_EQ(listed.size(), 3u);
    kept = mirror.All();
    ASSERT_TRUE(table.CheckInvariants().ok());
  }
  // A new table over the same arena (the chunks kept their bytes).
  auto fresh = MakeTestArena();
  ASSERT_NE(fresh, nullptr);
  SessionTable table(fresh.get(), RegionPolicy(), TenantMode::kUid);
  std::vector<std::string> dropped;
  SessionTable::Recovered got = table.Recover(kept, &dropped);
  EXPECT_TRUE(dropped.empty()) << dropped.front();
  EXPECT_EQ(got.regions, 3u);
  // Commit kept the used bytes, rounded to pages: 200 + 100 + 152 KiB.
  EXPECT_EQ(got.bytes, 452 * kKiB);
  ASSERT_TRUE(table.CheckInvariants().ok()) << table.CheckInvariants().ToString();
  std::vector<RegionRecord> placed = table.CommittedRegions();
  ASSERT_EQ(placed.size(), 3u);
  for (const RegionRecord& p : placed) {
    const RegionRecord& k = mirror.regions.at(KeyOf(p));
    ASSERT_EQ(p.extents.size(), k.extents.size());
    for (size_t i = 0; i < p.extents.size(); ++i) {
      EXPECT_EQ(p.extents[i].chunk, k.extents[i].chunk);
      EXPECT_EQ(p.extents[i].offset, k.extents[i].offset);
    }
    EXPECT_EQ(p.extent_crc32c, k.extent_crc32c);
    EXPECT_EQ(p.used_bytes, k.used_bytes);
  }
  // The regions read as before, by their own job only, marked recovered.
  SessionGrant alice = OpenAs(table, 1000, "job-a");
  auto open = table.OpenRegion(alice.session_id, alice.token, "a1");
  ASSERT_TRUE(open.ok()) << open.status().ToString();
  EXPECT_EQ(open->used_bytes, 200 * kKiB);
  EXPECT_EQ(open->extent_crc32c, std::vector<uint32_t>{7});
  SessionGrant mallory = OpenAs(table, 1002, "job-a");
  EXPECT_EQ(table.OpenRegion(mallory.session_id, mallory.token, "a1").status().code(),
            StatusCode::kNotFound);
  for (const RegionSnapshot& r : table.ListAllRegions("")) EXPECT_TRUE(r.recovered) << r.name;
  // New space never lands on a kept region, and another uid's reserve never
  // lands in a kept region's chunk.
  auto g = table.Reserve(mallory.session_id, mallory.token, 1, 512 * kKiB, false);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  for (const Extent& e : g->extents) {
    for (const RegionRecord& p : placed) {
      for (const Extent& r : p.extents)
        EXPECT_NE(e.chunk, r.chunk) << "shares chunk with " << p.name;
    }
  }
  ASSERT_TRUE(table.CheckInvariants().ok());
}

TEST(RecoverTest, OverlappingOrCrossTenantOrOutOfRangeRegionsAreDroppedWithWhy) {
  auto arena = MakeTestArena();
  ASSERT_NE(arena, nullptr);
  SessionTable table(arena.get(), RegionPolicy(), TenantMode::kUid);
  auto record = [](uid_t uid, const std::string& name, Extent e) {
    RegionRecord r;
    r.uid = uid;
    r.job_id = "job";
    r.name = name;
    r.used_bytes = e.length;
    r.ttl_ms = 60000;
    r.committed_unix = 1;
    r.extents = {e};
    return r;
  };
  std::vector<RegionRecord> kept = {
      record(1000, "first", Extent{0, 0, 8192}),
      record(1000, "overlaps", Extent{0, 4096, 8192}),
      record(1001, "other-tenant", Extent{0, 65536, 4096}),
      record(1000, "past-the-arena", Extent{9, 0, 4096}),
      record(1000, "unaligned", Extent{1, 100, 4096}),
      record(1000, "bad name", Extent{2, 0, 4096}),
  };
  std::vector<std::string> dropped;
  SessionTable::Recovered got = table.Recover(kept, &dropped);
  EXPECT_EQ(got.regions, 1u);
  ASSERT_EQ(dropped.size(), 5u);
  EXPECT_NE(dropped[0].find("overlaps"), std::string::npos) << dropped[0];
  EXPECT_NE(dropped[1].find("another tenant"), std::string::npos) << dropped[1];
  EXPECT_NE(dropped[2].find("past the arena"), std::string::npos) << dropped[2];
  EXPECT_NE(dropped[3].find("page-aligned"), std::string::npos) << dropped[3];
  EXPECT_NE(dropped[4].find("name"), std::string::npos) << dropped[4];
  ASSERT_TRUE(table.CheckInvariants().ok()) << table.CheckInvariants().ToString();
}

TEST(RecoverTest, TheTtlRunsFromTheCommitAcrossTheRestart) {
  auto arena = MakeTestArena();
  ASSERT_NE(arena, nullptr);
  SessionTable table(arena.get(), RegionPolicy(), TenantMode::kUid);
  RegionRecord r;
  r.uid = 1000;
  r.job_id = "job";
  r.name = "old";
  r.used_bytes = 4096;
  r.ttl_ms = 3600 * 1000;
  r.committed_unix =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() -
      1800;  // half its TTL ago
  r.extents = {Extent{0, 0, 4096}};
  std::vector<std::string> dropped;
  ASSERT_EQ(table.Recover({r}, &dropped).regions, 1u);
  std::vector<RegionSnapshot> all = table.ListAllRegions("");
  ASSERT_EQ(all.size(), 1u);
  EXPECT_NEAR(all[0].expires_in_seconds, 1800, 5);
  EXPECT_EQ(table.ExpireRegions(std::chrono::steady_clock::now() + std::chrono::seconds(1790)), 0u);
  EXPECT_EQ(table.ExpireRegions(std::chrono::steady_clock::now() + std::chrono::seconds(1810)), 1u);
}

TEST(TakeExactTest, TakesOnlyAFreeRangeAndFreesLikeAnyExtent) {
  ExtentAllocator a({1 * kMiB, 1 * kMiB}, 4096);
  ASSERT_TRUE(a.TakeExact(Extent{0, 8192, 16384}).ok());
  ASSERT_TRUE(a.TakeExact(Extent{0, 0, 8192}).ok());                // right before it
  ASSERT_TRUE(a.TakeExact(Extent{1, 1 * kMiB - 4096, 4096}).ok());  // a chunk's last page
  EXPECT_FALSE(a.TakeExact(Extent{0, 12288, 4096}).ok());           // inside a taken one
  EXPECT_FALSE(a.TakeExact(Extent{0, 20480, 8192}).ok());           // straddles its end
  EXPECT_FALSE(a.TakeExact(Extent{1, 1 * kMiB, 4096}).ok());
  EXPECT_FALSE(a.TakeExact(Extent{2, 0, 4096}).ok());
  EXPECT_FALSE(a.TakeExact(Extent{1, 0, 100}).ok());
  EXPECT_EQ(a.used_bytes(), 8192u + 16384u + 4096u);
  ASSERT_TRUE(a.CheckInvariants().ok()) << a.CheckInvariants().ToString();
  ASSERT_TRUE(a.Free(Extent{0, 8192, 16384}).ok());
  ASSERT_TRUE(a.Free(Extent{0, 0, 8192}).ok());
  ASSERT_TRUE(a.Free(Extent{1, 1 * kMiB - 4096, 4096}).ok());
  EXPECT_EQ(a.used_bytes(), 0u);
  EXPECT_EQ(a.largest_free_extent_bytes(), 1 * kMiB);  // coalesced again
  ASSERT_TRUE(a.CheckInvariants().ok());
}

// The record of the chunks handed out (app/handed_chunks.h) hears of every
// chunk whose fd leaves for a process, and of no other.
TEST(RecoverTest, EveryChunkHandedToAProcessIsToldToTheRecorder) {
  auto arena = MakeTestArena();
  ASSERT_NE(arena, nullptr);
  Mirror mirror;
  SessionTable table(arena.get(), RegionPolicy(), TenantMode::kUid);
  table.SetRecorder(&mirror);
  SessionGrant alice = OpenAs(table, 1000, "job-a");
  SessionGrant bob = OpenAs(table, 1001, "job-b");
  Save(table, alice, "a1", 300 * kKiB, 200 * kKiB);
  const uint32_t chunk = mirror.regions.begin()->second.extents.at(0).chunk;
  ASSERT_TRUE(table.GrantChunks(alice.session_id, {chunk}).ok());
  EXPECT_EQ(mirror.handed, std::vector<uint32_t>{chunk});
  // Refused (another tenant's): nothing leaves, nothing is told.
  EXPECT_EQ(table.GrantChunks(bob.session_id, {chunk}).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(mirror.handed, std::vector<uint32_t>{chunk});
  // A new session of alice's uid is handed her chunks at attach.
  SessionGrant again = OpenAs(table, 1000, "job-a");
  auto attached = table.AttachChunks(again.session_id);
  ASSERT_TRUE(attached.ok());
  ASSERT_EQ(attached->size(), 1u);
  EXPECT_EQ(mirror.handed, (std::vector<uint32_t>{chunk, chunk}));
}

}  // namespace
}  // namespace memoffload::daemon
