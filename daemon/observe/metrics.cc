#include "observe/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/gauge.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "observe/rank_book.h"

namespace memoffload::daemon {

const char* MethodName(Method method) {
  switch (method) {
    case Method::kReserve:
      return "Reserve";
    case Method::kCommit:
      return "Commit";
    case Method::kPrefetch:
      return "Prefetch";
    case Method::kRelease:
      return "Release";
    case Method::kGetStatus:
      return "GetStatus";
    case Method::kListSessions:
      return "ListSessions";
    case Method::kDrain:
      return "Drain";
    case Method::kGetConfig:
      return "GetConfig";
    case Method::kCreateRegion:
      return "CreateRegion";
    case Method::kCommitRegion:
      return "CommitRegion";
    case Method::kOpenRegion:
      return "OpenRegion";
    case Method::kCloseRegion:
      return "CloseRegion";
    case Method::kDeleteRegion:
      return "DeleteRegion";
    case Method::kListRegions:
      return "ListRegions";
  }
  return "unknown";
}

namespace {

prometheus::MetricFamily GaugeFamily(const std::string& name, const std::string& help) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = prometheus::MetricType::Gauge;
  return f;
}

void AddGauge(prometheus::MetricFamily* f, double value,
              std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  f->metric.push_back(std::move(m));
}

// A counter kept by the session table, read at scrape time.
prometheus::MetricFamily CounterOf(const std::string& name, const std::string& help, double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = prometheus::MetricType::Counter;
  prometheus::ClientMetric m;
  m.counter.value = value;
  f.metric.push_back(std::move(m));
  return f;
}

}  // namespace

// Reads the session table at scrape time.
class Metrics::ArenaCollector : public prometheus::Collectable {
 public:
  ArenaCollector(const SessionTable* table, MetricsInfo info)
      : table_(table), info_(std::move(info)), started_(std::chrono::steady_clock::now()) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const ArenaSnapshot s = table_->Snapshot();
    std::vector<prometheus::MetricFamily> out;
    AddArenaFamilies(s, &out);
    AddTakeoverFamilies(s, &out);
    AddKindFamilies(s, &out);
    AddBackingFamilies(s, &out);
    AddRegionFamilies(s, &out);
    auto uptime = GaugeFamily("memoffload_uptime_seconds", "Seconds since the daemon started.");
    AddGauge(&uptime,
             std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
    out.push_back(std::move(uptime));
    AddStateFamilies(&out);
    auto build = GaugeFamily("memoffload_build_info", "Always 1; labels carry the version.");
    AddGauge(&build, 1, {{"version", info_.version}});
    out.push_back(std::move(build));
    return out;
  }

 private:
  // What this start took back from the state a restart kept.
  void AddStateFamilies(std::vector<prometheus::MetricFamily>* out) const {
    auto store = GaugeFamily("memoffload_state_store_info",
                             "Always 1; the label says where the arena and its regions outlive a "
                             "restart of the daemon (none: they do not).");
    AddGauge(&store, 1, {{"store", info_.state_store}});
    out->push_back(std::move(store));
    auto regions = GaugeFamily("memoffload_state_recovered_regions",
                               "Checkpoint regions this start took back from the kept state, by "
                               "outcome: kept (CRC32C-verified), unverified (saved without "
                               "checksums, kept), dropped (failed, named in the log).");
    AddGauge(&regions, info_.recovered_regions - info_.unverified_regions, {{"outcome", "kept"}});
    AddGauge(&regions, info_.unverified_regions, {{"outcome", "unverified"}});
    AddGauge(&regions, info_.dropped_regions, {{"outcome", "dropped"}});
    out->push_back(std::move(regions));
    auto bytes = GaugeFamily("memoffload_state_recovered_bytes",
                             "Arena bytes of the regions this start took back.");
    AddGauge(&bytes, static_cast<double>(info_.recovered_bytes));
    out->push_back(std::move(bytes));
    auto seconds = GaugeFamily("memoffload_state_recovery_seconds",
                               "Seconds this start spent taking the kept state back (reading, "
                               "verifying and placing; the arena build not included).");
    AddGauge(&seconds, info_.recovery_seconds);
    out->push_back(std::move(seconds));
    out->push_back(CounterOf(
        "memoffload_state_store_errors_total",
        "Changes (journal records, chunk memfds) the state store could not keep since the "
        "start: a restart may lose what changed since (the log says what).",
        info_.state_errors ? static_cast<double>(info_.state_errors()) : 0));
  }

  // The sessions a take-over handed to this start, and how they came back.
  static void AddTakeoverFamilies(const ArenaSnapshot& s,
                                  std::vector<prometheus::MetricFamily>* out) {
    auto sessions = GaugeFamily(
        "memoffload_takeover_sessions",
        "Sessions a take-over handed to this daemon, by outcome: resumed (by their own "
        "process), waiting (for it, up to 30 s), not_resumed (closed at that time), dropped "
        "(their record refused, named in the log). All 0 after an ordinary start.");
    AddGauge(&sessions, s.handed_resumed, {{"outcome", "resumed"}});
    AddGauge(&sessions, s.handed_waiting, {{"outcome", "waiting"}});
    AddGauge(&sessions, s.handed_not_resumed, {{"outcome", "not_resumed"}});
    AddGauge(&sessions, s.handed_dropped, {{"outcome", "dropped"}});
    out->push_back(std::move(sessions));
    auto wait = GaugeFamily("memoffload_takeover_resume_wait_seconds",
                            "The longest a handed session waited for its resume, from the "
                            "take-over's hand-over (its process's calls paused meanwhile).");
    AddGauge(&wait, s.longest_resume_wait_seconds);
    out->push_back(std::move(wait));
  }

  // The arena's bytes by state, its shape, its sessions and groups.
  void AddArenaFamilies(const ArenaSnapshot& s, std::vector<prometheus::MetricFamily>* out) const {
    auto capacity =
        GaugeFamily("memoffload_arena_capacity_bytes", "Total bytes of the shared arena.");
    AddGauge(&capacity, static_cast<double>(s.capacity_bytes));
    out->push_back(std::move(capacity));
    auto bytes = GaugeFamily("memoffload_arena_bytes",
                             "Arena bytes by state: free, reserved (being written), "
                             "committed (parked), read (prefetched, being read).");
    AddGauge(&bytes, static_cast<double>(s.free_bytes), {{"state", "free"}});
    AddGauge(&bytes, static_cast<double>(s.reserved_bytes), {{"state", "reserved"}});
    AddGauge(&bytes, static_cast<double>(s.committed_bytes), {{"state", "committed"}});
    AddGauge(&bytes, static_cast<double>(s.read_bytes), {{"state", "read"}});
    out->push_back(std::move(bytes));
    auto used =
        GaugeFamily("memoffload_arena_used_bytes", "Arena bytes held by sessions in any state.");
    AddGauge(&used, static_cast<double>(s.capacity_bytes - s.free_bytes));
    out->push_back(std::move(used));
    auto largest = GaugeFamily("memoffload_arena_largest_free_extent_bytes",
                               "Largest contiguous free extent (fragmentation signal).");
    AddGauge(&largest, static_cast<double>(s.largest_free_extent_bytes));
    out->push_back(std::move(largest));
    auto chunks = GaugeFamily("memoffload_arena_chunks", "Memfd chunks in the arena.");
    AddGauge(&chunks, info_.chunks);
    out->push_back(std::move(chunks));
    auto mlocked = GaugeFamily("memoffload_arena_mlocked",
                               "1 when the arena is mlock'ed, 0 when it could not be.");
    AddGauge(&mlocked, info_.mlocked ? 1 : 0);
    out->push_back(std::move(mlocked));
    auto pages = GaugeFamily("memoffload_arena_page_bytes",
                             "Arena bytes by page size, as the kernel gave them at start: "
                             "2 MiB pages of hugetlbfs or of shared-memory transparent huge "
                             "pages (thp), and the system's base pages.");
    const uint64_t thp = info_.thp_bytes_now ? info_.thp_bytes_now() : info_.thp_bytes;
    // Kept bytes not mapped yet are in no series (a moment after a restart).
    const uint64_t known =
        info_.hugetlb_bytes + thp + (info_.unmeasured_bytes_now ? info_.unmeasured_bytes_now() : 0);
    AddGauge(&pages, static_cast<double>(info_.hugetlb_bytes), {{"pages", "hugetlbfs"}});
    AddGauge(&pages, static_cast<double>(thp), {{"pages", "thp"}});
    AddGauge(&pages, static_cast<double>(s.capacity_bytes - std::min(s.capacity_bytes, known)),
             {{"pages", "base"}});
    out->push_back(std::move(pages));
    auto sessions = GaugeFamily("memoffload_sessions", "Sessions currently attached.");
    AddGauge(&sessions, s.sessions);
    out->push_back(std::move(sessions));
    auto waiting =
        GaugeFamily("memoffload_waiting_reserves", "Reserve requests waiting for space right now.");
    AddGauge(&waiting, s.waiting_reserves);
    out->push_back(std::move(waiting));
    auto draining = GaugeFamily("memoffload_draining",
                                "1 while the daemon drains (refuses attaches and reserves).");
    AddGauge(&draining, s.draining ? 1 : 0);
    out->push_back(std::move(draining));
    auto reserve =
        GaugeFamily("memoffload_arena_node_reserve_bytes",
                    "Arena bytes the daemon never hands out (quotas.node_reserve_bytes).");
    AddGauge(&reserve, static_cast<double>(s.node_reserve_bytes));
    out->push_back(std::move(reserve));
    auto groups = GaugeFamily(
        "memoffload_groups",
        "Groups currently held, any state; placed state's blocks apart (memoffload_state_blocks).");
    AddGauge(&groups, static_cast<double>(s.groups));
    out->push_back(std::move(groups));
  }

  // Sessions by what they attached for (a fixed label set), and placed
  // state, whose blocks are not counted as groups.
  static void AddKindFamilies(const ArenaSnapshot& s, std::vector<prometheus::MetricFamily>* out) {
    auto by_kind = GaugeFamily("memoffload_sessions_by_kind",
                               "Sessions attached now, by kind: activations, state (place_state), "
                               "checkpoints, other (tools and clients that do not say).");
    for (uint8_t k = 0; k < kSessionKindCount; ++k) {
      AddGauge(&by_kind, s.sessions_by_kind[k], {{"kind", SessionKindName(SessionKind{k})}});
    }
    out->push_back(std::move(by_kind));
    auto state_bytes = GaugeFamily("memoffload_state_bytes",
                                   "Arena bytes held by placed state (the blocks of state "
                                   "sessions); at most quotas.state_share of each job's limit.");
    AddGauge(&state_bytes, static_cast<double>(s.state_bytes));
    out->push_back(std::move(state_bytes));
    auto state_blocks =
        GaugeFamily("memoffload_state_blocks", "Blocks of placed state held now (not groups).");
    AddGauge(&state_blocks, static_cast<double>(s.state_blocks));
    out->push_back(std::move(state_blocks));
  }

  // Chunk backings replaced at a change of tenant, their spares and stale
  // ones, and the table's internal errors.
  static void AddBackingFamilies(const ArenaSnapshot& s,
                                 std::vector<prometheus::MetricFamily>* out) {
    out->push_back(CounterOf("memoffload_chunk_backings_replaced_total",
                             "Chunks given a new memfd because they changed tenant.",
                             static_cast<double>(s.replaced_backings)));
    out->push_back(CounterOf("memoffload_chunk_backings_unfaulted_total",
                             "Of those, backings handed out before they were pre-faulted "
                             "(no spare was ready).",
                             static_cast<double>(s.unfaulted_backings)));
    prometheus::MetricFamily internal =
        CounterOf("memoffload_internal_errors_total",
                  "Failures that mean a bug in the daemon (each is logged as an error), by where.",
                  static_cast<double>(s.free_errors));
    internal.metric[0].label = {{"where", "session_table_free"}};
    out->push_back(std::move(internal));
    auto spares = GaugeFamily("memoffload_spare_backings",
                              "Pre-faulted memfds ready for the next change of tenant.");
    AddGauge(&spares, static_cast<double>(s.spare_backings));
    out->push_back(std::move(spares));
    auto stale = GaugeFamily("memoffload_stale_backing_bytes",
                             "Bytes of old chunk memfds that processes of a previous tenant "
                             "still map or hold (outside the arena's capacity).");
    AddGauge(&stale, static_cast<double>(s.stale_bytes));
    out->push_back(std::move(stale));
  }

  // Checkpoint regions: their count and bytes by state, their limit, expiries.
  static void AddRegionFamilies(const ArenaSnapshot& s,
                                std::vector<prometheus::MetricFamily>* out) {
    auto regions = GaugeFamily("memoffload_regions",
                               "Checkpoint regions, by state (writing: created, not committed).");
    AddGauge(&regions, static_cast<double>(s.regions - s.committed_regions),
             {{"state", "writing"}});
    AddGauge(&regions, static_cast<double>(s.committed_regions), {{"state", "committed"}});
    out->push_back(std::move(regions));
    auto region_bytes =
        GaugeFamily("memoffload_region_bytes",
                    "Arena bytes held by checkpoint regions, by state (deleted "
                    "regions still open by a reader count as writing until freed).");
    AddGauge(&region_bytes, static_cast<double>(s.region_bytes - s.committed_region_bytes),
             {{"state", "writing"}});
    AddGauge(&region_bytes, static_cast<double>(s.committed_region_bytes),
             {{"state", "committed"}});
    out->push_back(std::move(region_bytes));
    auto region_limit = GaugeFamily("memoffload_region_limit_bytes",
                                    "regions.max_bytes: what all checkpoint regions may hold.");
    AddGauge(&region_limit, static_cast<double>(s.region_max_bytes));
    out->push_back(std::move(region_limit));
    out->push_back(CounterOf("memoffload_regions_expired_total",
                             "Committed checkpoint regions deleted by their TTL.",
                             static_cast<double>(s.regions_expired)));
  }

  const SessionTable* table_;
  const MetricsInfo info_;
  const std::chrono::steady_clock::time_point started_;
};

Metrics::Metrics(const SessionTable* table, MetricsInfo info)
    : registry_(std::make_shared<prometheus::Registry>()),
      arena_collector_(std::make_shared<ArenaCollector>(table, info)),
      max_copy_bytes_(info.chunks > 0 && info.chunk_size_bytes > 0
                          ? static_cast<uint64_t>(info.chunks) * info.chunk_size_bytes
                          : (uint64_t{1} << 53)),
      job_labels_(info.job_labels) {
  requests_ = &prometheus::BuildCounter()
                   .Name("memoffload_requests_total")
                   .Help("gRPC requests by method and status code.")
                   .Register(*registry_);
  auto& latency = prometheus::BuildHistogram()
                      .Name("memoffload_request_duration_seconds")
                      .Help("Time to serve a gRPC request inside the daemon, by method.")
                      .Register(*registry_);
  const prometheus::Histogram::BucketBoundaries buckets = {
      1e-6,   2.5e-6, 5e-6, 1e-5,   2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3,
      2.5e-3, 5e-3,   1e-2, 2.5e-2, 0.1,    0.5,  1,    5,      30};
  for (int m = 0; m < kMethodCount; ++m) {
    latency_[m] = &latency.Add({{"method", MethodName(static_cast<Method>(m))}}, buckets);
  }
  sessions_opened_ = &prometheus::BuildCounter()
                          .Name("memoffload_sessions_opened_total")
                          .Help("Sessions attached since start.")
                          .Register(*registry_)
                          .Add({});
  sessions_closed_ = &prometheus::BuildCounter()
                          .Name("memoffload_sessions_closed_total")
                          .Help("Sessions ended, by reason.")
                          .Register(*registry_);
  auto& reclaimed = prometheus::BuildCounter()
                        .Name("memoffload_reclaimed_bytes_total")
                        .Help("Bytes returned to the pool because their session ended, by reason.")
                        .Register(*registry_);
  auto& reclaimed_sessions =
      prometheus::BuildCounter()
          .Name("memoffload_sessions_reclaimed_total")
          .Help("Sessions that ended while still holding bytes (which were reclaimed), by reason.")
          .Register(*registry_);
  for (int r = 0; r < kCloseReasonCount; ++r) {
    const prometheus::Labels labels = {{"reason", CloseReasonName(static_cast<CloseReason>(r))}};
    sessions_closed_by_reason_[r] = &sessions_closed_->Add(labels);
    reclaimed_bytes_[r] = &reclaimed.Add(labels);
    sessions_reclaimed_[r] = &reclaimed_sessions.Add(labels);
  }
  auto& rejections = prometheus::BuildCounter()
                         .Name("memoffload_reserve_rejections_total")
                         .Help("Reserve requests refused for quota or capacity, by reason.")
                         .Register(*registry_);
  for (int r = 1; r < kRejectReasonCount; ++r) {
    rejections_[r] = &rejections.Add({{"reason", RejectReasonName(static_cast<RejectReason>(r))}});
  }
  attach_refusals_ = &prometheus::BuildCounter()
                          .Name("memoffload_attach_refusals_total")
                          .Help("Attach attempts refused, by reason.")
                          .Register(*registry_);
  // The broker's reasons, created once so that they read 0 rather than
  // missing and a refusal costs no Family::Add.
  for (size_t r = 0; r < kAttachRefusalReasons.size(); ++r) {
    attach_refusals_by_reason_[r] = &attach_refusals_->Add({{"reason", kAttachRefusalReasons[r]}});
  }
  grpc_closed_ = &prometheus::BuildCounter()
                      .Name("memoffload_grpc_connections_closed_total")
                      .Help(
                          "gRPC connections the daemon's HTTP/2 edge closed, by the rule "
                          "their peer broke.")
                      .Register(*registry_);
  offload_bytes_ = &prometheus::BuildCounter()
                        .Name("memoffload_offload_bytes_total")
                        .Help("Data bytes committed into the arena (Commit's used_bytes).")
                        .Register(*registry_)
                        .Add({});
  prefetch_bytes_ = &prometheus::BuildCounter()
                         .Name("memoffload_prefetch_bytes_total")
                         .Help("Data bytes handed back for reading (Prefetch's used_bytes).")
                         .Register(*registry_)
                         .Add({});
  auto& rank_offload_bytes = prometheus::BuildCounter()
                                 .Name("memoffload_rank_offload_bytes_total")
                                 .Help("Data bytes committed, by the session's job id and rank.")
                                 .Register(*registry_);
  auto& rank_prefetch_bytes = prometheus::BuildCounter()
                                  .Name("memoffload_rank_prefetch_bytes_total")
                                  .Help("Data bytes prefetched, by the session's job id and rank.")
                                  .Register(*registry_);
  rank_book_ = std::make_shared<RankBook>(registry_, &rank_offload_bytes, &rank_prefetch_bytes,
                                          info.job_labels);
  residency_ = &prometheus::BuildHistogram()
                    .Name("memoffload_group_residency_seconds")
                    .Help("Time a group spent in the arena, from Commit to Release.")
                    .Register(*registry_)
                    .Add({}, prometheus::Histogram::BucketBoundaries{
                                 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                                 60, 300, 900, 3600});
  auto& copy_bytes = prometheus::BuildCounter()
                         .Name("memoffload_client_copy_bytes_total")
                         .Help(
                             "Bytes clients report having copied, by direction (offload: "
                             "into the arena, with Commit; prefetch: out of it, with Release).")
                         .Register(*registry_);
  auto& copy_seconds = prometheus::BuildCounter()
                           .Name("memoffload_client_copy_seconds_total")
                           .Help(
                               "Seconds clients report their copies took, by direction; "
                               "rate(bytes) / rate(seconds) is the copy throughput.")
                           .Register(*registry_);
  const char* const directions[] = {"offload", "prefetch"};
  for (int d = 0; d < 2; ++d) {
    copy_bytes_[d] = &copy_bytes.Add({{"direction", directions[d]}});
    copy_seconds_[d] = &copy_seconds.Add({{"direction", directions[d]}});
  }
}

Metrics::~Metrics() = default;

Result<std::unique_ptr<prometheus::Exposer>> Metrics::Listen(const std::string& address,
                                                             std::string* bound) {
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    // civetweb: a fixed pool of threads, each dropping a connection whose
    // request does not arrive in time (request_timeout_ms covers the read of
    // the request head, so a half-sent request cannot hold a thread).
    exposer = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", address, "num_threads", std::to_string(kHttpThreads),
        "request_timeout_ms", std::to_string(kHttpRequestTimeoutMs), "enable_keep_alive", "no"});
  } catch (const std::exception& e) {
    return Unavailable("cannot listen for metrics on " + address + ": " + e.what() +
                       " (another process may use the port; pick another server.metrics_address, "
                       "or disable metrics with --metrics-address none)");
  }
  const std::vector<int> ports = exposer->GetListeningPorts();
  const std::string host = address.substr(0, address.rfind(':'));
  *bound = host + ":" + std::to_string(ports.empty() ? 0 : ports.front());
  return exposer;
}

void Metrics::StopServing() { exposer_.reset(); }

void Metrics::Serve(std::unique_ptr<prometheus::Exposer> exposer) {
  exposer_ = std::move(exposer);
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(arena_collector_);
}

std::vector<prometheus::MetricFamily> Metrics::Collect() const {
  std::vector<prometheus::MetricFamily> out = registry_->Collect();
  for (prometheus::MetricFamily& f : arena_collector_->Collect()) out.push_back(std::move(f));
  return out;
}

prometheus::Counter& Metrics::RequestCounter(Method method, StatusCode code) {
  const int m = static_cast<int>(method);
  const int c = static_cast<int>(code);
  prometheus::Counter* counter = request_counters_[m][c].load(std::memory_order_acquire);
  if (counter == nullptr) {
    // Family::Add is thread-safe and returns the same series for equal labels.
    counter = &requests_->Add({{"method", MethodName(method)}, {"code", StatusCodeName(code)}});
    request_counters_[m][c].store(counter, std::memory_order_release);
  }
  return *counter;
}

void Metrics::RecordRequest(Method method, StatusCode code, double seconds) {
  RequestCounter(method, code).Increment();
  latency_[static_cast<int>(method)]->Observe(seconds);
}

void Metrics::SessionOpened() { sessions_opened_->Increment(); }

void Metrics::RecordRejection(RejectReason reason) {
  if (reason != RejectReason::kNone) rejections_[static_cast<int>(reason)]->Increment();
}

void Metrics::SessionClosed(CloseReason reason, uint64_t reclaimed_bytes) {
  const int r = static_cast<int>(reason);
  sessions_closed_by_reason_[r]->Increment();
  if (reclaimed_bytes > 0) {
    reclaimed_bytes_[r]->Increment(static_cast<double>(reclaimed_bytes));
    sessions_reclaimed_[r]->Increment();
  }
}

void Metrics::DeclareGrpcCloseReason(const std::string& reason) {
  grpc_closed_->Add({{"reason", reason}});
}

// Family::Add finds the series (it locks; closes are rare).
void Metrics::GrpcConnectionClosed(const std::string& reason) {
  grpc_closed_->Add({{"reason", reason}}).Increment();
}

void Metrics::AttachRefused(const std::string& reason) {
  for (size_t r = 0; r < kAttachRefusalReasons.size(); ++r) {
    if (reason == kAttachRefusalReasons[r]) {
      attach_refusals_by_reason_[r]->Increment();
      return;
    }
  }
  // Not one of the broker's reasons: a programming error; counted under
  // session_error rather than growing the label set.
  attach_refusals_by_reason_[kAttachRefusalReasons.size() - 1]->Increment();
}

std::shared_ptr<RankSeries> Metrics::SeriesFor(const std::string& job_id, int32_t rank) {
  if (job_labels_ == JobLabels::kNone) return nullptr;  // the node totals count it
  return rank_book_->SeriesFor(rank_book_, job_id, rank);
}

void Metrics::RecordOffload(const RankSeries* series, uint64_t data_bytes) {
  offload_bytes_->Increment(static_cast<double>(data_bytes));
  if (series != nullptr) series->offload_bytes->Increment(static_cast<double>(data_bytes));
}

void Metrics::RecordPrefetch(const RankSeries* series, uint64_t data_bytes) {
  prefetch_bytes_->Increment(static_cast<double>(data_bytes));
  if (series != nullptr) series->prefetch_bytes->Increment(static_cast<double>(data_bytes));
}

void Metrics::RecordResidency(double resident_seconds) {
  if (resident_seconds > 0) residency_->Observe(resident_seconds);
}

void Metrics::RecordClientCopy(CopyDirection direction, uint64_t bytes, double seconds) {
  // One group's copy: never more bytes than the arena holds, never longer
  // than kMaxClientCopySeconds. Anything else is a client bug, not data.
  if (bytes == 0 || bytes > max_copy_bytes_ || !std::isfinite(seconds) || seconds <= 0 ||
      seconds > kMaxClientCopySeconds) {
    return;
  }
  const int d = static_cast<int>(direction);
  copy_bytes_[d]->Increment(static_cast<double>(bytes));
  copy_seconds_[d]->Increment(seconds);
}

}  // namespace memoffload::daemon
