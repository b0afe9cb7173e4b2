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
#include <memory>
#include <string>

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

class Metrics {
 public:
  Metrics(const SessionTable* table, MetricsInfo info);
  ~Metrics();

  // Starts the HTTP listener ("host:port"; port 0 picks a free one).
  // Returns the bound "host:port".
  Result<std::string> Serve(const std::string& address);

  void RecordRequest(Method method, StatusCode code, double seconds);
  void RecordRejection(RejectReason reason);
  void SessionOpened();
  void SessionClosed(CloseReason reason, uint64_t reclaimed_bytes);
  void AttachRefused(const std::string& reason);

  // The registry, for tests that serialise it without HTTP.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

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
  prometheus::Counter* reclaimed_bytes_ = nullptr;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_METRICS_H_
