// Unit tests of ExtentAllocator: splitting, coalescing, exhaustion, page
// rounding, multi-extent allocation, allowed chunks, Trim and invalid frees.
#include "memory/allocator.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace memoffload::daemon {
namespace {

constexpr uint64_t kPage = 4096;

uint64_t Pages(uint64_t n) { return n * kPage; }

#define EXPECT_INVARIANTS(alloc)                  \
  do {                                            \
    const Status _st = (alloc).CheckInvariants(); \
    EXPECT_TRUE(_st.ok()) << _st.ToString();      \
  } while (0)

// Allocates `bytes` and expects exactly one extent.
Extent AllocOne(ExtentAllocator& alloc, uint64_t bytes) {
  auto r = alloc.Allocate(bytes);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return Extent{};
  EXPECT_EQ(r->size(), 1u);
  return r->front();
}

uint64_t Sum(const std::vector<Extent>& extents) {
  uint64_t total = 0;
  for (const Extent& e : extents) total += e.length;
  return total;
}

TEST(ExtentAllocatorTest, StartsEmpty) {
  ExtentAllocator alloc({Pages(16), Pages(8)}, kPage);
  EXPECT_EQ(alloc.capacity_bytes(), Pages(24));
  EXPECT_EQ(alloc.free_bytes(), Pages(24));
  EXPECT_EQ(alloc.used_bytes(), 0u);
  EXPECT_EQ(alloc.largest_free_extent_bytes(), Pages(16));
  EXPECT_EQ(alloc.page_bytes(), kPage);
  EXPECT_EQ(alloc.chunk_count(), 2u);
  EXPECT_EQ(alloc.chunk_free_bytes(1), Pages(8));
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, RoundsUpToPages) {
  ExtentAllocator alloc({Pages(16)}, kPage);
  EXPECT_EQ(AllocOne(alloc, 1), (Extent{0, 0, Pages(1)}));
  EXPECT_EQ(AllocOne(alloc, kPage + 1), (Extent{0, Pages(1), Pages(2)}));
  EXPECT_EQ(AllocOne(alloc, kPage), (Extent{0, Pages(3), Pages(1)}));
  EXPECT_EQ(alloc.used_bytes(), Pages(4));
  EXPECT_INVARIANTS(alloc);
  auto zero = alloc.Allocate(0);
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
}

TEST(ExtentAllocatorTest, SplitLeavesRemainderFree) {
  ExtentAllocator alloc({Pages(16)}, kPage);
  EXPECT_EQ(AllocOne(alloc, Pages(4)), (Extent{0, 0, Pages(4)}));
  EXPECT_EQ(alloc.free_bytes(), Pages(12));
  EXPECT_EQ(alloc.largest_free_extent_bytes(), Pages(12));
  EXPECT_EQ(alloc.chunk_free_bytes(0), Pages(12));
  EXPECT_INVARIANTS(alloc);
}

class ExtentAllocatorCoalesceTest : public ::testing::Test {
 protected:
  ExtentAllocatorCoalesceTest() : alloc_({Pages(12)}, kPage) {
    a_ = AllocOne(alloc_, Pages(4));
    b_ = AllocOne(alloc_, Pages(4));
    c_ = AllocOne(alloc_, Pages(4));
  }
  ExtentAllocator alloc_;
  Extent a_, b_, c_;
};

TEST_F(ExtentAllocatorCoalesceTest, WithLeftNeighbour) {
  ASSERT_TRUE(alloc_.Free(a_).ok());
  ASSERT_TRUE(alloc_.Free(b_).ok());
  EXPECT_EQ(alloc_.largest_free_extent_bytes(), Pages(8));
  EXPECT_INVARIANTS(alloc_);
  EXPECT_EQ(AllocOne(alloc_, Pages(8)), (Extent{0, 0, Pages(8)}));
}

TEST_F(ExtentAllocatorCoalesceTest, WithRightNeighbour) {
  ASSERT_TRUE(alloc_.Free(c_).ok());
  ASSERT_TRUE(alloc_.Free(b_).ok());
  EXPECT_EQ(alloc_.largest_free_extent_bytes(), Pages(8));
  EXPECT_INVARIANTS(alloc_);
  EXPECT_EQ(AllocOne(alloc_, Pages(8)), (Extent{0, Pages(4), Pages(8)}));
}

TEST_F(ExtentAllocatorCoalesceTest, WithBothNeighbours) {
  ASSERT_TRUE(alloc_.Free(a_).ok());
  ASSERT_TRUE(alloc_.Free(c_).ok());
  EXPECT_EQ(alloc_.largest_free_extent_bytes(), Pages(4));
  EXPECT_INVARIANTS(alloc_);
  ASSERT_TRUE(alloc_.Free(b_).ok());
  EXPECT_EQ(alloc_.largest_free_extent_bytes(), Pages(12));
  EXPECT_EQ(alloc_.free_bytes(), Pages(12));
  EXPECT_INVARIANTS(alloc_);
}

TEST(ExtentAllocatorTest, ExhaustionNamesTheNumbersAndChangesNothing) {
  ExtentAllocator alloc({Pages(8), Pages(8)}, kPage);
  AllocOne(alloc, Pages(6));
  AllocOne(alloc, Pages(7));
  auto r = alloc.Allocate(Pages(4));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("16384 bytes"), std::string::npos) << m;  // requested
  EXPECT_NE(m.find("12288 bytes free"), std::string::npos) << m;
  EXPECT_NE(m.find("largest free extent 8192 bytes"), std::string::npos) << m;
  EXPECT_EQ(alloc.free_bytes(), Pages(3));
  EXPECT_EQ(alloc.chunk_free_bytes(0) + alloc.chunk_free_bytes(1), Pages(3));
  EXPECT_EQ(alloc.largest_free_extent_bytes(), Pages(2));
  EXPECT_INVARIANTS(alloc);
  auto huge = alloc.Allocate(UINT64_MAX);
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(alloc.free_bytes(), Pages(3));
}

TEST(ExtentAllocatorTest, GathersSeveralExtentsWhenNoneFits) {
  ExtentAllocator alloc({Pages(8), Pages(8), Pages(8)}, kPage);
  const std::vector<bool> only0 = {true, false, false};
  const std::vector<bool> only2 = {false, false, true};
  const Extent a = alloc.Allocate(Pages(4), false, &only0)->front();
  ASSERT_TRUE(alloc.Allocate(Pages(4), false, &only0).ok());
  ASSERT_TRUE(alloc.Allocate(Pages(2), false, &only2).ok());
  ASSERT_TRUE(alloc.Free(a).ok());
  // Free: 4 pages in chunk 0, 8 in chunk 1, 6 in chunk 2.
  auto r = alloc.Allocate(Pages(15) + 1);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Sum(*r), Pages(16));
  // Largest extents whole, then a good fit for the remainder.
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ(r->at(0), (Extent{1, 0, Pages(8)}));
  EXPECT_EQ(r->at(1), (Extent{2, Pages(2), Pages(6)}));
  EXPECT_EQ(r->at(2), (Extent{0, 0, Pages(2)}));
  EXPECT_EQ(alloc.free_bytes(), Pages(2));
  EXPECT_INVARIANTS(alloc);
  for (const Extent& e : *r) ASSERT_TRUE(alloc.Free(e).ok());
  EXPECT_EQ(alloc.free_bytes(), Pages(18));
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, SingleExtentIsRefusedWhenOnlyPiecesFit) {
  ExtentAllocator alloc({Pages(8), Pages(8)}, kPage);
  auto r = alloc.Allocate(Pages(9), /*single_extent=*/true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("one extent"), std::string::npos);
  EXPECT_EQ(alloc.free_bytes(), Pages(16));
  EXPECT_INVARIANTS(alloc);
  auto multi = alloc.Allocate(Pages(9));
  ASSERT_TRUE(multi.ok());
  EXPECT_EQ(multi->size(), 2u);
}

TEST(ExtentAllocatorTest, SingleExtentFindsAFitInsideItsOwnClass) {
  // 131 and 128 pages share a size class; the 128-page extent heads the
  // list, so a 130-page request needs the class scan to succeed.
  ExtentAllocator alloc({Pages(131), Pages(128)}, kPage);
  auto r = alloc.Allocate(Pages(130), /*single_extent=*/true);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->front(), (Extent{0, 0, Pages(130)}));
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, ReusesAnExactHoleBeforeSplittingALargerOne) {
  ExtentAllocator alloc({Pages(64)}, kPage);
  AllocOne(alloc, Pages(1));
  const Extent hole = AllocOne(alloc, Pages(5));
  AllocOne(alloc, Pages(1));
  ASSERT_TRUE(alloc.Free(hole).ok());
  EXPECT_EQ(AllocOne(alloc, Pages(5)), hole);
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, AllowedChunksRestrictPlacement) {
  ExtentAllocator alloc({Pages(8), Pages(8), Pages(8)}, kPage);
  const std::vector<bool> only_two = {false, false, true};
  auto r = alloc.Allocate(Pages(3), false, &only_two);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->front().chunk, 2u);
  auto fill = alloc.Allocate(Pages(5), true, &only_two);
  ASSERT_TRUE(fill.ok());
  EXPECT_EQ(fill->front().chunk, 2u);
  auto full = alloc.Allocate(Pages(1), false, &only_two);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("0 bytes free in allowed chunks"), std::string::npos)
      << full.status().message();
  const std::vector<bool> zero_and_one = {true, true, false};
  auto spread = alloc.Allocate(Pages(12), false, &zero_and_one);
  ASSERT_TRUE(spread.ok());
  for (const Extent& e : *spread) EXPECT_NE(e.chunk, 2u);
  const std::vector<bool> wrong_size = {true};
  EXPECT_EQ(alloc.Allocate(1, false, &wrong_size).status().code(), StatusCode::kInvalidArgument);
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, RestrictedSearchTakesTheBestFitAcrossAllowedChunks) {
  // Chunk 0: a 40-page hole; chunk 1: a 5-page hole; chunk 2 (not allowed):
  // an exact 4-page hole. A 4-page request restricted to chunks 0 and 1
  // must take chunk 1's 5-page hole (the smaller class), not split chunk 0.
  ExtentAllocator alloc({Pages(41), Pages(6), Pages(5)}, kPage);
  auto take = [&](uint32_t chunk, uint64_t pages) {
    std::vector<bool> only(3, false);
    only[chunk] = true;
    auto r = alloc.Allocate(Pages(pages), true, &only);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->front() : Extent{};
  };
  take(0, 1);
  const Extent forty = take(0, 40);
  take(1, 1);
  const Extent five = take(1, 5);
  take(2, 1);
  const Extent four = take(2, 4);
  ASSERT_TRUE(alloc.Free(forty).ok());
  ASSERT_TRUE(alloc.Free(five).ok());
  ASSERT_TRUE(alloc.Free(four).ok());
  const std::vector<bool> zero_and_one = {true, true, false};
  auto r = alloc.Allocate(Pages(4), false, &zero_and_one);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ(r->front(), (Extent{1, Pages(1), Pages(4)}));
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, RestrictedSingleExtentScansItsOwnClassInEachChunk) {
  // 131 and 128 pages share a size class. Chunk 1 holds both kinds of hole
  // with the 128-page one heading its list; chunk 0 (not allowed) holds a
  // 131-page hole. A 130-page single extent restricted to chunk 1 must find
  // chunk 1's 131-page hole behind the head.
  ExtentAllocator alloc({Pages(131), Pages(260)}, kPage);
  const std::vector<bool> only_one = {false, true};
  auto a = alloc.Allocate(Pages(131), true, &only_one);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(alloc.Allocate(Pages(1), true, &only_one).ok());  // separates the holes
  auto b = alloc.Allocate(Pages(128), true, &only_one);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(alloc.chunk_free_bytes(1), 0u) << "chunk 1 is tiled by a, the 1 page and b";
  ASSERT_TRUE(alloc.Free(a->front()).ok());
  ASSERT_TRUE(alloc.Free(b->front()).ok());  // inserted last: heads the class list
  auto r = alloc.Allocate(Pages(130), true, &only_one);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->front(), (Extent{1, a->front().offset, Pages(130)}));
  // Nothing of 131 pages is left in chunk 1 now; the miss is reported.
  auto miss = alloc.Allocate(Pages(129), true, &only_one);
  ASSERT_FALSE(miss.ok());
  EXPECT_NE(miss.status().message().find("largest free extent " + std::to_string(Pages(128))),
            std::string::npos)
      << miss.status().message();
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, AllocateInTakesAChunkListAndRefusesBadOnes) {
  ExtentAllocator alloc({Pages(8), Pages(8), Pages(8)}, kPage);
  auto r = alloc.AllocateIn(Pages(10), false, {2, 0});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (const Extent& e : *r) EXPECT_NE(e.chunk, 1u);
  EXPECT_EQ(alloc.chunk_free_bytes(1), Pages(8));
  auto none = alloc.AllocateIn(Pages(1), false, {});
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
  auto out_of_range = alloc.AllocateIn(Pages(1), false, {1, 3});
  EXPECT_EQ(out_of_range.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(out_of_range.status().message().find("allowed chunk 3 out of range"), std::string::npos)
      << out_of_range.status().message();
  // A duplicate would count a chunk's free bytes twice.
  auto twice = alloc.AllocateIn(Pages(12), false, {1, 1});
  EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("allowed chunk 1 is listed twice"), std::string::npos)
      << twice.status().message();
  EXPECT_EQ(alloc.chunk_free_bytes(1), Pages(8));
  // Refusals leave no trace: the same list without the duplicate works.
  EXPECT_TRUE(alloc.AllocateIn(Pages(8), true, {1}).ok());
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, APoolSearchesOnlyItsChunksAndChunksMoveWithTheirFreeSpace) {
  ExtentAllocator alloc({Pages(8), Pages(8), Pages(8)}, kPage);
  ASSERT_TRUE(alloc.SetChunkPool(1, 2).ok());
  EXPECT_EQ(alloc.chunk_pool(1), 2u);
  std::vector<Extent> in_pool;
  ASSERT_TRUE(alloc.AllocateInPool(Pages(6), false, 2, &in_pool).ok());
  ASSERT_EQ(in_pool.size(), 1u);
  EXPECT_EQ(in_pool[0].chunk, 1u);
  // Pool 2 has 2 pages left: 3 do not fit there, though pool 0 has 16 free.
  std::vector<Extent> more;
  const Status full = alloc.AllocateInPool(Pages(3), false, 2, &more);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(
      full.message().find("in the pool's chunks, largest free extent " + std::to_string(Pages(2))),
      std::string::npos)
      << full.message();
  EXPECT_TRUE(more.empty());
  // Pool 0 (chunks 0 and 2) never lands in chunk 1.
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(alloc.AllocateInPool(Pages(8), true, 0, &more).ok());
  }
  for (const Extent& e : more) EXPECT_NE(e.chunk, 1u);
  EXPECT_EQ(alloc.chunk_free_bytes(1), Pages(2));
  // A pool nobody made has no room; bad numbers change nothing.
  EXPECT_EQ(alloc.AllocateInPool(Pages(1), false, 7, &more).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(alloc.SetChunkPool(3, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc.SetChunkPool(0, ExtentAllocator::kMaxPools).code(), StatusCode::kInvalidArgument);
  // A chunk in use moves with its free pages: pool 5 gets chunk 1's two.
  ASSERT_TRUE(alloc.SetChunkPool(1, 5).ok());
  EXPECT_EQ(alloc.AllocateInPool(Pages(1), false, 2, &more).code(), StatusCode::kResourceExhausted);
  std::vector<Extent> moved;
  ASSERT_TRUE(alloc.AllocateInPool(Pages(2), true, 5, &moved).ok());
  EXPECT_EQ(moved[0], (Extent{1, Pages(6), Pages(2)}));
  EXPECT_INVARIANTS(alloc);
  // Freed pages go back to the chunk's pool of now; unrestricted requests
  // search every pool.
  ASSERT_TRUE(alloc.Free(in_pool[0]).ok());
  EXPECT_EQ(alloc.largest_free_extent_bytes(), Pages(6));
  auto anywhere = alloc.Allocate(Pages(6), true);
  ASSERT_TRUE(anywhere.ok()) << anywhere.status().ToString();
  EXPECT_EQ(anywhere->front().chunk, 1u);
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, TrimKeepsAPrefixAndFreesTheTail) {
  ExtentAllocator alloc({Pages(16)}, kPage);
  const Extent e = AllocOne(alloc, Pages(10));
  auto kept = alloc.Trim({e}, Pages(3) + 1);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  ASSERT_EQ(kept->size(), 1u);
  EXPECT_EQ(kept->front(), (Extent{0, 0, Pages(4)}));
  EXPECT_EQ(alloc.free_bytes(), Pages(12));
  EXPECT_INVARIANTS(alloc);
  ASSERT_TRUE(alloc.Free(kept->front()).ok());
  EXPECT_EQ(alloc.largest_free_extent_bytes(), Pages(16));
}

TEST(ExtentAllocatorTest, TrimAcrossSeveralExtents) {
  ExtentAllocator alloc({Pages(4), Pages(4), Pages(4)}, kPage);
  auto r = alloc.Allocate(Pages(12));
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 3u);
  auto kept = alloc.Trim(*r, Pages(5));
  ASSERT_TRUE(kept.ok());
  ASSERT_EQ(kept->size(), 2u);
  EXPECT_EQ(kept->at(0), r->at(0));
  EXPECT_EQ(kept->at(1), (Extent{r->at(1).chunk, r->at(1).offset, Pages(1)}));
  EXPECT_EQ(alloc.free_bytes(), Pages(7));
  EXPECT_INVARIANTS(alloc);
  auto all = alloc.Trim(*kept, Pages(100));
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, *kept);
  auto none = alloc.Trim(*kept, 0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(alloc.free_bytes(), Pages(12));
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, TrimRejectsBadListsAndChangesNothing) {
  ExtentAllocator alloc({Pages(16)}, kPage);
  const Extent e = AllocOne(alloc, Pages(4));
  const Extent stray{0, Pages(8), Pages(2)};
  EXPECT_EQ(alloc.Trim({e, stray}, 0).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(alloc.Trim({e, e}, 0).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(alloc.free_bytes(), Pages(12));
  EXPECT_INVARIANTS(alloc);
}

TEST(ExtentAllocatorTest, FreesAPageAlignedSubRange) {
  ExtentAllocator alloc({Pages(16)}, kPage);
  const Extent e = AllocOne(alloc, Pages(10));
  ASSERT_TRUE(alloc.Free(Extent{0, Pages(3), Pages(2)}).ok());
  EXPECT_EQ(alloc.free_bytes(), Pages(8));
  EXPECT_INVARIANTS(alloc);
  EXPECT_EQ(alloc.Free(e).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(alloc.Free(Extent{0, Pages(7), Pages(3)}).ok());  // tail
  ASSERT_TRUE(alloc.Free(Extent{0, Pages(5), Pages(2)}).ok());
  ASSERT_TRUE(alloc.Free(Extent{0, 0, Pages(3)}).ok());
  EXPECT_EQ(alloc.largest_free_extent_bytes(), Pages(16));
  EXPECT_INVARIANTS(alloc);
}

class ExtentAllocatorInvalidFreeTest : public ::testing::Test {
 protected:
  ExtentAllocatorInvalidFreeTest() : alloc_({Pages(16), Pages(16)}, kPage) {
    const std::vector<bool> only0 = {true, false};
    a_ = alloc_.Allocate(Pages(4), true, &only0)->front();  // chunk 0 [0, 4)
    b_ = alloc_.Allocate(Pages(4), true, &only0)->front();  // chunk 0 [4, 8)
  }
  void ExpectRejected(const Extent& e) {
    const uint64_t free_before = alloc_.free_bytes();
    const Status st = alloc_.Free(e);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
    EXPECT_FALSE(st.message().empty());
    EXPECT_EQ(alloc_.free_bytes(), free_before);
    EXPECT_INVARIANTS(alloc_);
  }
  ExtentAllocator alloc_;
  Extent a_, b_;
};

TEST_F(ExtentAllocatorInvalidFreeTest, DoubleFree) {
  ASSERT_TRUE(alloc_.Free(a_).ok());
  ExpectRejected(a_);
  ASSERT_TRUE(alloc_.Free(b_).ok());
  EXPECT_EQ(alloc_.free_bytes(), Pages(32));
}

TEST_F(ExtentAllocatorInvalidFreeTest, NeverAllocated) {
  ExpectRejected(Extent{0, Pages(8), Pages(2)});
  ExpectRejected(Extent{1, 0, Pages(1)});
}

TEST_F(ExtentAllocatorInvalidFreeTest, OverlapsAFreeExtent) {
  ExpectRejected(Extent{0, Pages(6), Pages(4)});
}

TEST_F(ExtentAllocatorInvalidFreeTest, SpansTwoAllocations) {
  ExpectRejected(Extent{0, Pages(2), Pages(4)});
  ExpectRejected(Extent{0, 0, Pages(8)});
}

TEST_F(ExtentAllocatorInvalidFreeTest, Misaligned) {
  ExpectRejected(Extent{0, 1, Pages(1)});
  ExpectRejected(Extent{0, 0, Pages(1) + 1});
  ExpectRejected(Extent{0, 0, 0});
}

TEST_F(ExtentAllocatorInvalidFreeTest, OutOfRange) {
  ExpectRejected(Extent{2, 0, Pages(1)});
  ExpectRejected(Extent{0, Pages(16), Pages(1)});
  ExpectRejected(Extent{0, Pages(15), Pages(2)});
  ExpectRejected(Extent{0, UINT64_MAX - kPage + 1, Pages(1)});
}

TEST(ExtentAllocatorTest, ManyChunksFillAndDrain) {
  std::vector<uint64_t> chunks(100, Pages(64));
  ExtentAllocator alloc(chunks, kPage);
  std::vector<std::vector<Extent>> live;
  while (true) {
    auto r = alloc.Allocate(Pages(3) + 7);
    if (!r.ok()) break;
    live.push_back(*r);
  }
  EXPECT_LT(alloc.free_bytes(), Pages(4));
  EXPECT_INVARIANTS(alloc);
  for (const auto& extents : live) {
    for (const Extent& e : extents) ASSERT_TRUE(alloc.Free(e).ok());
  }
  EXPECT_EQ(alloc.free_bytes(), alloc.capacity_bytes());
  EXPECT_EQ(alloc.largest_free_extent_bytes(), Pages(64));
  EXPECT_INVARIANTS(alloc);
}

}  // namespace
}  // namespace memoffload::daemon
