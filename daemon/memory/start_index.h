// StartIndex: ExtentAllocator's index of allocated extents by their start.
//
// An open-addressing hash map from a start key (chunk and page offset packed
// into 64 bits) to a node number: linear probing, backward-shift deletion,
// grows at half load. Find returns kNoNode when the key is absent. Not
// thread-safe: the allocator's owner serialises.
#ifndef MEMOFFLOAD_DAEMON_START_INDEX_H_
#define MEMOFFLOAD_DAEMON_START_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "memory/size_class_lists.h"

namespace memoffload::daemon {

class StartIndex {
 public:
  explicit StartIndex(size_t expected) { Rehash(expected * 2); }
  size_t size() const { return size_; }
  uint32_t Find(uint64_t key) const { return slots_[Probe(key)].node; }
  void Put(uint64_t key, uint32_t node) {
    if (2 * (size_ + 1) > slots_.size()) Rehash(slots_.size() * 2);
    const size_t i = Probe(key);
    size_ += slots_[i].node == kNoNode;
    slots_[i] = Slot{key, node};
  }
  void Erase(uint64_t key) {
    size_t i = Probe(key);
    if (slots_[i].node == kNoNode) return;
    --size_;
    // Pull later members of the probe run back so no lookup meets a hole.
    for (size_t j = (i + 1) & mask_; slots_[j].node != kNoNode; j = (j + 1) & mask_) {
      if (((j - Home(slots_[j].key)) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].node = kNoNode;
  }

 private:
  struct Slot {
    uint64_t key = 0;
    uint32_t node = kNoNode;
  };
  size_t Home(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull) >> shift_; }
  // The slot holding `key`, or the empty slot ending its probe run.
  size_t Probe(uint64_t key) const {
    size_t i = Home(key);
    while (slots_[i].node != kNoNode && slots_[i].key != key) i = (i + 1) & mask_;
    return i;
  }
  void Rehash(size_t min_slots) {
    size_t n = 16;
    while (n < min_slots) n *= 2;
    std::vector<Slot> old(n);
    old.swap(slots_);
    mask_ = n - 1;
    shift_ = 64 - Log2Floor(n);
    size_ = 0;
    for (const Slot& s : old) {
      if (s.node != kNoNode) Put(s.key, s.node);
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  int shift_ = 0;
  size_t size_ = 0;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_START_INDEX_H_
