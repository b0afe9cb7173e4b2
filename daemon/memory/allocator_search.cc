// ExtentAllocator's searches: where a request fits in a scope (one pool, a
// list of chunks, or every chunk), the largest free extent, and moving a
// chunk between pools. The node bookkeeping is in allocator.cc.
#include <algorithm>

#include "memory/allocator.h"

namespace memoffload::daemon {

// Good fit: a free node of >= pages in the scope, or kNoNode. In one pool
// (or every chunk while all are in one pool) it is O(1): the own class's
// head, then the first non-empty class above the request's, found by
// find-first-set; with `exact` it then scans the own class, so kNoNode means
// nothing fits. Over several lists (chunks, or pools) the same in each, and
// the smallest class found wins.
uint32_t ExtentAllocator::FindFit(uint64_t pages, bool exact, Scope scope) {
  if (scope.chunks != nullptr) {
    return BestFitAmong(chunk_lists_, chunk_free_pages_, scope.chunks, pages, exact);
  }
  if (scope.pool == kEveryPool && pool_lists_.size() > 1) {
    return BestFitAmong(pool_lists_, pool_free_pages_, nullptr, pages, exact);
  }
  SizeClassLists& lists = pool_lists_[scope.pool == kEveryPool ? 0 : scope.pool];
  const int own = SizeClassOf(pages);
  const uint32_t head = lists.Head(own);
  if (head != kNoNode && nodes_[head].length >= pages) return head;
  // Every member of a class above the own one is long enough.
  const int above = lists.FirstAtOrAbove(own + 1);
  if (above != kNoClass) return lists.Head(above);
  return exact ? lists.FindIn(nodes_, own, pages) : kNoNode;
}

uint32_t ExtentAllocator::BestFitAmong(std::vector<SizeClassLists>& lists,
                                       const std::vector<uint64_t>& free_pages,
                                       const std::vector<uint32_t>* which, uint64_t pages,
                                       bool exact) {
  const int own = SizeClassOf(pages);
  const size_t count = which != nullptr ? which->size() : lists.size();
  int best_rank = kNoClass;
  uint32_t best = kNoNode;
  for (size_t k = 0; k < count; ++k) {
    const uint32_t c = which != nullptr ? (*which)[k] : static_cast<uint32_t>(k);
    if (free_pages[c] < pages) continue;
    const SizeClassLists& l = lists[c];
    int rank = l.FirstAtOrAbove(own);
    if (rank == own) {
      // Own class: only the head is checked here (members vary in length).
      const uint32_t head = l.Head(own);
      if (nodes_[head].length >= pages) return head;
      rank = l.FirstAtOrAbove(own + 1);
    }
    if (rank < best_rank) {
      best_rank = rank;
      best = c;
    }
  }
  if (best != kNoNode) return lists[best].Head(best_rank);
  if (!exact) return kNoNode;
  for (size_t k = 0; k < count; ++k) {
    const uint32_t c = which != nullptr ? (*which)[k] : static_cast<uint32_t>(k);
    if (free_pages[c] < pages) continue;
    const uint32_t i = lists[c].FindIn(nodes_, own, pages);
    if (i != kNoNode) return i;
  }
  return kNoNode;
}

// A node of the highest non-empty class in the scope: the longest of that
// class with `longest`, else the first (O(1) in one pool).
uint32_t ExtentAllocator::Largest(Scope scope, bool longest) const {
  if (scope.chunks != nullptr) return LargestAmong(chunk_lists_, scope.chunks, longest);
  if (scope.pool == kEveryPool && pool_lists_.size() > 1) {
    return LargestAmong(pool_lists_, nullptr, longest);
  }
  const SizeClassLists& lists = pool_lists_[scope.pool == kEveryPool ? 0 : scope.pool];
  const int top = lists.Top();
  return longest ? lists.LongestIn(nodes_, top) : lists.Head(top);
}

uint32_t ExtentAllocator::LargestAmong(const std::vector<SizeClassLists>& lists,
                                       const std::vector<uint32_t>* which, bool longest) const {
  const size_t count = which != nullptr ? which->size() : lists.size();
  auto at = [&](size_t k) { return which != nullptr ? (*which)[k] : static_cast<uint32_t>(k); };
  int top = -1;
  for (size_t k = 0; k < count; ++k) top = std::max(top, lists[at(k)].Top());
  uint32_t best = kNoNode;
  for (size_t k = 0; k < count; ++k) {
    const SizeClassLists& l = lists[at(k)];
    const uint32_t i = longest ? l.LongestIn(nodes_, top) : l.Head(top);
    if (i == kNoNode) continue;
    if (!longest) return i;
    if (best == kNoNode || nodes_[i].length > nodes_[best].length) best = i;
  }
  return best;
}

uint64_t ExtentAllocator::LongestFreePages(Scope scope) const {
  const uint32_t i = Largest(scope, /*longest=*/true);
  return i == kNoNode ? 0 : nodes_[i].length;
}

uint64_t ExtentAllocator::FreePages(Scope scope) const {
  if (scope.chunks != nullptr) {
    uint64_t free_pages = 0;
    for (uint32_t c : *scope.chunks) free_pages += chunk_free_pages_[c];
    return free_pages;
  }
  return scope.pool == kEveryPool ? free_pages_ : pool_free_pages_[scope.pool];
}

Status ExtentAllocator::SetChunkPool(uint32_t chunk, uint32_t pool) {
  if (chunk >= chunk_pages_.size()) {
    return InvalidArgument("chunk " + std::to_string(chunk) + " out of range: the arena has " +
                           std::to_string(chunk_pages_.size()) + " chunks");
  }
  if (pool >= kMaxPools) {
    return InvalidArgument("pool " + std::to_string(pool) + " out of range (at most " +
                           std::to_string(kMaxPools) + " pools)");
  }
  const uint32_t old = chunk_pool_[chunk];
  if (old == pool) return Status::Ok();
  while (pool_lists_.size() <= pool) {
    pool_lists_.emplace_back(max_chunk_pages_, kPoolLists);
    pool_free_pages_.push_back(0);
  }
  // Node `chunk` is the chunk's first; its free nodes change lists.
  for (uint32_t i = chunk; i != kNoNode; i = nodes_[i].next_phys) {
    if (!nodes_[i].is_free) continue;
    pool_lists_[old].Remove(nodes_, i);
    pool_lists_[pool].Insert(nodes_, i);
  }
  pool_free_pages_[old] -= chunk_free_pages_[chunk];
  pool_free_pages_[pool] += chunk_free_pages_[chunk];
  chunk_pool_[chunk] = pool;
  return Status::Ok();
}

}  // namespace memoffload::daemon
