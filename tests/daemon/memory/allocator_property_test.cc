// Randomised test of ExtentAllocator against a reference model: a sorted map
// of free page ranges. For every operation the allocator must succeed exactly
// when the model says it can, hand out only pages the model holds free, and
// agree with the model on free bytes per chunk and on the largest free extent.
// Requests go anywhere, to a list of chunks, or to a pool; chunks move between
// pools at random, full or not. Seeded (one seed per test instance) so a
// failure reproduces.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "memory/allocator.h"

namespace memoffload::daemon {
namespace {

constexpr int kOpsPerSeed = 100000;
constexpr int kSeeds = 24;  // 2.4 million operations in total
constexpr int kInvariantEvery = 1000;

// Free pages as (chunk, first page) -> page count, coalesced.
class Model {
 public:
  explicit Model(const std::vector<uint64_t>& chunk_pages) : chunk_free_(chunk_pages) {
    for (uint32_t c = 0; c < chunk_pages.size(); ++c) runs_[{c, 0}] = chunk_pages[c];
  }

  // Marks [page, page + pages) of `chunk` used; false if any page is not free.
  bool Take(uint32_t chunk, uint64_t page, uint64_t pages) {
    auto it = Containing(chunk, page);
    if (it == runs_.end() || page + pages > End(it)) return false;
    const uint64_t start = it->first.second, end = End(it);
    runs_.erase(it);
    if (start < page) runs_[{chunk, start}] = page - start;
    if (page + pages < end) runs_[{chunk, page + pages}] = end - page - pages;
    chunk_free_[chunk] -= pages;
    return true;
  }

  void Give(uint32_t chunk, uint64_t page, uint64_t pages) {
    chunk_free_[chunk] += pages;
    auto next = runs_.lower_bound({chunk, page});
    if (next != runs_.end() && next->first == std::make_pair(chunk, page + pages)) {
      pages += next->second;
      next = runs_.erase(next);
    }
    if (next != runs_.begin()) {
      auto prev = std::prev(next);
      if (prev->first.first == chunk && End(prev) == page) {
        prev->second += pages;
        return;
      }
    }
    runs_[{chunk, page}] = pages;
  }

  bool IntersectsFree(uint32_t chunk, uint64_t page, uint64_t pages) const {
    auto it = runs_.upper_bound({chunk, page});
    if (it != runs_.end() && it->first.first == chunk && it->first.second < page + pages) {
      return true;
    }
    if (it == runs_.begin()) return false;
    --it;
    return it->first.first == chunk && End(it) > page;
  }

  uint64_t FreePages(const std::vector<bool>* allowed) const {
    uint64_t total = 0;
    for (size_t c = 0; c < chunk_free_.size(); ++c) {
      if (allowed == nullptr || (*allowed)[c]) total += chunk_free_[c];
    }
    return total;
  }

  uint64_t LargestRun(const std::vector<bool>* allowed) const {
    uint64_t best = 0;
    for (const auto& [key, pages] : runs_) {
      if (allowed == nullptr || (*allowed)[key.first]) best = std::max(best, pages);
    }
    return best;
  }

  size_t run_count() const { return runs_.size(); }
  uint64_t chunk_free(uint32_t c) const { return chunk_free_[c]; }

 private:
  using Runs = std::map<std::pair<uint32_t, uint64_t>, uint64_t>;
  static uint64_t End(Runs::const_iterator it) { return it->first.second + it->second; }
  Runs::iterator Containing(uint32_t chunk, uint64_t page) {
    auto it = runs_.upper_bound({chunk, page});
    if (it == runs_.begin()) return runs_.end();
    --it;
    if (it->first.first != chunk || End(it) <= page) return runs_.end();
    return it;
  }

  Runs runs_;
  std::vector<uint64_t> chunk_free_;
};

class ExtentAllocatorPropertyTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    rng_.seed(static_cast<uint64_t>(GetParam()) * 0x9E3779B97F4A7C15ull + 1);
    page_ = uint64_t{1} << Uniform(9, 16);
    // Every fourth seed has many chunks, so searches restricted to some of
    // them (allowed_chunks) have many per-chunk lists to choose from.
    const int chunks = static_cast<int>(GetParam() % 4 == 1 ? Uniform(9, 40) : Uniform(1, 8));
    // Every third seed uses chunks of nearly equal size, which share a size
    // class; the others mix mid-sized chunks with an occasional tiny one.
    const bool similar = GetParam() % 3 == 0;
    const uint64_t base = Uniform(64, 300);
    for (int c = 0; c < chunks; ++c) {
      const uint64_t pages = similar              ? base + Uniform(0, 3)
                             : Uniform(0, 9) == 0 ? Uniform(1, 3)
                                                  : Uniform(16, 400);
      chunk_pages_.push_back(pages);
      capacity_pages_ += pages;
    }
    std::vector<uint64_t> sizes;
    for (uint64_t p : chunk_pages_) sizes.push_back(p * page_);
    alloc_ = std::make_unique<ExtentAllocator>(sizes, page_);
    // Tenant-style restrictions: fixed sets of chunks, as the daemon's
    // tenant mode passes (chunk c belongs to tenant c % kTenants).
    tenant_chunks_.assign(kTenants, std::vector<bool>(chunks, false));
    for (int c = 0; c < chunks; ++c) tenant_chunks_[c % kTenants][c] = true;
    pool_of_.assign(chunks, 0);
    // Odd seeds search no chunk list in their first half: the per-chunk
    // lists are then built from a well-used arena, not an empty one.
    lists_from_ = GetParam() % 2 == 1 ? kOpsPerSeed / 2 : 0;
    model_ = std::make_unique<Model>(chunk_pages_);
  }

  uint64_t Uniform(uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
  }

  // Mostly small requests; some medium, some near the largest free extent
  // (where a good fit has to search its own size class), some too large.
  // `allowed`: the chunks the request may use (nullptr: all).
  uint64_t RandomRequestBytes(const std::vector<bool>* allowed) {
    const uint64_t roll = Uniform(0, 19);
    const uint64_t largest = model_->LargestRun(allowed);
    uint64_t pages;
    if (roll < 11) {
      pages = Uniform(1, 8);
    } else if (roll < 16) {
      pages = Uniform(1, capacity_pages_ / 8 + 1);
    } else if (roll < 18 && largest > 4) {
      pages = largest - Uniform(0, 4);
    } else {
      pages = Uniform(1, capacity_pages_ + capacity_pages_ / 4);
    }
    return (pages - 1) * page_ + Uniform(1, page_);
  }

  void CheckTotals(const char* op) {
    uint64_t model_free = model_->FreePages(nullptr);
    ASSERT_EQ(alloc_->free_bytes(), model_free * page_) << op;
    for (uint32_t c = 0; c < chunk_pages_.size(); ++c) {
      ASSERT_EQ(alloc_->chunk_free_bytes(c), model_->chunk_free(c) * page_) << op;
    }
    ASSERT_EQ(alloc_->largest_free_extent_bytes(), model_->LargestRun(nullptr) * page_) << op;
  }

  void DoAllocate(int op);
  void DoMovePool();
  void DoFreeAll();
  void DoTrim();
  void DoFreeSubRange();
  void DoInvalidFree();

  std::mt19937_64 rng_;
  uint64_t page_ = 0;
  uint64_t capacity_pages_ = 0;
  std::vector<uint64_t> chunk_pages_;
  std::unique_ptr<ExtentAllocator> alloc_;
  std::unique_ptr<Model> model_;
  std::vector<std::vector<Extent>> live_;  // each entry: one allocation
  static constexpr int kTenants = 3;
  std::vector<std::vector<bool>> tenant_chunks_;
  static constexpr uint32_t kPools = 4;
  std::vector<uint32_t> pool_of_;  // by chunk, as the allocator was told
  int lists_from_ = 0;             // the first op that may search a chunk list
};

void ExtentAllocatorPropertyTest::DoAllocate(int op) {
  // 2/5 unrestricted, 1/5 each a tenant's chunks, random chunks, a pool.
  std::vector<bool> allowed(chunk_pages_.size(), true);
  uint64_t how = Uniform(0, 4);
  if (op < lists_from_ && (how == 2 || how == 3)) how = 4;
  const bool restrict = how >= 2;
  const uint32_t pool = static_cast<uint32_t>(Uniform(0, kPools - 1));
  if (how == 2) {
    allowed = tenant_chunks_[Uniform(0, kTenants - 1)];
  } else if (how == 3) {
    for (size_t c = 0; c < allowed.size(); ++c) allowed[c] = Uniform(0, 1) == 1;
  } else if (how == 4) {
    for (size_t c = 0; c < allowed.size(); ++c) allowed[c] = pool_of_[c] == pool;
  }
  const std::vector<bool>* allowed_ptr = restrict ? &allowed : nullptr;
  const uint64_t bytes = RandomRequestBytes(allowed_ptr);
  const uint64_t pages = (bytes + page_ - 1) / page_;
  const bool single = Uniform(0, 4) == 0;
  const uint64_t free_pages = model_->FreePages(allowed_ptr);
  const uint64_t largest = model_->LargestRun(allowed_ptr);
  const bool expect_ok = single ? largest >= pages : free_pages >= pages;
  // Restricted requests go through Allocate (vector<bool>) or AllocateIn
  // (a shuffled list of the same chunks) alike.
  Result<std::vector<Extent>> r = InvalidArgument("not called");
  if (how == 4) {
    std::vector<Extent> out;
    const Status st = alloc_->AllocateInPool(bytes, single, pool, &out);
    if (st.ok()) {
      r = std::move(out);
    } else {
      ASSERT_TRUE(out.empty()) << "a failed allocation left extents behind";
      r = st;
    }
  } else if (restrict && Uniform(0, 1) == 1) {
    std::vector<uint32_t> list;
    for (uint32_t c = 0; c < allowed.size(); ++c) {
      if (allowed[c]) list.push_back(c);
    }
    std::shuffle(list.begin(), list.end(), rng_);
    r = alloc_->AllocateIn(bytes, single, list);
  } else {
    r = alloc_->Allocate(bytes, single, allowed_ptr);
  }
  ASSERT_EQ(r.ok(), expect_ok) << "bytes " << bytes << " single " << single << " model free pages "
                               << free_pages << " largest " << largest << ": "
                               << r.status().ToString();
  if (!r.ok()) {
    ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
    // The message names the longest free extent where the caller may
    // allocate, which checks the (restricted) largest-extent search.
    const std::string want = "largest free extent " + std::to_string(largest * page_) + " bytes";
    ASSERT_NE(r.status().message().find(want), std::string::npos)
        << "want '" << want << "' in: " << r.status().message();
    return;
  }
  uint64_t total = 0;
  for (const Extent& e : *r) {
    ASSERT_TRUE(allowed[e.chunk]);
    ASSERT_EQ(e.offset % page_, 0u);
    ASSERT_GT(e.length, 0u);
    ASSERT_TRUE(model_->Take(e.chunk, e.offset / page_, e.length / page_))
        << "handed out pages that are not free: chunk " << e.chunk << " offset " << e.offset
        << " length " << e.length;
    total += e.length;
  }
  ASSERT_EQ(total, pages * page_);
  if (largest >= pages) {
    ASSERT_EQ(r->size(), 1u) << "a single extent fitted";
  }
  live_.push_back(std::move(*r));
}

void ExtentAllocatorPropertyTest::DoMovePool() {
  const uint32_t chunk = static_cast<uint32_t>(Uniform(0, chunk_pages_.size() - 1));
  const uint32_t pool = static_cast<uint32_t>(Uniform(0, kPools - 1));
  const Status st = alloc_->SetChunkPool(chunk, pool);
  ASSERT_TRUE(st.ok()) << st.ToString();
  pool_of_[chunk] = pool;
  ASSERT_EQ(alloc_->chunk_pool(chunk), pool);
}

void ExtentAllocatorPropertyTest::DoFreeAll() {
  const size_t k = Uniform(0, live_.size() - 1);
  std::vector<Extent> extents = std::move(live_[k]);
  live_[k] = std::move(live_.back());
  live_.pop_back();
  std::shuffle(extents.begin(), extents.end(), rng_);
  for (const Extent& e : extents) {
    const Status st = alloc_->Free(e);
    ASSERT_TRUE(st.ok()) << st.ToString();
    model_->Give(e.chunk, e.offset / page_, e.length / page_);
  }
}

void ExtentAllocatorPropertyTest::DoTrim() {
  const size_t k = Uniform(0, live_.size() - 1);
  uint64_t total = 0;
  for (const Extent& e : live_[k]) total += e.length;
  const uint64_t keep_bytes = Uniform(0, total + page_);
  auto kept = alloc_->Trim(live_[k], keep_bytes);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  uint64_t keep_pages = std::min((keep_bytes + page_ - 1) / page_, total / page_);
  std::vector<Extent> expected;
  for (const Extent& e : live_[k]) {
    const uint64_t pages = e.length / page_;
    const uint64_t keep = std::min(pages, keep_pages);
    keep_pages -= keep;
    if (keep > 0) expected.push_back(Extent{e.chunk, e.offset, keep * page_});
    if (keep < pages) model_->Give(e.chunk, e.offset / page_ + keep, pages - keep);
  }
  ASSERT_EQ(*kept, expected);
  if (expected.empty()) {
    live_[k] = std::move(live_.back());
    live_.pop_back();
  } else {
    live_[k] = std::move(expected);
  }
}

void ExtentAllocatorPropertyTest::DoFreeSubRange() {
  const size_t k = Uniform(0, live_.size() - 1);
  std::vector<Extent>& extents = live_[k];
  const size_t j = Uniform(0, extents.size() - 1);
  const Extent e = extents[j];
  const uint64_t pages = e.length / page_;
  const uint64_t first = Uniform(0, pages - 1);
  const uint64_t count = Uniform(1, pages - first);
  const Extent sub{e.chunk, e.offset + first * page_, count * page_};
  const Status st = alloc_->Free(sub);
  ASSERT_TRUE(st.ok()) << st.ToString();
  model_->Give(e.chunk, e.offset / page_ + first, count);
  extents.erase(extents.begin() + j);
  if (first + count < pages) {
    extents.insert(extents.begin() + j,
                   Extent{e.chunk, sub.offset + sub.length, (pages - first - count) * page_});
  }
  if (first > 0) extents.insert(extents.begin() + j, Extent{e.chunk, e.offset, first * page_});
  if (extents.empty()) {
    live_[k] = std::move(live_.back());
    live_.pop_back();
  }
}

void ExtentAllocatorPropertyTest::DoInvalidFree() {
  const uint32_t chunks = static_cast<uint32_t>(chunk_pages_.size());
  const uint32_t chunk = static_cast<uint32_t>(Uniform(0, chunks - 1));
  Extent bad;
  switch (Uniform(0, 3)) {
    case 0: {  // a random range that touches a free page
      const uint64_t page = Uniform(0, chunk_pages_[chunk] - 1);
      const uint64_t count = Uniform(1, chunk_pages_[chunk] - page);
      if (!model_->IntersectsFree(chunk, page, count)) return;
      bad = Extent{chunk, page * page_, count * page_};
      break;
    }
    case 1: {  // a live extent grown by one page: crosses an extent boundary
      if (live_.empty()) return;
      const auto& extents = live_[Uniform(0, live_.size() - 1)];
      bad = extents[Uniform(0, extents.size() - 1)];
      if (Uniform(0, 1) == 0 && bad.offset > 0) bad.offset -= page_;
      bad.length += page_;
      break;
    }
    case 2:  // misaligned
      bad = Extent{chunk, Uniform(1, page_ - 1), page_};
      break;
    default:  // out of range
      bad = Uniform(0, 1) == 0 ? Extent{chunks + static_cast<uint32_t>(Uniform(0, 3)), 0, page_}
                               : Extent{chunk, chunk_pages_[chunk] * page_, page_};
  }
  const uint64_t free_before = alloc_->free_bytes();
  const Status st = alloc_->Free(bad);
  ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition)
      << "chunk " << bad.chunk << " offset " << bad.offset << " length " << bad.length;
  ASSERT_EQ(alloc_->free_bytes(), free_before);
}

TEST_P(ExtentAllocatorPropertyTest, AgreesWithReferenceModel) {
  for (int op = 1; op <= kOpsPerSeed; ++op) {
    const uint64_t roll = Uniform(0, 99);
    const char* name;
    if (live_.empty() || roll < 47) {
      name = "allocate";
      ASSERT_NO_FATAL_FAILURE(DoAllocate(op));
    } else if (roll < 48) {
      name = "move a chunk to another pool";
      ASSERT_NO_FATAL_FAILURE(DoMovePool());
    } else if (roll < 80) {
      name = "free";
      ASSERT_NO_FATAL_FAILURE(DoFreeAll());
    } else if (roll < 90) {
      name = "trim";
      ASSERT_NO_FATAL_FAILURE(DoTrim());
    } else if (roll < 95) {
      name = "free sub-range";
      ASSERT_NO_FATAL_FAILURE(DoFreeSubRange());
    } else {
      name = "invalid free";
      ASSERT_NO_FATAL_FAILURE(DoInvalidFree());
    }
    ASSERT_NO_FATAL_FAILURE(CheckTotals(name)) << "op " << op;
    if (op % kInvariantEvery == 0) {
      const Status st = alloc_->CheckInvariants();
      ASSERT_TRUE(st.ok()) << "after op " << op << " (" << name << "): " << st.ToString();
    }
  }
  while (!live_.empty()) ASSERT_NO_FATAL_FAILURE(DoFreeAll());
  ASSERT_NO_FATAL_FAILURE(CheckTotals("drain"));
  EXPECT_EQ(alloc_->free_bytes(), alloc_->capacity_bytes());
  EXPECT_EQ(model_->run_count(), chunk_pages_.size());
  const Status st = alloc_->CheckInvariants();
  EXPECT_TRUE(st.ok()) << st.ToString();
}

INSTANTIATE_TEST_SUITE_P(Seeds, ExtentAllocatorPropertyTest, ::testing::Range(1, kSeeds + 1));

}  // namespace
}  // namespace memoffload::daemon
