// TLSF-class extent allocator. Sizes and offsets are kept in pages.
//
// Every chunk is tiled by nodes, free or allocated, linked in address order
// (prev_phys/next_phys). A chunk's first node is node number `chunk` and is
// never released: splits create the new node on the right and merges release
// the right-hand node. Free nodes sit in segregated size-class lists
// (SizeClassLists). Allocated nodes are indexed by their start in a hash
// map, which makes validating a Free O(1) when the extent begins where an
// allocated extent begins.
//
// Every free node is listed in its pool's class lists, so a search in one
// pool (a tenant's chunks) is O(1). Once a search restricted to a chunk list
// (allowed_chunks) has been made, it is also listed in its chunk's own lists,
// so such searches ask each allowed chunk in O(1) instead of scanning a
// pool's lists for members in allowed chunks. The searches are in
// allocator_search.cc.
#include "memory/allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace memoffload::daemon {
namespace {

// A start key packs (chunk, page offset) as chunk << kKeyShift | offset.
constexpr int kKeyShift = 40;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "ExtentAllocator: %s\n", what);
  std::abort();
}

// Checks the constructor's arguments (dies on a bad one) and returns the
// longest chunk in pages.
uint64_t ValidatedMaxPages(const std::vector<uint64_t>& chunk_sizes, uint64_t page_bytes) {
  if (page_bytes == 0 || (page_bytes & (page_bytes - 1)) != 0) {
    Die("page_bytes must be a power of two");
  }
  if (chunk_sizes.empty() || chunk_sizes.size() >= (1u << 23)) {
    Die("chunk count must be in [1, 2^23)");
  }
  uint64_t max_pages = 0;
  for (uint64_t bytes : chunk_sizes) {
    const uint64_t pages = bytes / page_bytes;
    if (pages == 0 || bytes % page_bytes != 0 || pages >= (uint64_t{1} << kKeyShift)) {
      Die("chunk sizes must be non-zero multiples of page_bytes");
    }
    max_pages = std::max(max_pages, pages);
  }
  return max_pages;
}

uint64_t Key(uint32_t chunk, uint64_t offset) { return (uint64_t{chunk} << kKeyShift) | offset; }

}  // namespace

ExtentAllocator::ExtentAllocator(const std::vector<uint64_t>& chunk_sizes, uint64_t page_bytes)
    : page_bytes_(page_bytes),
      max_chunk_pages_(ValidatedMaxPages(chunk_sizes, page_bytes)),
      index_(chunk_sizes.size() * 8 + 1024) {
  page_shift_ = Log2Floor(page_bytes);
  pool_lists_.emplace_back(max_chunk_pages_, kPoolLists);
  pool_free_pages_.push_back(0);
  chunk_pool_.assign(chunk_sizes.size(), 0);
  nodes_.reserve(chunk_sizes.size() * 8 + 1024);
  for (uint32_t c = 0; c < chunk_sizes.size(); ++c) {
    const uint64_t pages = chunk_sizes[c] >> page_shift_;
    ExtentNode& n = nodes_.emplace_back();
    n.length = pages;
    n.chunk = c;
    chunk_pages_.push_back(pages);
    chunk_free_pages_.push_back(pages);
    capacity_pages_ += pages;
    InsertFree(c);
  }
  free_pages_ = capacity_pages_;
  pool_free_pages_[0] = capacity_pages_;
}

std::string ExtentAllocator::Bytes(uint64_t pages) const {
  return std::to_string(ToBytes(pages)) + " bytes";
}
std::string ExtentAllocator::Describe(uint32_t chunk, uint64_t offset, uint64_t len) const {
  return "[chunk " + std::to_string(chunk) + " offset " + Bytes(offset) + " length " + Bytes(len) +
         "]";
}

uint32_t ExtentAllocator::NewNode() {
  if (spare_nodes_.empty()) {
    nodes_.emplace_back();
    return static_cast<uint32_t>(nodes_.size() - 1);
  }
  const uint32_t i = spare_nodes_.back();
  spare_nodes_.pop_back();
  return i;
}

// Lists free node i in its pool's class lists, and its chunk's once those
// exist.
void ExtentAllocator::InsertFree(uint32_t i) {
  const uint32_t chunk = nodes_[i].chunk;
  pool_lists_[chunk_pool_[chunk]].Insert(nodes_, i);
  if (!chunk_lists_.empty()) chunk_lists_[chunk].Insert(nodes_, i);
}
// Unlinks free node i from both; is_free is the caller's.
void ExtentAllocator::RemoveFree(uint32_t i) {
  const uint32_t chunk = nodes_[i].chunk;
  pool_lists_[chunk_pool_[chunk]].Remove(nodes_, i);
  if (!chunk_lists_.empty()) chunk_lists_[chunk].Remove(nodes_, i);
}

void ExtentAllocator::BuildChunkLists() {
  if (!chunk_lists_.empty()) return;
  chunk_lists_.reserve(chunk_pages_.size());
  for (uint32_t c = 0; c < chunk_pages_.size(); ++c) {
    chunk_lists_.emplace_back(chunk_pages_[c], kChunkLists);
    // Node c is the chunk's first: walk its nodes in address order.
    for (uint32_t i = c; i != kNoNode; i = nodes_[i].next_phys) {
      if (nodes_[i].is_free) chunk_lists_[c].Insert(nodes_, i);
    }
  }
}

// Splits node i after `pages` pages and returns the new right-hand node,
// which inherits i's state (indexed when allocated, not listed when free).
uint32_t ExtentAllocator::SplitAt(uint32_t i, uint64_t pages) {
  const uint32_t r = NewNode();
  ExtentNode& left = nodes_[i];
  ExtentNode& right = nodes_[r] = left;  // list links are set when listed
  right.offset += pages;
  right.length -= pages;
  right.prev_phys = i;
  if (left.next_phys != kNoNode) nodes_[left.next_phys].prev_phys = r;
  left.next_phys = r;
  left.length = pages;
  if (!right.is_free) index_.Put(Key(right.chunk, right.offset), r);
  return r;
}

// Allocates the first `pages` pages of free node i.
Extent ExtentAllocator::Carve(uint32_t i, uint64_t pages) {
  RemoveFree(i);
  if (nodes_[i].length > pages) InsertFree(SplitAt(i, pages));
  ExtentNode& n = nodes_[i];
  n.is_free = false;
  index_.Put(Key(n.chunk, n.offset), i);
  free_pages_ -= pages;
  chunk_free_pages_[n.chunk] -= pages;
  pool_free_pages_[chunk_pool_[n.chunk]] -= pages;
  return Extent{n.chunk, ToBytes(n.offset), ToBytes(pages)};
}

// Frees allocated node i and coalesces it with its free neighbours.
void ExtentAllocator::FreeNode(uint32_t i) {
  index_.Erase(Key(nodes_[i].chunk, nodes_[i].offset));
  free_pages_ += nodes_[i].length;
  chunk_free_pages_[nodes_[i].chunk] += nodes_[i].length;
  pool_free_pages_[chunk_pool_[nodes_[i].chunk]] += nodes_[i].length;
  const uint32_t left = nodes_[i].prev_phys;
  if (left != kNoNode && nodes_[left].is_free) {
    RemoveFree(left);
    Absorb(left, i);
    i = left;
  }
  const uint32_t right = nodes_[i].next_phys;
  if (right != kNoNode && nodes_[right].is_free) {
    RemoveFree(right);
    Absorb(i, right);
  }
  InsertFree(i);
}

// Merges node `right` into its left neighbour `left` and releases it.
void ExtentAllocator::Absorb(uint32_t left, uint32_t right) {
  nodes_[left].length += nodes_[right].length;
  nodes_[left].next_phys = nodes_[right].next_phys;
  if (nodes_[right].next_phys != kNoNode) {
    nodes_[nodes_[right].next_phys].prev_phys = left;
  }
  spare_nodes_.push_back(right);
}

// Frees pages [offset, offset + pages) of allocated node i.
void ExtentAllocator::FreeRange(uint32_t i, uint64_t offset, uint64_t pages) {
  if (nodes_[i].offset < offset) i = SplitAt(i, offset - nodes_[i].offset);
  if (nodes_[i].length > pages) SplitAt(i, pages);
  FreeNode(i);
}

Result<const std::vector<uint32_t>*> ExtentAllocator::ToList(const std::vector<bool>* allowed) {
  if (allowed == nullptr) return static_cast<const std::vector<uint32_t>*>(nullptr);
  if (allowed->size() != chunk_pages_.size()) {
    return InvalidArgument("allowed_chunks has " + std::to_string(allowed->size()) +
                           " entries, expected " + std::to_string(chunk_pages_.size()));
  }
  allowed_list_.clear();
  for (uint32_t c = 0; c < chunk_pages_.size(); ++c) {
    if ((*allowed)[c]) allowed_list_.push_back(c);
  }
  if (allowed_list_.size() == chunk_pages_.size()) {
    return static_cast<const std::vector<uint32_t>*>(nullptr);
  }
  BuildChunkLists();
  return static_cast<const std::vector<uint32_t>*>(&allowed_list_);
}

Result<const std::vector<uint32_t>*> ExtentAllocator::ToList(const std::vector<uint32_t>& allowed) {
  allowed_mark_.resize(chunk_pages_.size(), 0);
  Status bad = Status::Ok();
  size_t marked = 0;
  for (; marked < allowed.size(); ++marked) {
    const uint32_t c = allowed[marked];
    if (c >= chunk_pages_.size()) {
      bad = InvalidArgument("allowed chunk " + std::to_string(c) + " out of range: the arena has " +
                            std::to_string(chunk_pages_.size()) + " chunks");
      break;
    }
    if (allowed_mark_[c] != 0) {
      bad = InvalidArgument("allowed chunk " + std::to_string(c) + " is listed twice");
      break;
    }
    allowed_mark_[c] = 1;
  }
  for (size_t k = 0; k < marked; ++k) allowed_mark_[allowed[k]] = 0;
  if (!bad.ok()) return bad;
  if (allowed.size() == chunk_pages_.size()) {
    return static_cast<const std::vector<uint32_t>*>(nullptr);
  }
  BuildChunkLists();
  return &allowed;
}

Status ExtentAllocator::AllocateFrom(uint64_t bytes, bool single_extent, Scope scope,
                                     std::vector<Extent>* out) {
  if (bytes == 0) return InvalidArgument("cannot allocate 0 bytes");
  const uint64_t pages = (bytes >> page_shift_) + ((bytes & (page_bytes_ - 1)) != 0);
  const uint32_t fit = FindFit(pages, /*exact=*/true, scope);
  if (fit != kNoNode) {
    out->push_back(Carve(fit, pages));
    return Status::Ok();
  }
  // Only now the free pages the caller may use (a fit implies enough).
  const uint64_t free_pages = FreePages(scope);
  if (pages > free_pages || single_extent) {
    return ResourceExhausted("cannot allocate " + std::to_string(bytes) + " bytes (" +
                             std::to_string(pages) + " pages of " + std::to_string(page_bytes_) +
                             " bytes)" + (single_extent ? " as one extent" : "") + ": " +
                             Bytes(free_pages) + " free" +
                             (scope.chunks != nullptr    ? " in allowed chunks"
                              : scope.pool != kEveryPool ? " in the pool's chunks"
                                                         : "") +
                             ", largest free extent " + Bytes(LongestFreePages(scope)));
  }
  // Nothing fits whole: take the largest free extents, then finish with a
  // good fit for the remainder. Terminates because free_pages >= pages.
  for (uint64_t remaining = pages; remaining > 0;) {
    uint32_t i = FindFit(remaining, /*exact=*/false, scope);
    if (i == kNoNode) i = Largest(scope, /*longest=*/false);
    out->push_back(Carve(i, std::min(remaining, nodes_[i].length)));
    remaining -= out->back().length >> page_shift_;
  }
  return Status::Ok();
}

Status ExtentAllocator::Locate(const Extent& e, uint32_t* node) const {
  if (e.chunk >= chunk_pages_.size()) {
    return FailedPrecondition("extent chunk " + std::to_string(e.chunk) +
                              " out of range: the arena has " +
                              std::to_string(chunk_pages_.size()) + " chunks");
  }
  if (e.length == 0 || ((e.offset | e.length) & (page_bytes_ - 1)) != 0) {
    return FailedPrecondition("extent [chunk " + std::to_string(e.chunk) + " offset " +
                              std::to_string(e.offset) + " length " + std::to_string(e.length) +
                              "] is empty or not aligned to " + std::to_string(page_bytes_) +
                              "-byte pages");
  }
  const uint64_t offset = e.offset >> page_shift_;
  const uint64_t length = e.length >> page_shift_;
  auto what = [&] { return "extent " + Describe(e.chunk, offset, length); };
  if (offset >= chunk_pages_[e.chunk] || length > chunk_pages_[e.chunk] - offset) {
    return FailedPrecondition(what() + " ends past its chunk (" + Bytes(chunk_pages_[e.chunk]) +
                              ")");
  }
  uint32_t i = index_.Find(Key(e.chunk, offset));
  // Not where an allocated extent starts: walk the chunk in address order.
  if (i == kNoNode) i = e.chunk;
  while (nodes_[i].offset + nodes_[i].length <= offset) i = nodes_[i].next_phys;
  const ExtentNode& n = nodes_[i];
  if (n.is_free) {
    return FailedPrecondition(what() + " overlaps free extent " +
                              Describe(n.chunk, n.offset, n.length) +
                              " (double free or never allocated)");
  }
  if (offset + length > n.offset + n.length) {
    return FailedPrecondition(what() + " is not inside allocated extent " +
                              Describe(n.chunk, n.offset, n.length));
  }
  *node = i;
  return Status::Ok();
}

Status ExtentAllocator::Free(const Extent& extent) {
  uint32_t i;
  MEMOFFLOAD_RETURN_IF_ERROR(Locate(extent, &i));
  FreeRange(i, extent.offset >> page_shift_, extent.length >> page_shift_);
  return Status::Ok();
}

Status ExtentAllocator::TakeExact(const Extent& e) {
  if (e.chunk >= chunk_pages_.size() || e.length == 0 ||
      ((e.offset | e.length) & (page_bytes_ - 1)) != 0 ||
      (e.offset >> page_shift_) >= chunk_pages_[e.chunk] ||
      (e.length >> page_shift_) > chunk_pages_[e.chunk] - (e.offset >> page_shift_)) {
    return FailedPrecondition("extent [chunk " + std::to_string(e.chunk) + " offset " +
                              std::to_string(e.offset) + " length " + std::to_string(e.length) +
                              "] is not a page-aligned range of the arena");
  }
  const uint64_t offset = e.offset >> page_shift_;
  const uint64_t pages = e.length >> page_shift_;
  uint32_t i = e.chunk;  // the chunk's first node: walk it in address order
  while (nodes_[i].offset + nodes_[i].length <= offset) i = nodes_[i].next_phys;
  if (!nodes_[i].is_free || offset + pages > nodes_[i].offset + nodes_[i].length) {
    return FailedPrecondition("extent " + Describe(e.chunk, offset, pages) +
                              " overlaps an allocated one");
  }
  if (nodes_[i].offset < offset) {
    RemoveFree(i);
    const uint32_t right = SplitAt(i, offset - nodes_[i].offset);
    InsertFree(i);
    InsertFree(right);
    i = right;
  }
  Carve(i, pages);
  return Status::Ok();
}

Result<std::vector<Extent>> ExtentAllocator::Trim(const std::vector<Extent>& extents,
                                                  uint64_t keep_bytes) {
  // Validate everything first so that a bad list changes nothing.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // (start key, pages)
  for (const Extent& e : extents) {
    uint32_t i;
    MEMOFFLOAD_RETURN_IF_ERROR(Locate(e, &i));
    ranges.emplace_back(Key(e.chunk, e.offset >> page_shift_), e.length >> page_shift_);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k) {
    if (ranges[k - 1].first + ranges[k - 1].second > ranges[k].first) {
      return FailedPrecondition("Trim was given overlapping extents");
    }
  }
  uint64_t keep_pages = (keep_bytes >> page_shift_) + ((keep_bytes & (page_bytes_ - 1)) != 0);
  std::vector<Extent> kept;
  for (const Extent& e : extents) {
    const uint64_t pages = e.length >> page_shift_;
    const uint64_t keep = std::min(pages, keep_pages);
    keep_pages -= keep;
    if (keep > 0) kept.push_back(Extent{e.chunk, e.offset, ToBytes(keep)});
    if (keep == pages) continue;
    // Disjoint extents stay inside allocated nodes while others are freed.
    uint32_t i;
    const Status located = Locate(e, &i);
    if (!located.ok()) return Internal("Trim: " + located.message());
    FreeRange(i, (e.offset >> page_shift_) + keep, pages - keep);
  }
  return kept;
}

Status ExtentAllocator::CheckInvariants() const {
  uint64_t free_total = 0, free_nodes = 0, allocated_nodes = 0;
  for (uint32_t c = 0; c < chunk_pages_.size(); ++c) {
    uint64_t end = 0, chunk_free = 0;
    for (uint32_t i = c, prev = kNoNode; i != kNoNode; prev = i, i = nodes_[i].next_phys) {
      const ExtentNode& n = nodes_[i];
      const char* broken = nullptr;
      if (n.chunk != c || n.prev_phys != prev || n.length == 0 || n.offset != end ||
          n.length > chunk_pages_[c] - end) {
        broken = "breaks the address-ordered tiling of its chunk";
      } else if (n.is_free && prev != kNoNode && nodes_[prev].is_free) {
        broken = "is free next to a free extent";
      } else if (!n.is_free && index_.Find(Key(c, n.offset)) != i) {
        broken = "is allocated but not indexed";
      }
      if (broken != nullptr) {
        return Internal("extent " + Describe(c, n.offset, n.length) + " " + broken);
      }
      end += n.length;
      chunk_free += n.is_free ? n.length : 0;
      ++(n.is_free ? free_nodes : allocated_nodes);
    }
    if (end != chunk_pages_[c] || chunk_free != chunk_free_pages_[c]) {
      return Internal("chunk " + std::to_string(c) + ": extents cover " + Bytes(end) + " of " +
                      Bytes(chunk_pages_[c]) + ", " + Bytes(chunk_free) + " free, counted " +
                      Bytes(chunk_free_pages_[c]));
    }
    free_total += chunk_free;
  }
  if (free_total != free_pages_ || allocated_nodes != index_.size()) {
    return Internal("free extents hold " + Bytes(free_total) + ", counted " + Bytes(free_pages_) +
                    "; " + std::to_string(allocated_nodes) + " allocated extents, indexed " +
                    std::to_string(index_.size()));
  }
  // Well-formed lists of free nodes of the right class, as many as there are
  // free nodes, mean every free extent is listed in its class exactly once;
  // likewise each chunk's own lists hold exactly that chunk's free nodes.
  // Likewise each pool's lists hold exactly the free nodes of its chunks.
  uint64_t listed = 0, chunk_listed = 0;
  std::vector<uint64_t> pool_free(pool_lists_.size(), 0);
  for (uint32_t c = 0; c < chunk_pool_.size(); ++c) {
    if (chunk_pool_[c] >= pool_lists_.size()) {
      return Internal("chunk " + std::to_string(c) + " is in pool " +
                      std::to_string(chunk_pool_[c]) + ", which has no lists");
    }
    pool_free[chunk_pool_[c]] += chunk_free_pages_[c];
  }
  for (uint32_t p = 0; p < pool_lists_.size(); ++p) {
    MEMOFFLOAD_RETURN_IF_ERROR(pool_lists_[p].Check(
        nodes_, [&](uint32_t c) { return chunk_pool_[c] == p; }, "pool " + std::to_string(p),
        &listed));
    if (pool_free[p] != pool_free_pages_[p]) {
      return Internal("pool " + std::to_string(p) + " counts " + Bytes(pool_free_pages_[p]) +
                      " free, its chunks " + Bytes(pool_free[p]));
    }
  }
  if (listed != free_nodes) {
    return Internal("class lists hold " + std::to_string(listed) + " extents; the chunks hold " +
                    std::to_string(free_nodes) + " free extents");
  }
  for (uint32_t c = 0; c < chunk_lists_.size(); ++c) {
    MEMOFFLOAD_RETURN_IF_ERROR(chunk_lists_[c].Check(
        nodes_, [c](uint32_t chunk) { return chunk == c; }, "chunk " + std::to_string(c),
        &chunk_listed));
  }
  if (!chunk_lists_.empty() && chunk_listed != free_nodes) {
    return Internal("per-chunk class lists hold " + std::to_string(chunk_listed) +
                    " extents; the chunks hold " + std::to_string(free_nodes) + " free extents");
  }
  return Status::Ok();
}

Result<std::vector<Extent>> ExtentAllocator::Allocate(uint64_t bytes, bool single_extent,
                                                      const std::vector<bool>* allowed_chunks) {
  Result<const std::vector<uint32_t>*> list = ToList(allowed_chunks);
  if (!list.ok()) return list.status();
  std::vector<Extent> out;
  MEMOFFLOAD_RETURN_IF_ERROR(AllocateFrom(bytes, single_extent, Scope{*list}, &out));
  return out;
}

Result<std::vector<Extent>> ExtentAllocator::AllocateIn(
    uint64_t bytes, bool single_extent, const std::vector<uint32_t>& allowed_chunks) {
  std::vector<Extent> out;
  MEMOFFLOAD_RETURN_IF_ERROR(AllocateInto(bytes, single_extent, &allowed_chunks, &out));
  return out;
}

Status ExtentAllocator::AllocateInto(uint64_t bytes, bool single_extent,
                                     const std::vector<uint32_t>* allowed_chunks,
                                     std::vector<Extent>* out) {
  const std::vector<uint32_t>* list = nullptr;
  if (allowed_chunks != nullptr) {
    Result<const std::vector<uint32_t>*> checked = ToList(*allowed_chunks);
    if (!checked.ok()) return checked.status();
    list = *checked;
  }
  return AllocateFrom(bytes, single_extent, Scope{list}, out);
}

Status ExtentAllocator::AllocateInPool(uint64_t bytes, bool single_extent, uint32_t pool,
                                       std::vector<Extent>* out) {
  if (pool >= pool_lists_.size()) {
    return ResourceExhausted("cannot allocate " + std::to_string(bytes) + " bytes: pool " +
                             std::to_string(pool) +
                             " has no chunks (0 bytes free, largest free extent 0 bytes)");
  }
  return AllocateFrom(bytes, single_extent, Scope{nullptr, pool}, out);
}

bool ExtentAllocator::FitsInPool(uint64_t bytes, bool single_extent, uint32_t pool) {
  if (pool >= pool_lists_.size() || bytes == 0) return false;
  const uint64_t pages = (bytes >> page_shift_) + ((bytes & (page_bytes_ - 1)) != 0);
  if (!single_extent) return pool_free_pages_[pool] >= pages;
  return FindFit(pages, /*exact=*/true, Scope{nullptr, pool}) != kNoNode;
}

uint64_t ExtentAllocator::chunk_free_bytes(uint32_t chunk) const {
  return chunk < chunk_pages_.size() ? ToBytes(chunk_free_pages_[chunk]) : 0;
}

}  // namespace memoffload::daemon
