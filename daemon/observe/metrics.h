// Metrics: the daemon's Prometheus series and the /metrics endpoint.
//
// Counters and histograms are created once (at construction, on the first
// use of a label set, or when a session opens) and cached, never built per
// request; no request takes a lock of ours or looks anything up. Arena and
// session gauges are read from the SessionTable at scrape time, so they are
// always exact and cost nothing on the request path. Thread-safe.
#ifndef MEMOFFLOAD_DAEMON_METRICS_H_
#define MEMOFFLOAD_DAEMON_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/session_table.h"
#include "memoffload/common/status.h"

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
  kCreateRegion,
  kCommitRegion,
  kOpenRegion,
  kCloseRegion,
  kDeleteRegion,
  kListRegions,
};
inline constexpr int kMethodCount = 14;
const char* MethodName(Method method);

// What the per-rank series say of a session's job (metrics.job_labels).
// /metrics is not behind the daemon's access list: any local user who can
// reach its address reads it.
enum class JobLabels {
  kPlain,  // job_id: the job id the client named (at most kMaxLabelValueBytes)
  kHash,   // job_id: HashedJobId of it
  kNone,   // no per-rank series at all (SeriesFor gives none); node totals stay
};
Result<JobLabels> ParseJobLabels(const std::string& text);
// The first 12 hex digits of the SHA-256 of `job_id` (unkeyed, so that an
// operator can compute it: `printf %s JOB | sha256sum`). It hides a job id
// from a casual reader of /metrics, not from one who can guess it.
std::string HashedJobId(const std::string& job_id);

struct MetricsInfo {
  std::string version;
  uint32_t chunks = 0;
  uint64_t chunk_size_bytes = 0;
  bool mlocked = false;
  JobLabels job_labels = JobLabels::kPlain;
  uint64_t hugetlb_bytes = 0;  // the arena on huge pages, as the kernel gave them at start
  uint64_t thp_bytes = 0;
  // What the last start took back from the kept state (app/state_store.h).
  std::string state_store = "none";  // none, systemd's fd store, the keeper
  uint32_t recovered_regions = 0;
  uint64_t recovered_bytes = 0;
  uint32_t dropped_regions = 0;     // failed their CRC32Cs or could not be placed
  uint32_t unverified_regions = 0;  // saved without checksums
  double recovery_seconds = 0;
  // Changes the store could not keep since the start (journal records, fds);
  // null: none is kept.
  std::function<uint64_t()> state_errors = nullptr;
  // The arena's THP bytes now, and its kept bytes whose pages are not told
  // until mapped (just after the start); null: thp_bytes, and none.
  std::function<uint64_t()> thp_bytes_now = nullptr;
  std::function<uint64_t()> unmeasured_bytes_now = nullptr;
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
// Past this many (job id, rank) series pairs, pairs without a live session
// are removed from /metrics (the node totals keep counting).
inline constexpr size_t kMaxRankSeries = 1024;

// The series of one (job id, rank) pair, shared by the live sessions of the
// pair: the SessionTable keeps it in the session and hands it back with
// Commit and Prefetch, so that a request counts its bytes without a lock or
// a lookup. Defined in metrics.cc; forward-declared in session_table.h.
struct RankSeries;
// The pairs and their liveness (metrics.cc). Shared by Metrics and every
// RankSeries: a session may outlive Metrics.
class RankBook;

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
  // Closes the metrics port (a take-over: the new daemon binds it next).
  void StopServing();
  void Serve(std::unique_ptr<prometheus::Exposer> exposer);

  void RecordRequest(Method method, StatusCode code, double seconds);
  void RecordRejection(RejectReason reason);
  void SessionOpened();
  void SessionClosed(CloseReason reason, uint64_t reclaimed_bytes);
  void AttachRefused(const std::string& reason);
  // Names a reason of memoffload_grpc_connections_closed_total (its series
  // starts at 0), so that the edge's reasons stay the edge's.
  void DeclareGrpcCloseReason(const std::string& reason);
  // A gRPC connection the edge relay closed because its peer broke `reason`.
  void GrpcConnectionClosed(const std::string& reason);

  // The series of (job_id, rank), for a session about to open (the broker
  // passes it to SessionTable::Open); null with JobLabels::kNone. Every live
  // session of the pair shares one. Takes a lock, once per session, never per request. The pair's
  // series appear in /metrics now (at 0) and stay after its sessions end;
  // once kMaxRankSeries pairs exist, those that no session, and no request
  // still counting, holds are removed (sessions of the pair opened later
  // start the series again from 0).
  std::shared_ptr<RankSeries> SeriesFor(const std::string& job_id, int32_t rank);

  // Data traffic. `data_bytes` is what the client wrote (Commit's used_bytes)
  // or may read (Prefetch's used_bytes). Counted in the node totals and, when
  // `series` (from the session, via CommitResult / PrefetchResult) is not
  // null, under its job id and rank. Lock-free.
  void RecordOffload(const RankSeries* series, uint64_t data_bytes);
  void RecordPrefetch(const RankSeries* series, uint64_t data_bytes);
  // A group left the arena; `resident_seconds` > 0 when it had been committed.
  void RecordResidency(double resident_seconds);
  // Copy statistics a client reported with Commit (kOffload) or Release
  // (kPrefetch). Ignored unless 0 < bytes <= the arena's capacity and
  // seconds is finite and in (0, kMaxClientCopySeconds].
  enum class CopyDirection { kOffload, kPrefetch };
  void RecordClientCopy(CopyDirection direction, uint64_t bytes, double seconds);

  // What /metrics serves, but the HTTP exposer's own families: the registry
  // and the scrape-time families. For tests that read it without HTTP.
  std::vector<prometheus::MetricFamily> Collect() const;

 private:
  class ArenaCollector;
  prometheus::Counter& RequestCounter(Method method, StatusCode code);

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
  prometheus::Family<prometheus::Counter>* grpc_closed_ = nullptr;
  std::array<prometheus::Counter*, kCloseReasonCount> reclaimed_bytes_{};
  std::array<prometheus::Counter*, kCloseReasonCount> sessions_reclaimed_{};
  prometheus::Counter* offload_bytes_ = nullptr;
  prometheus::Counter* prefetch_bytes_ = nullptr;
  prometheus::Histogram* residency_ = nullptr;
  std::array<prometheus::Counter*, 2> copy_bytes_{};    // [CopyDirection]
  std::array<prometheus::Counter*, 2> copy_seconds_{};  // [CopyDirection]

  const uint64_t max_copy_bytes_;  // the arena's capacity (2^53 when unknown)
  const JobLabels job_labels_;
  std::shared_ptr<RankBook> rank_book_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_METRICS_H_
