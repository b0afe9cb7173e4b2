// Arena::Build: hugepage fallback, NUMA binding, locking.
#include "memory/arena.h"

#include <gtest/gtest.h>

#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

ArenaOptions SmallArena() {
  ArenaOptions o;
  o.size_bytes = 8 * kMiB;
  o.chunk_size_bytes = 4 * kMiB;
  o.prefault_threads = 2;
  return o;
}

TEST(Arena, HugepagesFallBackToNormalPagesWhenNoneAreFree) {
  if (FreeHugePages() >= 4) GTEST_SKIP() << "this machine has hugepages reserved";
  ArenaOptions o = SmallArena();
  o.hugepages = true;
  ArenaBuildReport report;
  Result<std::unique_ptr<Arena>> arena = Arena::Build(o, &report);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ(report.hugepage_chunks, 0u);
  EXPECT_NE(report.hugepage_fallback.find("not enough hugepages: HugePages_Free="),
            std::string::npos)
      << report.hugepage_fallback;
  EXPECT_NE(report.hugepage_fallback.find("vm.nr_hugepages="), std::string::npos)
      << report.hugepage_fallback;
  ASSERT_EQ((*arena)->chunk_count(), 2u);
  (*arena)->chunk(1).data()[4 * kMiB - 1] = 7;  // the memory is there
  EXPECT_EQ((*arena)->capacity_bytes(), 8 * kMiB);
}

TEST(Arena, HugepageFallbackNamesAChunkSizeThatIsNotAHugepageMultiple) {
  if (DefaultHugePageBytes() != 2 * kMiB) GTEST_SKIP() << "hugepage size is not 2 MiB";
  ArenaOptions o = SmallArena();
  o.size_bytes = 6 * kMiB;
  o.chunk_size_bytes = 3 * kMiB;
  o.hugepages = true;
  ArenaBuildReport report;
  Result<std::unique_ptr<Arena>> arena = Arena::Build(o, &report);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ(report.hugepage_chunks, 0u);
  EXPECT_NE(report.hugepage_fallback.find(
                "chunk size 3.00 MiB is not a multiple of the hugepage size 2.00 MiB"),
            std::string::npos)
      << report.hugepage_fallback;
  EXPECT_EQ(report.hugepage_fallback.find("not enough hugepages"), std::string::npos)
      << report.hugepage_fallback;
}

TEST(Arena, HugepageFallbackNamesAPartialLastChunk) {
  if (DefaultHugePageBytes() != 2 * kMiB) GTEST_SKIP() << "hugepage size is not 2 MiB";
  // One chunk of 1 MiB: the chunk size is a hugepage multiple, the last
  // (only) chunk is not, so it silently used normal pages before.
  ArenaOptions o = SmallArena();
  o.size_bytes = 1 * kMiB;
  o.chunk_size_bytes = 2 * kMiB;
  o.hugepages = true;
  ArenaBuildReport report;
  Result<std::unique_ptr<Arena>> arena = Arena::Build(o, &report);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ(report.hugepage_chunks, 0u);
  EXPECT_NE(report.hugepage_fallback.find("the last chunk (chunk 0, 1.00 MiB) is not a multiple "
                                          "of the hugepage size 2.00 MiB"),
            std::string::npos)
      << report.hugepage_fallback;
}

TEST(Arena, BindsToAnExistingNumaNode) {
  ArenaOptions o = SmallArena();
  o.numa_node = 0;
  ArenaBuildReport report;
  Result<std::unique_ptr<Arena>> arena = Arena::Build(o, &report);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  (*arena)->chunk(0).data()[0] = 1;
}

TEST(Arena, RefusesANumaNodeThatDoesNotExist) {
  ArenaOptions o = SmallArena();
  o.numa_node = 999;
  ArenaBuildReport report;
  Result<std::unique_ptr<Arena>> arena = Arena::Build(o, &report);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(arena.status().message().find("node 999 does not exist"), std::string::npos)
      << arena.status().message();
}

TEST(Arena, LockedWhenPermittedOtherwiseSaysWhy) {
  ArenaBuildReport report;
  Result<std::unique_ptr<Arena>> arena = Arena::Build(SmallArena(), &report);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ(report.mlocked, (*arena)->mlocked());
  if (!report.mlocked) {
    EXPECT_NE(report.mlock_problem.find("RLIMIT_MEMLOCK"), std::string::npos);
  }
  // Every page is faulted in and usable, locked or not.
  for (uint32_t c = 0; c < (*arena)->chunk_count(); ++c) (*arena)->chunk(c).data()[12345] = 1;
}

}  // namespace
}  // namespace memoffload::daemon
