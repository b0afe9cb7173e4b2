// SizeClassLists: the segregated free lists of ExtentAllocator (TLSF class).
//
// The allocator tiles each chunk with ExtentNodes, free or allocated, held in
// one node array and named by their index in it. A SizeClassLists indexes
// free nodes by size class: a class is (first level = log2 of the length,
// second level = one of kSlCount linear sub-classes), flattened to a rank
// fl * kSlCount + sl, so a higher rank holds longer extents. A two-level
// bitmap finds the first non-empty class at or above a rank in O(1).
//
// The allocator keeps one SizeClassLists per pool of chunks and, once a
// search restricted to a chunk list was made, one per chunk; a free node is
// a member of its pool's (and its chunk's), through its own pair of links
// for each (ExtentNode::links[kind]).
// Lengths are in pages. Not thread-safe: the allocator's owner serialises.
#ifndef MEMOFFLOAD_DAEMON_SIZE_CLASS_LISTS_H_
#define MEMOFFLOAD_DAEMON_SIZE_CLASS_LISTS_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload::daemon {

inline constexpr uint32_t kNoNode = UINT32_MAX;
inline constexpr int kNoClass = INT32_MAX;

inline int Log2Floor(uint64_t v) { return 63 - __builtin_clzll(v); }

// Which lists a pair of links belongs to.
enum ListKind : int { kPoolLists = 0, kChunkLists = 1 };

struct ListLinks {
  uint32_t prev = kNoNode;
  uint32_t next = kNoNode;
};

// A range of one chunk, free or allocated, in address order with its
// neighbours (prev_phys/next_phys).
struct ExtentNode {
  uint64_t offset = 0;  // pages from the chunk start
  uint64_t length = 0;  // pages
  uint32_t chunk = 0;
  uint32_t prev_phys = kNoNode;
  uint32_t next_phys = kNoNode;
  ListLinks links[2];  // by ListKind; meaningful while is_free
  bool is_free = false;
};

// The rank of the size class of a free extent of `pages` (> 0) pages. Every
// member of a class of a higher rank is at least `pages` long; members of
// the class itself may be shorter.
inline constexpr int kSlLog2 = 5;  // 32 linear sub-classes per power of two
inline constexpr int kSlCount = 1 << kSlLog2;

inline int SizeClassOf(uint64_t pages) {
  if (pages < static_cast<uint64_t>(kSlCount)) return static_cast<int>(pages);
  const int top = Log2Floor(pages);
  const int fl = top - kSlLog2 + 1;
  return fl * kSlCount + static_cast<int>((pages >> (top - kSlLog2)) - kSlCount);
}

class SizeClassLists {
 public:
  // Lists for free extents of 1 to max_pages pages, linked through
  // ExtentNode::links[kind].
  SizeClassLists(uint64_t max_pages, ListKind kind);

  // Lists free node i in its class (sets is_free). Its length must be
  // <= max_pages.
  void Insert(std::vector<ExtentNode>& nodes, uint32_t i);
  // Unlinks node i, listed here; is_free is the caller's.
  void Remove(std::vector<ExtentNode>& nodes, uint32_t i);

  // The first non-empty class of rank >= `rank`, or kNoClass. O(1).
  int FirstAtOrAbove(int rank) const;
  // The highest non-empty class, or -1 when nothing is listed. O(1).
  int Top() const;
  // The first member of class `rank`, or kNoNode.
  uint32_t Head(int rank) const {
    return rank >= 0 && rank < class_count() ? heads_[rank] : kNoNode;
  }
  // A member of class `rank` of at least `pages` pages, or kNoNode. Scans
  // the class unless its bound says none is long enough; a miss makes the
  // bound exact, so a repeated miss costs O(1).
  uint32_t FindIn(const std::vector<ExtentNode>& nodes, int rank, uint64_t pages);
  // The longest member of class `rank`, or kNoNode. O(class members).
  uint32_t LongestIn(const std::vector<ExtentNode>& nodes, int rank) const;

  // Verifies the bitmaps against the lists, the links, and that every
  // member is free, of its class, within the class bound and in a chunk
  // `member(chunk)` accepts. Adds the members to *listed. INTERNAL naming
  // `where` and the class on a violation.
  Status Check(const std::vector<ExtentNode>& nodes, const std::function<bool(uint32_t)>& member,
               const std::string& where, uint64_t* listed) const;

 private:
  int class_count() const { return static_cast<int>(heads_.size()); }

  ListKind kind_;
  uint64_t fl_bitmap_ = 0;           // bit fl: sl_bitmap_[fl] != 0
  std::vector<uint32_t> sl_bitmap_;  // per first level; bit sl: heads_[rank] listed
  std::vector<uint32_t> heads_;      // by rank
  // Upper bound of the longest member per class: raised on insert, made
  // exact by a failed FindIn.
  std::vector<uint64_t> class_max_;
};

// The hot operations, inline: the allocator calls them on every request.
inline void SizeClassLists::Insert(std::vector<ExtentNode>& nodes, uint32_t i) {
  ExtentNode& n = nodes[i];
  const int rank = SizeClassOf(n.length);
  const int fl = rank / kSlCount;
  n.is_free = true;
  ListLinks& links = n.links[kind_];
  links.prev = kNoNode;
  links.next = heads_[rank];
  if (links.next != kNoNode) nodes[links.next].links[kind_].prev = i;
  heads_[rank] = i;
  class_max_[rank] = std::max(class_max_[rank], n.length);
  fl_bitmap_ |= uint64_t{1} << fl;
  sl_bitmap_[fl] |= 1u << (rank % kSlCount);
}

inline void SizeClassLists::Remove(std::vector<ExtentNode>& nodes, uint32_t i) {
  const ListLinks links = nodes[i].links[kind_];
  if (links.next != kNoNode) nodes[links.next].links[kind_].prev = links.prev;
  if (links.prev != kNoNode) {
    nodes[links.prev].links[kind_].next = links.next;
    return;
  }
  const int rank = SizeClassOf(nodes[i].length);
  heads_[rank] = links.next;
  if (links.next == kNoNode) {
    const int fl = rank / kSlCount;
    sl_bitmap_[fl] &= ~(1u << (rank % kSlCount));
    if (sl_bitmap_[fl] == 0) fl_bitmap_ &= ~(uint64_t{1} << fl);
  }
}

inline int SizeClassLists::FirstAtOrAbove(int rank) const {
  if (rank >= class_count()) return kNoClass;
  int fl = rank / kSlCount;
  uint32_t map = sl_bitmap_[fl] & (~0u << (rank % kSlCount));
  if (map == 0) {
    const uint64_t fl_map = fl + 1 < 64 ? fl_bitmap_ & (~uint64_t{0} << (fl + 1)) : 0;
    if (fl_map == 0) return kNoClass;
    fl = __builtin_ctzll(fl_map);
    map = sl_bitmap_[fl];
  }
  return fl * kSlCount + __builtin_ctz(map);
}

inline int SizeClassLists::Top() const {
  if (fl_bitmap_ == 0) return -1;
  const int fl = Log2Floor(fl_bitmap_);
  return fl * kSlCount + 31 - __builtin_clz(sl_bitmap_[fl]);
}

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SIZE_CLASS_LISTS_H_
