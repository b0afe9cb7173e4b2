// StatsBook: the offloader's counters, updated from the training threads and
// the worker alike.
#ifndef MEMOFFLOAD_TORCH_SRC_STATS_BOOK_H_
#define MEMOFFLOAD_TORCH_SRC_STATS_BOOK_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>

#include "memoffload/torch/group_offloader.h"

namespace memoffload::torch {

class StatsBook {
 public:
  // Runs fn(OffloaderStats&) under the book's lock: several fields change
  // together.
  template <typename Fn>
  void Count(Fn fn) {
    std::lock_guard<std::mutex> lock(mu_);
    fn(stats_);
  }

  // Runs fn(OffloaderStats&, SlotStats&) for a group of `slot` (a slot < 0
  // has no SlotStats of its own: fn gets a scratch one).
  template <typename Fn>
  void CountWithSlot(int64_t slot, Fn fn) {
    std::lock_guard<std::mutex> lock(mu_);
    SlotStats scratch;
    fn(stats_, slot >= 0 ? slots_[slot] : scratch);
  }

  // The per-tensor counters of an Add: atomics, not the book's lock (one
  // saved tensor should not pay a lock round for its counters).
  void CountTensor(bool deduplicated, bool caller_copy, bool capture_skipped) {
    tensors_.fetch_add(1, std::memory_order_relaxed);
    if (deduplicated) deduplicated_.fetch_add(1, std::memory_order_relaxed);
    if (caller_copy) caller_copies_.fetch_add(1, std::memory_order_relaxed);
    if (capture_skipped) capture_skipped_.fetch_add(1, std::memory_order_relaxed);
  }

  // The arena bytes the groups hold grew or shrank (a Reserve, a Commit's
  // trim, a release).
  void AddHeld(uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.arena_held_bytes += bytes;
    held_peak_ = std::max(held_peak_, stats_.arena_held_bytes);
  }
  void SubtractHeld(uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.arena_held_bytes -= std::min(bytes, stats_.arena_held_bytes);
  }
  // GroupOffloader::TakeArenaHeldPeak.
  uint64_t TakeHeldPeak() {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t peak = held_peak_;
    held_peak_ = stats_.arena_held_bytes;
    return peak;
  }

  OffloaderStats Snapshot() const {
    OffloaderStats s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      s = stats_;
    }
    s.tensors = tensors_.load(std::memory_order_relaxed);
    s.deduplicated = deduplicated_.load(std::memory_order_relaxed);
    s.caller_copies = caller_copies_.load(std::memory_order_relaxed);
    s.capture_skipped = capture_skipped_.load(std::memory_order_relaxed);
    return s;
  }

  SlotStats SlotSum(int64_t first_slot, int64_t end_slot) const {
    std::lock_guard<std::mutex> lock(mu_);
    SlotStats sum;
    for (auto it = slots_.lower_bound(first_slot); it != slots_.end() && it->first < end_slot;
         ++it) {
      const SlotStats& s = it->second;
      sum.groups += s.groups;
      sum.groups_offloaded += s.groups_offloaded;
      sum.groups_skipped += s.groups_skipped;
      sum.groups_live += s.groups_live;
      sum.offloaded_bytes += s.offloaded_bytes;
      sum.prefetched_bytes += s.prefetched_bytes;
      sum.skipped_bytes += s.skipped_bytes;
    }
    return sum;
  }

 private:
  mutable std::mutex mu_;
  OffloaderStats stats_;                // GUARDED_BY(mu_)
  std::map<int64_t, SlotStats> slots_;  // GUARDED_BY(mu_)
  uint64_t held_peak_ = 0;              // GUARDED_BY(mu_)
  // CountTensor's; stats_'s fields of the same names stay 0.
  std::atomic<uint64_t> tensors_{0};
  std::atomic<uint64_t> deduplicated_{0};
  std::atomic<uint64_t> caller_copies_{0};
  std::atomic<uint64_t> capture_skipped_{0};
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_STATS_BOOK_H_
