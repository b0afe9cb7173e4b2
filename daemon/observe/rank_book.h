// RankBook and RankSeries: the per-(job id, rank) series of Metrics
// (internal to daemon/; metrics.h declares them). Thread-safe.
#ifndef MEMOFFLOAD_DAEMON_SRC_RANK_BOOK_H_
#define MEMOFFLOAD_DAEMON_SRC_RANK_BOOK_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "observe/metrics.h"

namespace memoffload::daemon {

// The (job id, rank) pairs with series in the rank families. A pair's slot
// stays after its sessions end; Prune removes it only when no RankSeries of
// it is alive, so no request can still increment a removed counter.
class RankBook {
 public:
  using Key = std::pair<std::string, int32_t>;

  // `labels`: kPlain or kHash (with kNone, Metrics makes no RankBook series).
  RankBook(std::shared_ptr<prometheus::Registry> registry,
           prometheus::Family<prometheus::Counter>* offload,
           prometheus::Family<prometheus::Counter>* prefetch, JobLabels labels)
      : registry_(std::move(registry)), offload_(offload), prefetch_(prefetch), labels_(labels) {}

  std::shared_ptr<RankSeries> SeriesFor(const std::shared_ptr<RankBook>& self,
                                        const std::string& job_id, int32_t rank)
      ABSL_LOCKS_EXCLUDED(mu_);
  // From ~RankSeries: `series` is gone, with every request that held it.
  void Unused(const Key& key, const RankSeries* series) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Slot {
    prometheus::Counter* offload_bytes = nullptr;
    prometheus::Counter* prefetch_bytes = nullptr;
    std::weak_ptr<RankSeries> series;
    // The RankSeries whose destructor has not run yet; nullptr once it ran.
    const RankSeries* alive = nullptr;
  };
  // Removes the slots without a RankSeries alive.
  void Prune() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<prometheus::Registry> registry_;  // keeps the families alive
  prometheus::Family<prometheus::Counter>* const offload_;
  prometheus::Family<prometheus::Counter>* const prefetch_;
  const JobLabels labels_;
  absl::Mutex mu_;
  std::map<Key, Slot> slots_ ABSL_GUARDED_BY(mu_);
  size_t prune_at_ ABSL_GUARDED_BY(mu_) = kMaxRankSeries;  // Prune when slots_ reaches it
};

struct RankSeries {
  RankSeries(std::shared_ptr<RankBook> book, RankBook::Key key, prometheus::Counter* offload,
             prometheus::Counter* prefetch)
      : offload_bytes(offload),
        prefetch_bytes(prefetch),
        book_(std::move(book)),
        key_(std::move(key)) {}
  // Runs after the last holder's last increment (shared_ptr orders them).
  ~RankSeries() { book_->Unused(key_, this); }
  RankSeries(const RankSeries&) = delete;
  RankSeries& operator=(const RankSeries&) = delete;

  prometheus::Counter* const offload_bytes;
  prometheus::Counter* const prefetch_bytes;

 private:
  const std::shared_ptr<RankBook> book_;
  const RankBook::Key key_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SRC_RANK_BOOK_H_
