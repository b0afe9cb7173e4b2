#include "app/daemon.h"

#include <grpcpp/grpcpp.h>
#include <prometheus/exposer.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "app/daemon_parts.h"
#include "app/daemon_process.h"
#include "app/notifier.h"
#include "app/process_setup.h"
#include "app/runtime_dir_claim.h"
#include "app/state_recovery.h"
#include "app/takeover.h"
#include "app/takeover_host.h"
#include "base/log.h"
#include "core/link_keys.h"
#include "core/session_table.h"
#include "core/session_token.h"
#include "edge/broker.h"
#include "edge/grpc_listener.h"
#include "edge/service.h"
#include "memoffload/common/runtime_dir.h"
#include "memoffload/common/units.h"
#include "memory/arena.h"
#include "observe/health.h"
#include "observe/metrics.h"
#include "observe/metrics_port.h"

#ifndef MEMOFFLOAD_VERSION
#define MEMOFFLOAD_VERSION "0.0.0-dev"
#endif

namespace memoffload::daemon {

namespace asio = boost::asio;

const char* DaemonVersion() { return MEMOFFLOAD_VERSION; }

Status Daemon::Start() {
  // A pod's container started again after its daemon handed the node on.
  Result<bool> marked = HoldsHandOverMark(config_.state_store, config_.keeper_socket);
  if (!marked.ok()) {
    return Status(marked.status().code(), "lifecycle.state_store: " + marked.status().message());
  }
  if (*marked) return StandBy();
  if (TakesOver()) {
    // The serving daemon pauses its sessions and hands on its state (its
    // sessions too); its sockets come
    // once this one has built its arena from the handed chunks.
    // Everything that can fail is done before "ready": after it the node
    // is this daemon's.
    MEMOFFLOAD_RETURN_IF_ERROR(RequestTakeover());
    MEMOFFLOAD_RETURN_IF_ERROR(BuildArena());
    if (Status st = BuildService(); !st.ok()) {
      takeover_client_->Refuse(st.message());
      return st;
    }
    MEMOFFLOAD_RETURN_IF_ERROR(TakeListeners());
    KeepTakenState();
    return StartServing();
  }
  MEMOFFLOAD_RETURN_IF_ERROR(Listen());
  MEMOFFLOAD_RETURN_IF_ERROR(BuildArena());
  MEMOFFLOAD_RETURN_IF_ERROR(BuildService());
  return StartServing();
}

void Daemon::Run() {
  if (standing_by_) {
    signals_.async_wait(
        [this](const boost::system::error_code& ec, int signo) { OnSignal(ec, signo); });
    WaitForStop();
    MO_LOG_INFO("exiting; the node was not touched");
    return;
  }
  signals_.async_wait(
      [this](const boost::system::error_code& ec, int signo) { OnSignal(ec, signo); });
  // systemd (Type=notify): the arena is built, every listener accepts and
  // the signal handlers are installed, so a SIGTERM from now on drains.
  notifier_.Ready(StatusText());
  if (notifier_.Enabled()) ArmNotifyTimer();
  ArmRegionTimer();
  MapKeptChunks();
  io_.run();
  StopMappingKept();
  takeover_server_.reset();
  StopServing();
  if (!handed_over_) KeepState();  // the new daemon keeps the state now
  if (handed_over_) {
    if (WaitsAfterHandover()) WaitForStop();
    MO_LOG_INFO("handed over: exiting, leaving the runtime dir to the new daemon");
    return;
  }
  claim_->RemoveOwned();
  MO_LOG_INFO("stopped cleanly");
}

void Daemon::KeepTakenState() {
  if (state_store_ == nullptr) return;
  // The node is this daemon's: the store too (the old daemon's mark goes,
  // where the two share a keeper). Not fatal here: the old daemon is gone.
  if (Status st = state_store_->Begin(); !st.ok()) {
    state_store_->Abandon();
    MO_LOG_ERROR(
        "after the take-over: cannot keep the node's state in %s: %s; serving without a state "
        "store: a restart of the daemon now empties the node",
        state_store_->Describe().c_str(), st.ToString().c_str());
    state_store_lost_ = true;
    state_store_.reset();
    return;
  }
  table_->SetRecorder(state_store_.get());
  state_store_->ClearHandOverMark();
}

Status Daemon::Listen() {
  // The per-user default dir is made private: clients trust it only so
  // (memoffload/client/daemon_trust.h).
  const bool per_user = geteuid() != 0 && config_.runtime_dir == DefaultRuntimeDir();
  Result<std::unique_ptr<RuntimeDirClaim>> claim =
      RuntimeDirClaim::Claim(config_.runtime_dir, per_user ? 0700 : 0755);
  if (!claim.ok()) return claim.status();
  claim_ = std::move(claim).value();
  MEMOFFLOAD_RETURN_IF_ERROR(PrepareListening());
  Result<int> grpc_fd = claim_->ListenUnix(grpc_path_, config_.socket_mode, socket_gid_);
  if (!grpc_fd.ok()) return grpc_fd.status();
  Result<int> broker_fd = claim_->ListenUnix(broker_path_, config_.socket_mode, socket_gid_);
  if (!broker_fd.ok()) {
    close(*grpc_fd);
    return broker_fd.status();
  }
  Result<std::string> token = NewSessionToken();
  if (!token.ok()) return token.status();
  admin_token_ = *token;
  return ListenOn(*grpc_fd, *broker_fd, /*lenient=*/false);
}

Status Daemon::PrepareListening() {
  Result<gid_t> socket_gid = ResolveGroup(config_.socket_group);
  if (!socket_gid.ok()) return socket_gid.status();
  socket_gid_ = *socket_gid;
  // Who may connect to the 0660 sockets may attach: the socket group's
  // members (docs/deploy.md: usermod -aG memoffload alice).
  config_.policy.socket_gid = socket_gid_ != static_cast<gid_t>(-1) ? socket_gid_ : getegid();
  grpc_listener_.SetPolicy(config_.policy);
  if (!config_.config_file.empty()) MO_LOG_INFO("config file %s", config_.config_file.c_str());
  RaiseDescriptorLimit(config_);

  grpc_path_ = GrpcSocketPath(config_.runtime_dir);
  broker_path_ = BrokerSocketPath(config_.runtime_dir);
  return Status::Ok();
}

Status Daemon::ListenOn(int grpc_fd, int broker_fd, bool lenient) {
  // Listening fds move into their owners right away, so any return closes them.
  if (Status st = grpc_listener_.Adopt(grpc_fd); !st.ok()) {
    close(broker_fd);
    return st;
  }
  boost::system::error_code ec;
  broker_acceptor_.assign(asio::local::stream_protocol(), broker_fd, ec);
  if (ec) {
    close(broker_fd);
    return Internal("cannot watch the broker socket: " + ec.message());
  }
  // From here the sockets accept (into their backlog), and a SIGTERM or
  // SIGINT that arrives during the pre-fault is handled once the event
  // loop runs, as a clean stop.
  signals_.add(SIGINT);
  signals_.add(SIGTERM);
  signals_.add(SIGHUP);
  auto fail = [lenient](const Status& st) {
    if (lenient) MO_LOG_ERROR("after the take-over: %s", st.ToString().c_str());
    return lenient ? Status::Ok() : st;
  };
  Result<int> takeover = claim_->ListenUnix(config_.runtime_dir + "/" + kTakeoverSocketName, 0600,
                                            static_cast<gid_t>(-1));
  if (!takeover.ok()) MEMOFFLOAD_RETURN_IF_ERROR(fail(takeover.status()));
  if (takeover.ok()) takeover_fd_ = *takeover;
  if (!config_.health_address.empty()) {
    Result<std::string> bound = health_.Start(config_.health_address);
    if (!bound.ok()) MEMOFFLOAD_RETURN_IF_ERROR(fail(bound.status()));
    if (bound.ok()) health_bound_ = *bound;
  }
  // A taken metrics port does not stop the daemon (metrics_port.h).
  if (!config_.metrics_address.empty()) metrics_port_.TryBind();
  if (Status st = WriteAdminToken(config_.runtime_dir, admin_token_); !st.ok()) {
    MEMOFFLOAD_RETURN_IF_ERROR(fail(st));
  }
  claim_->Own(config_.runtime_dir + "/" + kAdminTokenName);
  return Status::Ok();
}

Status Daemon::BuildArena() {
  ArenaOptions options;
  options.size_bytes = config_.arena_size_bytes;
  options.chunk_size_bytes = config_.chunk_size_bytes;
  options.prefault_threads = config_.prefault_threads;
  options.hugepages = config_.hugepages;
  options.mlock = config_.mlock;
  options.numa_node = config_.numa_node;
  if (takeover_client_ != nullptr) {
    // The handed-on arena, as it is (its layout wins over the configuration).
    UseKeptLayout(takeover_client_->snapshot().layout, config_, "handed-on", &options);
    options.adopt_fds = std::move(takeover_client_->chunk_fds());
    takeover_client_->chunk_fds().clear();
    for (int fd : options.adopt_fds) kept_.adopted.push_back(fd >= 0);
  } else {
    Result<StateLoad> kept = LoadKeptState(config_, &options);
    if (!kept.ok()) return kept.status();
    kept_ = std::move(kept).value();
  }
  MO_LOG_INFO("building arena: %s in %s chunks, pre-faulting with %d threads",
              FormatSize(options.size_bytes).c_str(), FormatSize(options.chunk_size_bytes).c_str(),
              config_.prefault_threads);
  Result<std::unique_ptr<Arena>> arena = Arena::Build(options, &report_);
  if (!arena.ok()) return arena.status();
  arena_ = std::move(arena).value();
  if (!report_.mlocked && config_.mlock) {
    MO_LOG_WARN("mlock failed: %s", report_.mlock_problem.c_str());
  }
  // Kept chunks are mapped after "ready": their pages are told then.
  const uint64_t faulted = arena_->capacity_bytes() - report_.adopted_bytes;
  char fault[160];
  std::snprintf(fault, sizeof fault, "pre-fault %.3f s of %s (%.2f GB/s)", report_.build_seconds,
                FormatSize(faulted).c_str(), faulted / 1e9 / std::max(report_.build_seconds, 1e-9));
  std::string built = faulted == 0 ? std::string() : std::string(", ") + fault;
  if (report_.adopted_chunks != 0) {
    built += ", " + std::to_string(report_.adopted_chunks) + " kept chunks (" +
             FormatSize(report_.adopted_bytes) + ") mapped after ready";
  }
  MO_LOG_INFO("arena ready: %s, %u chunks of %s, on %s%s, mlock %s",
              FormatSize(arena_->capacity_bytes()).c_str(), arena_->chunk_count(),
              FormatSize(arena_->chunk_size_bytes()).c_str(), DescribeArenaPages(*arena_).c_str(),
              built.c_str(), report_.mlocked ? "yes" : "no");
  if (!report_.pages_note.empty()) {
    MO_LOG_INFO("arena not all on huge pages: %s", report_.pages_note.c_str());
  }
  return Status::Ok();
}

Status Daemon::BuildService() {
  Result<TenantMode> tenant_mode = ParseTenantMode(config_.tenant);
  if (!tenant_mode.ok()) return tenant_mode.status();
  FreshBackingOptions fresh;
  fresh.chunk_size_bytes = arena_->chunk_size_bytes();
  fresh.spares = *tenant_mode == TenantMode::kNone ? 0 : 1;
  fresh.hugepages = config_.hugepages && report_.hugepage_chunks > 0;
  fresh.mlock = arena_->mlocked();
  fresh.numa_node = config_.numa_node;
  fresh_backing_ = std::make_unique<FreshBacking>(fresh);
  table_ = std::make_unique<SessionTable>(arena_.get(), config_.policy, *tenant_mode,
                                          fresh_backing_.get());
  // The node's identity for replication survives a restart with its state.
  instance_id_ = kept_.state.found ? kept_.state.instance_id : RandomInstanceId();
  const uint64_t instance_id = instance_id_;
  MO_LOG_INFO("instance id %016lx", static_cast<unsigned long>(instance_id));
  // What the configuration can refuse, before the kept state is taken into
  // this daemon's store (a take-over refused after it leaves the store the
  // old daemon serves on rewritten).
  MEMOFFLOAD_RETURN_IF_ERROR(LoadLinkKeys(config_, &link_keys_));
  Result<JobLabels> job_labels = ParseJobLabels(config_.metrics_job_labels);
  if (!job_labels.ok()) return job_labels.status();
  MetricsInfo state_info;
  Result<std::unique_ptr<StateStore>> store = ResumeKeptState(
      &kept_, arena_.get(), table_.get(), config_.prefault_threads, instance_id,
      takeover_client_ != nullptr ? takeover_client_->owners() : kept_.state.owners,
      takeover_client_ != nullptr,
      takeover_client_ != nullptr && takeover_client_->owners_complete(), &state_info);
  if (!store.ok()) return store.status();
  state_store_ = std::move(store).value();
  // Mapped once the daemon serves (Run), after the renewals above.
  kept_to_map_ = arena_->TakeUnmappedKept();

  metrics_ = std::make_unique<Metrics>(
      table_.get(),
      MetricsInfo{
          DaemonVersion(), arena_->chunk_count(), arena_->chunk_size_bytes(), arena_->mlocked(),
          *job_labels, arena_->hugetlb_bytes(), arena_->thp_bytes(), state_info.state_store,
          state_info.recovered_regions, state_info.recovered_bytes, state_info.dropped_regions,
          state_info.unverified_regions, state_info.recovery_seconds,
          [this]() -> uint64_t {
            return state_store_ != nullptr ? state_store_->Stats().errors
                                           : (state_store_lost_ ? 1 : 0);
          },
          [this] { return arena_->thp_bytes(); }, [this] { return arena_->unmeasured_bytes(); }});
  service_ = std::make_unique<OffloadService>(
      arena_.get(), table_.get(), metrics_.get(),
      ServiceInfo{DaemonVersion(), config_.runtime_dir, metrics_port_.bound(), admin_token_,
                  instance_id},
      config_);
  server_ = BuildGrpcServer(service_.get());
  if (server_ == nullptr) return Unavailable("cannot start the gRPC server for " + grpc_path_);
  for (int v = 1; v < kH2ViolationCount; ++v) {
    metrics_->DeclareGrpcCloseReason(H2ViolationName(static_cast<H2Violation>(v)));
  }
  return Status::Ok();
}

Status Daemon::StartServing() {
  if (auto exposer = metrics_port_.take()) metrics_->Serve(std::move(exposer));
  service_->SetMetricsAddress(metrics_port_.bound());
  if (!metrics_port_.problem().empty()) {
    metrics_port_.RetryUntilBound(
        [this](std::unique_ptr<prometheus::Exposer> exposer, const std::string& bound) {
          metrics_->Serve(std::move(exposer));
          service_->SetMetricsAddress(bound);
        });
  }
  grpc_listener_.OnViolation(
      [this](H2Violation why) { metrics_->GrpcConnectionClosed(H2ViolationName(why)); });
  grpc_listener_.Start(server_.get());

  BrokerOptions broker;
  broker.socket_path = broker_path_;
  broker.grpc_socket_path = grpc_path_;
  broker.socket_mode = config_.socket_mode;
  broker.socket_gid = socket_gid_;
  broker.hello_timeout_ms = static_cast<int>(config_.hello_timeout_ms);
  broker.instance_id = instance_id_;
  broker.max_connections = config_.max_connections;
  broker.max_connections_per_uid = config_.max_connections_per_uid;
  broker.link_keys = &link_keys_;
  broker_ = std::make_unique<Broker>(io_, arena_.get(), table_.get(), metrics_.get(), broker,
                                     config_.policy);
  // Placed state is never released by itself: a drain asks its sessions to
  // move it out (from a gRPC thread for memoffloadctl drain, hence the post).
  table_->OnDrainStart([this](const std::string& why) {
    asio::post(io_, [this, why] {
      if (broker_ != nullptr) broker_->AskToLeave(why);
    });
  });
  MEMOFFLOAD_RETURN_IF_ERROR(broker_->Start(broker_acceptor_.release()));
  takeover_host_ = std::make_unique<LoopTakeoverHost>(
      TakeoverParts{&io_, table_.get(), arena_.get(), instance_id_, config_.drain_timeout_ms,
                    [this] { return state_store_ != nullptr ? state_store_->last_seq() : 0; },
                    [this] { region_timer_.cancel(); }, [this] { ArmRegionTimer(); },
                    [this] { broker_->CloseAll(); },
                    [this] {
                      // A waiting process keeps answering probes (in its
                      // own pod: its port is not the new daemon's), and
                      // marks its store so that it never serves from it.
                      if (config_.after_handover == "wait") {
                        MarkHandedOver();
                      } else {
                        health_.Stop();
                      }
                      metrics_port_.Stop();
                      metrics_->StopServing();
                      HandoffListeners l{broker_->ReleaseListener(),
                                         grpc_listener_.ReleaseListener(), claim_->lock_fd()};
                      claim_->Disown();
                      handed_over_ = true;
                      return l;
                    },
                    [this] { StopLoop(); },
                    [this] {
                      if (state_store_ != nullptr) state_store_->DisownHandedRecord();
                    }});
  if (takeover_fd_ >= 0) {
    takeover_server_ =
        std::make_unique<TakeoverServer>(std::exchange(takeover_fd_, -1), takeover_host_.get());
  }
  // A take-over's sessions, or a restart's, wait for their processes from now.
  table_->StartResumeClock(kResumeWithin);
  if (takeover_client_ != nullptr) {
    const ArenaSnapshot s = table_->Snapshot();
    MO_LOG_INFO(
        "took over the node: %u checkpoint regions (%s), %u sessions to resume (%s in "
        "groups), %u chunks adopted, %.3f s after the request",
        s.committed_regions, FormatSize(s.committed_region_bytes).c_str(), s.handed_waiting,
        FormatSize(s.group_bytes()).c_str(), report_.adopted_chunks,
        std::chrono::duration<double>(Clock::now() - takeover_started_).count());
    takeover_client_.reset();
  }
  LogListening();
  return Status::Ok();
}

void Daemon::LogListening() const {
  MO_LOG_INFO("listening: runtime dir %s", config_.runtime_dir.c_str());
  MO_LOG_INFO("  broker  %s", broker_path_.c_str());
  MO_LOG_INFO("  gRPC    unix:%s", grpc_path_.c_str());
  MO_LOG_INFO("  metrics %s", !metrics_port_.problem().empty()
                                  ? ("not served: " + metrics_port_.problem()).c_str()
                              : metrics_port_.bound().empty()
                                  ? "disabled"
                                  : ("http://" + metrics_port_.bound() + "/metrics").c_str());
  MO_LOG_INFO("  health  %s", health_bound_.empty()
                                  ? "disabled"
                                  : ("http://" + health_bound_ + "/readyz, /livez").c_str());
  MO_LOG_INFO("clients: export MEMOFFLOAD_RUNTIME_DIR=%s", config_.runtime_dir.c_str());
}

HealthState Daemon::Probe() const {
  HealthState state;
  if (handed_over_) {
    state.not_ready = "handed the node over to a new daemon";
    return state;
  }
  state.draining = table_ != nullptr && table_->draining();
  state.not_ready = grpc_listener_.Problem();
  state.degraded = metrics_port_.problem();
  return state;
}

std::string Daemon::StatusText() const {
  const ArenaSnapshot s = table_->Snapshot();
  return "arena " + FormatSize(s.capacity_bytes - s.free_bytes) + " of " +
         FormatSize(s.capacity_bytes) + " used, " + std::to_string(s.sessions) + " sessions" +
         (s.draining ? ", draining" : "");
}

Status RunDaemon(const DaemonConfig& config, int argc, const char* const* argv) {
  Daemon daemon(config, argc, argv);
  MEMOFFLOAD_RETURN_IF_ERROR(daemon.Start());
  daemon.Run();
  return Status::Ok();
}

}  // namespace memoffload::daemon
