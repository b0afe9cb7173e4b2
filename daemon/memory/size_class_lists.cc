#include "memory/size_class_lists.h"

#include <algorithm>

namespace memoffload::daemon {

SizeClassLists::SizeClassLists(uint64_t max_pages, ListKind kind) : kind_(kind) {
  const int fl_count = SizeClassOf(max_pages) / kSlCount + 1;
  sl_bitmap_.assign(fl_count, 0);
  heads_.assign(static_cast<size_t>(fl_count) * kSlCount, kNoNode);
  class_max_.assign(heads_.size(), 0);
}

uint32_t SizeClassLists::FindIn(const std::vector<ExtentNode>& nodes, int rank, uint64_t pages) {
  if (rank < 0 || rank >= class_count() || class_max_[rank] < pages) return kNoNode;
  uint64_t longest = 0;
  for (uint32_t i = heads_[rank]; i != kNoNode; i = nodes[i].links[kind_].next) {
    if (nodes[i].length >= pages) return i;
    longest = std::max(longest, nodes[i].length);
  }
  class_max_[rank] = longest;
  return kNoNode;
}

uint32_t SizeClassLists::LongestIn(const std::vector<ExtentNode>& nodes, int rank) const {
  uint32_t best = kNoNode;
  for (uint32_t i = Head(rank); i != kNoNode; i = nodes[i].links[kind_].next) {
    if (best == kNoNode || nodes[i].length > nodes[best].length) best = i;
  }
  return best;
}

Status SizeClassLists::Check(const std::vector<ExtentNode>& nodes,
                             const std::function<bool(uint32_t)>& member, const std::string& where,
                             uint64_t* listed) const {
  const int fl_count = static_cast<int>(sl_bitmap_.size());
  if (fl_count < 64 && (fl_bitmap_ >> fl_count) != 0) {
    return Internal(where + " has a class bit above its largest class");
  }
  for (int rank = 0; rank < class_count(); ++rank) {
    const int fl = rank / kSlCount, sl = rank % kSlCount;
    bool ok = ((sl_bitmap_[fl] >> sl & 1) != 0) == (heads_[rank] != kNoNode) &&
              ((fl_bitmap_ >> fl & 1) != 0) == (sl_bitmap_[fl] != 0);
    for (uint32_t i = heads_[rank], prev = kNoNode; ok && i != kNoNode;
         prev = i, i = nodes[i].links[kind_].next, ++*listed) {
      const ExtentNode& n = nodes[i];
      ok = n.is_free && member(n.chunk) && n.links[kind_].prev == prev &&
           SizeClassOf(n.length) == rank && n.length <= class_max_[rank];
    }
    if (!ok) {
      return Internal(where + " size class (" + std::to_string(fl) + ", " + std::to_string(sl) +
                      ") has a bad list or bitmap");
    }
  }
  return Status::Ok();
}

}  // namespace memoffload::daemon
