// Metrics: the daemon's Prometheus series and the /metrics endpoint.
//
// Counters and histograms are created once (at construction or on the first
// use of a label set) and cached, never built per request. Arena and session
// gauges are read from the SessionTable at scrape time, so they are always
// exact and cost nothing on the request path. Thread-safe.
#ifndef MEMOFFLOAD_DAEMON_METRICS_H_
#define MEMOFFLOAD_DAEMON_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "memoffload/daemon/session_table.h"
#include "memoffload/shared_mem/status.h"

namespace memoffload::daemon {

enum class Method {
  kReserve,
  kCommit,
  kPrefetch,
  kRelease,
  kGetStatus,
  kListSessions,
  kDrain,
  kGetConfig,
};
inline constexpr int kMethodCount = 8;
const char* MethodName(Method method);

struct MetricsInfo {
  std::string version;
  uint32_t chunks = 0;
  uint64_t chunk_size_bytes = 0;
  bool mlocked = false;
};

// The reasons the broker passes to Metrics::AttachRefused; the last one,
// session_error, also counts any other string.
inline constexpr std::array<const char*, 8> kAttachRefusalReasons = {
    "peer_credentials", "access_denied", "hello_timeout",    "bad_hello",
    "draining",         "slow_reader",   "connection_limit", "session_error"};
// Longest job_id label value (the broker admits no longer job ids).
inline constexpr size_t kMaxLabelValueBytes = 128;
// RecordClientCopy ignores a copy reported to take longer than this.
inline constexpr double kMaxClientCopySeconds = 3600;

class Metrics {
 public:
  Metrics(const SessionTable* table, MetricsInfo info);
  ~Metrics();

  // Binds the HTTP listener ("host:port"; port 0 picks a free one) and sets
  // *bound to the bound "host:port". Scrapes find no series until Serve.
  // Bounded against slow clients: kHttpThreads threads (civetweb serves one
  // connection per thread), and a request that is not complete within
  // kHttpRequestTimeoutMs is dropped, so k half-sent requests delay a scrape
  // by about ceil(k / kHttpThreads) times that timeout.
  static constexpr int kHttpThreads = 8;
  static constexpr int kHttpRequestTimeoutMs = 2000;
  static Result<std::unique_ptr<prometheus::Exposer>> Listen(const std::string& address,
                                                             std::string* bound);
  // Serves this daemon's series on a listener from Listen.
  void Serve(std::unique_ptr<prometheus::Exposer> exposer);

  void RecordRequest(Method method, StatusCode code, double seconds);
  void RecordRejection(RejectReason reason);
  void SessionOpened();
  void SessionClosed(CloseReason reason, uint64_t reclaimed_bytes);
  void AttachRefused(const std::string& reason);

  // Data traffic. `data_bytes` is what the client wrote (Commit's used_bytes)
  // or may read (Prefetch's used_bytes). Counted in the node totals and, when
  // the session is still known to the table, under its job id and rank.
  void RecordOffload(uint64_t session_id, uint64_t data_bytes);
  void RecordPrefetch(uint64_t session_id, uint64_t data_bytes);
  // A group left the arena; `resident_seconds` > 0 when it had been committed.
  void RecordResidency(double resident_seconds);
  // Copy statistics a client reported with Commit (kOffload) or Release
  // (kPrefetch). Ignored unless 0 < bytes <= the arena's capacity and
  // seconds is finite and in (0, kMaxClientCopySeconds].
  enum class CopyDirection { kOffload, kPrefetch };
  void RecordClientCopy(CopyDirection direction, uint64_t bytes, double seconds);

  // The registry, for tests that serialise it without HTTP.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  class ArenaCollector;
  prometheus::Counter& RequestCounter(Method method, StatusCode code);
  // Series of one (job id, rank); owned by by_rank_, removed only by Prune.
  struct RankSeries {
    prometheus::Counter* offload_bytes = nullptr;
    prometheus::Counter* prefetch_bytes = nullptr;
  };
  // The series of a session, created on its first use and cached; nullptr
  // when the session is gone. Requires rank_mu_.
  RankSeries* RankSeriesOf(uint64_t session_id);
  // Forgets closed sessions and, past kMaxRankSeries, drops the series of
  // (job, rank) pairs no live session uses. Requires rank_mu_.
  void Prune();

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ArenaCollector> arena_collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;

  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  // Lazily filled cache of requests_ series, [method][code].
  std::array<std::array<std::atomic<prometheus::Counter*>, 17>, kMethodCount> request_counters_{};
  std::array<prometheus::Histogram*, kMethodCount> latency_{};
  prometheus::Counter* sessions_opened_ = nullptr;
  prometheus::Family<prometheus::Counter>* sessions_closed_ = nullptr;
  std::array<prometheus::Counter*, kCloseReasonCount> sessions_closed_by_reason_{};
  std::array<prometheus::Counter*, kRejectReasonCount> rejections_{};
  prometheus::Family<prometheus::Counter>* attach_refusals_ = nullptr;
  std::array<prometheus::Counter*, kAttachRefusalReasons.size()> attach_refusals_by_reason_{};
  std::array<prometheus::Counter*, kCloseReasonCount> reclaimed_bytes_{};
  std::array<prometheus::Counter*, kCloseReasonCount> sessions_reclaimed_{};
  prometheus::Counter* offload_bytes_ = nullptr;
  prometheus::Counter* prefetch_bytes_ = nullptr;
  prometheus::Family<prometheus::Counter>* rank_offload_bytes_ = nullptr;
  prometheus::Family<prometheus::Counter>* rank_prefetch_bytes_ = nullptr;
  prometheus::Histogram* residency_ = nullptr;
  std::array<prometheus::Counter*, 2> copy_bytes_{};    // [CopyDirection]
  std::array<prometheus::Counter*, 2> copy_seconds_{};  // [CopyDirection]

  const uint64_t max_copy_bytes_;  // the arena's capacity (2^53 when unknown)
  const SessionTable* table_;
  std::mutex rank_mu_;  // guards by_session_, by_rank_ and the increments of their series
  std::unordered_map<uint64_t, RankSeries*> by_session_;  // guarded by rank_mu_
  std::map<std::pair<std::string, int32_t>, std::unique_ptr<RankSeries>>
      by_rank_;                    // guarded by rank_mu_
  size_t prune_at_sessions_ = 64;  // guarded by rank_mu_; sweep by_session_ when it grows past this
};

// Past this many (job id, rank) series pairs, pairs without a live session
// are removed from /metrics (the node totals keep counting).
inline constexpr size_t kMaxRankSeries = 1024;

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_METRICS_H_
