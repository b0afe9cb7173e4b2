// StatsBook: the offloader's counters, updated from the training threads and
// the worker alike.
#ifndef MEMOFFLOAD_TORCH_SRC_STATS_BOOK_H_
#define MEMOFFLOAD_TORCH_SRC_STATS_BOOK_H_

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

  OffloaderStats Snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  mutable std::mutex mu_;
  OffloaderStats stats_;  // GUARDED_BY(mu_)
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_STATS_BOOK_H_
