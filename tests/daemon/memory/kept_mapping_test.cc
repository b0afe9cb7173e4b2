// MapKept and an arena built from kept memfds: the kept chunks are not
// faulted into the new mapping by Build, MapKept maps every page of those
// still there (and keeps their bytes), skips a chunk replaced meanwhile, and
// stops when told.
#include "memory/kept_mapping.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>

#include "memoffload/common/units.h"
#include "memory/arena.h"

namespace memoffload::daemon {
namespace {

constexpr uint64_t kChunk = 4 * kMiB;

// An arena of two chunks whose memfds were filled by a first arena.
std::unique_ptr<Arena> KeptArena(ArenaBuildReport* report) {
  ArenaOptions o;
  o.size_bytes = 2 * kChunk;
  o.chunk_size_bytes = kChunk;
  o.mlock = false;
  ArenaBuildReport first_report;
  Result<std::unique_ptr<Arena>> first = Arena::Build(o, &first_report);
  if (!first.ok()) return nullptr;
  for (uint32_t i = 0; i < 2; ++i) {
    std::memset((*first)->chunk(i).data(), 0x40 + i, kChunk);
    o.adopt_fds.push_back(dup((*first)->chunk(i).fd()));
  }
  Result<std::unique_ptr<Arena>> kept = Arena::Build(o, report);
  return kept.ok() ? std::move(kept).value() : nullptr;
}

uint64_t Rss(const Arena& arena, uint32_t index) {
  Result<std::vector<MappingPages>> pages = PagesOf({arena.chunk(index).data()});
  return pages.ok() ? (*pages)[0].rss_bytes : ~0ull;
}

TEST(KeptMapping, BuildLeavesKeptChunksUnmappedAndMapKeptMapsThem) {
  ArenaBuildReport report;
  std::unique_ptr<Arena> arena = KeptArena(&report);
  ASSERT_NE(arena, nullptr);
  EXPECT_EQ(report.adopted_chunks, 2u);
  EXPECT_EQ(report.adopted_bytes, 2 * kChunk);
  EXPECT_EQ(Rss(*arena, 0), 0u);
  EXPECT_EQ(Rss(*arena, 1), 0u);
  std::vector<std::weak_ptr<const Chunk>> kept = arena->TakeUnmappedKept();
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_TRUE(arena->TakeUnmappedKept().empty());  // once
  std::atomic<bool> stop{false};
  const KeptMapping m = MapKept(kept, 2, stop);
  EXPECT_FALSE(m.stopped);
  EXPECT_EQ(m.chunks, 2u);
  EXPECT_EQ(m.bytes, 2 * kChunk);
  EXPECT_EQ(Rss(*arena, 0), kChunk);
  EXPECT_EQ(Rss(*arena, 1), kChunk);
  EXPECT_EQ(arena->chunk(1).data()[kChunk - 1], 0x41);  // the kept bytes
}

TEST(KeptMapping, AReplacedChunkIsSkippedAndAStopIsHeard) {
  ArenaBuildReport report;
  std::unique_ptr<Arena> arena = KeptArena(&report);
  ASSERT_NE(arena, nullptr);
  std::vector<std::weak_ptr<const Chunk>> kept = arena->TakeUnmappedKept();
  // Chunk 0 changes tenant: its old backing is not the pass's to keep.
  Result<Chunk> fresh = Chunk::Create("fresh", kChunk, false);
  ASSERT_TRUE(fresh.ok());
  std::weak_ptr<Chunk> old =
      arena->ReplaceBacking(0, std::make_shared<Chunk>(std::move(fresh).value()));
  EXPECT_TRUE(old.expired());
  std::atomic<bool> stop{true};
  EXPECT_TRUE(MapKept(kept, 1, stop).stopped);
  EXPECT_EQ(Rss(*arena, 1), 0u);
  stop = false;
  const KeptMapping m = MapKept(kept, 1, stop);
  EXPECT_EQ(m.bytes, kChunk);  // chunk 1 only
  EXPECT_EQ(Rss(*arena, 1), kChunk);
}

}  // namespace
}  // namespace memoffload::daemon
