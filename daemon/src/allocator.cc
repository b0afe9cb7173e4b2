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
// Every free node is listed twice: in the arena's class lists and in its
// chunk's own, so a search restricted to some chunks (allowed_chunks) asks
// each allowed chunk in O(1) instead of scanning the arena's lists for
// members in allowed chunks.
#include "memoffload/daemon/allocator.h"

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
      arena_lists_(ValidatedMaxPages(chunk_sizes, page_bytes), kArenaLists),
      index_(chunk_sizes.size() * 8 + 1024) {
  page_shift_ = Log2Floor(page_bytes);
  nodes_.reserve(chunk_sizes.size() * 8 + 1024);
  chunk_lists_.reserve(chunk_sizes.size());
  for (uint32_t c = 0; c < chunk_sizes.size(); ++c) {
    const uint64_t pages = chunk_sizes[c] >> page_shift_;
    ExtentNode& n = nodes_.emplace_back();
    n.length = pages;
    n.chunk = c;
    chunk_lists_.emplace_back(pages, kChunkLists);
    chunk_pages_.push_back(pages);
    chunk_free_pages_.push_back(pages);
    capacity_pages_ += pages;
    InsertFree(c);
  }
  free_pages_ = capacity_pages_;
}

// Pages of the longest free extent (in allowed chunks when non-null).
uint64_t ExtentAllocator::LongestFreePages(const std::vector<uint32_t>* allowed) const {
  const uint32_t i = Largest(allowed, /*longest=*/true);
  return i == kNoNode ? 0 : nodes_[i].length;
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

// Lists free node i in the arena's and its chunk's class lists.
void ExtentAllocator::InsertFree(uint32_t i) {
  arena_lists_.Insert(nodes_, i);
  chunk_lists_[nodes_[i].chunk].Insert(nodes_, i);
}
// Unlinks free node i from both; is_free is the caller's.
void ExtentAllocator::RemoveFree(uint32_t i) {
  arena_lists_.Remove(nodes_, i);
  chunk_lists_[nodes_[i].chunk].Remove(nodes_, i);
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

// Good fit: a free node of >= pages in an allowed chunk, or kNoNode. The
// unrestricted search is O(1) (own class head, then the first non-empty
// class above the request's, found by find-first-set); with `exact` it then
// scans the own class, so kNoNode means nothing fits. A restricted search
// does the same in each allowed chunk's own lists and takes the smallest
// class found: O(allowed chunks), independent of the free extent count.
uint32_t ExtentAllocator::FindFit(uint64_t pages, bool exact,
                                  const std::vector<uint32_t>* allowed) {
  const int own = SizeClassOf(pages);
  if (allowed != nullptr) return FindFitRestricted(pages, own, exact, *allowed);
  const uint32_t head = arena_lists_.Head(own);
  if (head != kNoNode && nodes_[head].length >= pages) return head;
  // Every member of a class above the own one is long enough.
  const int above = arena_lists_.FirstAtOrAbove(own + 1);
  if (above != kNoClass) return arena_lists_.Head(above);
  return exact ? arena_lists_.FindIn(nodes_, own, pages) : kNoNode;
}

uint32_t ExtentAllocator::FindFitRestricted(uint64_t pages, int own, bool exact,
                                            const std::vector<uint32_t>& allowed) {
  int best_rank = kNoClass;
  uint32_t best = kNoNode;
  for (uint32_t c : allowed) {
    if (chunk_free_pages_[c] < pages) continue;
    const SizeClassLists& lists = chunk_lists_[c];
    int rank = lists.FirstAtOrAbove(own);
    if (rank == own) {
      // Own class: only the head is checked here (members vary in length).
      const uint32_t head = lists.Head(own);
      if (nodes_[head].length >= pages) return head;
      rank = lists.FirstAtOrAbove(own + 1);
    }
    if (rank < best_rank) {
      best_rank = rank;
      best = c;
    }
  }
  if (best != kNoNode) return chunk_lists_[best].Head(best_rank);
  if (!exact) return kNoNode;
  for (uint32_t c : allowed) {
    if (chunk_free_pages_[c] < pages) continue;
    const uint32_t i = chunk_lists_[c].FindIn(nodes_, own, pages);
    if (i != kNoNode) return i;
  }
  return kNoNode;
}

// A node of the highest non-empty class holding an allowed node: the
// longest of that class with `longest`, else the first (O(1) unrestricted).
uint32_t ExtentAllocator::Largest(const std::vector<uint32_t>* allowed, bool longest) const {
  if (allowed == nullptr) {
    const int top = arena_lists_.Top();
    return longest ? arena_lists_.LongestIn(nodes_, top) : arena_lists_.Head(top);
  }
  int top = -1;
  for (uint32_t c : *allowed) top = std::max(top, chunk_lists_[c].Top());
  uint32_t best = kNoNode;
  for (uint32_t c : *allowed) {
    const uint32_t i = longest ? chunk_lists_[c].LongestIn(nodes_, top) : chunk_lists_[c].Head(top);
    if (i == kNoNode) continue;
    if (!longest) return i;
    if (best == kNoNode || nodes_[i].length > nodes_[best].length) best = i;
  }
  return best;
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
  return Extent{n.chunk, ToBytes(n.offset), ToBytes(pages)};
}

// Frees allocated node i and coalesces it with its free neighbours.
void ExtentAllocator::FreeNode(uint32_t i) {
  index_.Erase(Key(nodes_[i].chunk, nodes_[i].offset));
  free_pages_ += nodes_[i].length;
  chunk_free_pages_[nodes_[i].chunk] += nodes_[i].length;
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
  return &allowed;
}

Result<std::vector<Extent>> ExtentAllocator::AllocateFrom(uint64_t bytes, bool single_extent,
                                                          const std::vector<uint32_t>* allowed) {
  if (bytes == 0) return InvalidArgument("cannot allocate 0 bytes");
  const uint64_t pages = bytes / page_bytes_ + (bytes % page_bytes_ != 0);
  const uint32_t fit = FindFit(pages, /*exact=*/true, allowed);
  if (fit != kNoNode) return std::vector<Extent>{Carve(fit, pages)};
  // Only now the free pages the caller may use (a fit implies enough).
  uint64_t free_pages = free_pages_;
  if (allowed != nullptr) {
    free_pages = 0;
    for (uint32_t c : *allowed) free_pages += chunk_free_pages_[c];
  }
  if (pages > free_pages || single_extent) {
    return ResourceExhausted("cannot allocate " + std::to_string(bytes) + " bytes (" +
                             std::to_string(pages) + " pages of " + std::to_string(page_bytes_) +
                             " bytes)" + (single_extent ? " as one extent" : "") + ": " +
                             Bytes(free_pages) + " free" +
                             (allowed != nullptr ? " in allowed chunks" : "") +
                             ", largest free extent " + Bytes(LongestFreePages(allowed)));
  }
  // Nothing fits whole: take the largest free extents, then finish with a
  // good fit for the remainder. Terminates because free_pages >= pages.
  std::vector<Extent> out;
  out.reserve(4);
  for (uint64_t remaining = pages; remaining > 0;) {
    uint32_t i = FindFit(remaining, /*exact=*/false, allowed);
    if (i == kNoNode) i = Largest(allowed, /*longest=*/false);
    out.push_back(Carve(i, std::min(remaining, nodes_[i].length)));
    remaining -= out.back().length >> page_shift_;
  }
  return out;
}

Status ExtentAllocator::Locate(const Extent& e, uint32_t* node) const {
  if (e.chunk >= chunk_pages_.size()) {
    return FailedPrecondition("extent chunk " + std::to_string(e.chunk) +
                              " out of range: the arena has " +
                              std::to_string(chunk_pages_.size()) + " chunks");
  }
  if (e.length == 0 || e.offset % page_bytes_ != 0 || e.length % page_bytes_ != 0) {
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
  uint64_t keep_pages = keep_bytes / page_bytes_ + (keep_bytes % page_bytes_ != 0);
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
  uint64_t listed = 0, chunk_listed = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(arena_lists_.Check(nodes_, kNoNode, "the arena", &listed));
  if (listed != free_nodes) {
    return Internal("class lists hold " + std::to_string(listed) + " extents; the chunks hold " +
                    std::to_string(free_nodes) + " free extents");
  }
  for (uint32_t c = 0; c < chunk_lists_.size(); ++c) {
    MEMOFFLOAD_RETURN_IF_ERROR(
        chunk_lists_[c].Check(nodes_, c, "chunk " + std::to_string(c), &chunk_listed));
  }
  if (chunk_listed != free_nodes) {
    return Internal("per-chunk class lists hold " + std::to_string(chunk_listed) +
                    " extents; the chunks hold " + std::to_string(free_nodes) + " free extents");
  }
  return Status::Ok();
}

Result<std::vector<Extent>> ExtentAllocator::Allocate(uint64_t bytes, bool single_extent,
                                                      const std::vector<bool>* allowed_chunks) {
  Result<const std::vector<uint32_t>*> list = ToList(allowed_chunks);
  if (!list.ok()) return list.status();
  return AllocateFrom(bytes, single_extent, *list);
}

Result<std::vector<Extent>> ExtentAllocator::AllocateIn(
    uint64_t bytes, bool single_extent, const std::vector<uint32_t>& allowed_chunks) {
  Result<const std::vector<uint32_t>*> list = ToList(allowed_chunks);
  if (!list.ok()) return list.status();
  return AllocateFrom(bytes, single_extent, *list);
}

uint64_t ExtentAllocator::chunk_free_bytes(uint32_t chunk) const {
  return chunk < chunk_pages_.size() ? ToBytes(chunk_free_pages_[chunk]) : 0;
}

}  // namespace memoffload::daemon
