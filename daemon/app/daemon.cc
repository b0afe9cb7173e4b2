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

#include "app/config_changes.h"
#include "app/daemon_parts.h"
#include "app/notifier.h"
#include "app/process_setup.h"
#include "app/runtime_dir_claim.h"
#include "app/state_recovery.h"
#include "app/systemd_job.h"  // SigtermKeepsSessions
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
namespace {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

// How often a taken metrics port is tried again (metrics_port.h).
constexpr int kMetricsRetryMs = 5000;

}  // namespace

const char* DaemonVersion() { return MEMOFFLOAD_VERSION; }

namespace {
// The running daemon: every part it wires together is a member, declared in
// the order it is made, so that whatever step fails, the parts made so far
// are undone by their own destructors (the runtime dir claim last: the files
// this instance created, and only those, go with it).
class Daemon {
 public:
  Daemon(DaemonConfig config, int argc, const char* const* argv)
      : config_(std::move(config)),
        argc_(argc),
        argv_(argv),
        grpc_listener_(io_, config_.policy, config_.max_connections,
                       config_.max_connections_per_uid),
        health_(io_, [this] { return Probe(); }),
        metrics_port_(io_, config_.metrics_address, kMetricsRetryMs) {}
  ~Daemon() {
    StopServing();
    if (takeover_fd_ >= 0) close(takeover_fd_);
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Claims the runtime dir, binds every listener, builds the arena and starts
  // serving. One clear error otherwise.
  Status Start() {
    // A pod's container started again after its daemon handed the node on.
    Result<bool> marked = HoldsHandOverMark(config_.state_store, config_.keeper_socket);
    if (!marked.ok()) return marked.status();
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
      // The old daemon's mark, where the two share a keeper: the node is
      // this daemon's, and so is the store.
      if (state_store_ != nullptr) state_store_->ClearHandOverMark();
      return StartServing();
    }
    MEMOFFLOAD_RETURN_IF_ERROR(Listen());
    MEMOFFLOAD_RETURN_IF_ERROR(BuildArena());
    MEMOFFLOAD_RETURN_IF_ERROR(BuildService());
    return StartServing();
  }

  // Runs the event loop until a signal stops it, then stops serving.
  void Run() {
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
    io_.run();
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

 private:
  // lifecycle.take_over: "always" (--take-over), or "auto" when a daemon
  // holds the runtime dir's instance lock.
  bool TakesOver() const {
    if (config_.take_over != "auto") return config_.take_over == "always";
    if (RuntimeDirClaim::Held(config_.runtime_dir)) return true;
    MO_LOG_INFO("lifecycle.take_over = auto: no daemon serves %s; starting",
                config_.runtime_dir.c_str());
    return false;
  }

  // A start whose store holds the hand-over mark: it answers its probes
  // (/readyz 503) and waits for a signal, touching nothing of the node.
  Status StandBy() {
    MO_LOG_WARN(
        "the state store (the keeper at %s) holds the mark of a hand-over: this pod's daemon "
        "gave the node to another, and its state is stale since; not serving (delete the pod, "
        "or stop its keeper to start afresh)",
        config_.keeper_socket.c_str());
    if (!config_.health_address.empty()) {
      Result<std::string> bound = health_.Start(config_.health_address);
      if (!bound.ok()) return bound.status();
    }
    signals_.add(SIGINT);
    signals_.add(SIGTERM);
    signals_.add(SIGHUP);
    handed_over_ = standing_by_ = true;
    return Status::Ok();
  }

  bool WaitsAfterHandover() const { return handed_over_ && config_.after_handover == "wait"; }

  // lifecycle.after_handover = "wait": the process stays, doing nothing with
  // the node, until a signal (a pod's container that exited would be started
  // again, and take the node back); its health port says so meanwhile.
  void WaitForStop() {
    claim_.reset();  // its instance lock is the new daemon's alone
    MO_LOG_INFO("%s: waiting for a signal to exit%s; /livez answers 200, /readyz 503",
                standing_by_ ? "standing by" : "handed over",
                standing_by_ ? "" : " (lifecycle.after_handover = wait)");
    io_.restart();
    io_.run();  // OnSignal stops it
  }

  void MarkHandedOver() {
    if (state_store_ == nullptr) return;
    if (Status st = state_store_->MarkHandedOver("handed over by pid " + std::to_string(getpid()));
        !st.ok()) {
      MO_LOG_ERROR(
          "cannot mark the state store as handed over: %s; a restart of this daemon before its "
          "pod goes could take the node back",
          st.ToString().c_str());
    }
  }

  // At exit: a snapshot of the regions for the next start (state_store.h).
  void KeepState() {
    if (state_store_ == nullptr) return;
    if (Status st = state_store_->Compact(kept_sessions_, kept_owners_); !st.ok()) {
      MO_LOG_ERROR("cannot write the state snapshot: %s; the next start replays the journal",
                   st.ToString().c_str());
      return;
    }
    const ArenaSnapshot s = table_->Snapshot();
    MO_LOG_INFO(
        "state kept in %s: %u checkpoint region%s (%s) and %zu session%s for the next start (a "
        "restart takes them back; a full stop of the store releases them)",
        state_store_->Describe().c_str(), s.committed_regions, s.committed_regions == 1 ? "" : "s",
        FormatSize(s.committed_region_bytes).c_str(), kept_sessions_.size(),
        kept_sessions_.size() == 1 ? "" : "s");
  }

  // Every listener is bound before the arena is built: a busy port or a bad
  // address is found in milliseconds, not after pre-faulting the arena.
  Status Listen() {
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

  // The socket group, the policy and the paths: before any listener.
  Status PrepareListening() {
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

  // Adopts the listening sockets (bound here, or handed on by a take-over),
  // then binds the rest: the take-over socket, health, metrics, the admin token.
  // With `lenient` (a take-over, after "ready": the node is this daemon's
  // whatever happens), what fails past the listeners is logged, not fatal.
  Status ListenOn(int grpc_fd, int broker_fd, bool lenient) {
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

  Status BuildArena() {
    ArenaOptions options;
    options.size_bytes = config_.arena_size_bytes;
    options.chunk_size_bytes = config_.chunk_size_bytes;
    options.prefault_threads = config_.prefault_threads;
    options.hugepages = config_.hugepages;
    options.mlock = config_.mlock;
    options.numa_node = config_.numa_node;
    if (takeover_client_ != nullptr) {
      // The handed-on arena, as it is (its layout wins over the configuration).
      options.size_bytes = takeover_client_->snapshot().layout.capacity_bytes;
      options.chunk_size_bytes = takeover_client_->snapshot().layout.chunk_bytes;
      options.adopt_fds = std::move(takeover_client_->chunk_fds());
      takeover_client_->chunk_fds().clear();
      for (int fd : options.adopt_fds) kept_.adopted.push_back(fd >= 0);
    } else {
      Result<StateLoad> kept = LoadKeptState(config_, &options);
      if (!kept.ok()) return kept.status();
      kept_ = std::move(kept).value();
    }
    MO_LOG_INFO("building arena: %s in %s chunks, pre-faulting with %d threads",
                FormatSize(config_.arena_size_bytes).c_str(),
                FormatSize(config_.chunk_size_bytes).c_str(), config_.prefault_threads);
    Result<std::unique_ptr<Arena>> arena = Arena::Build(options, &report_);
    if (!arena.ok()) return arena.status();
    arena_ = std::move(arena).value();
    if (!report_.mlocked && config_.mlock) {
      MO_LOG_WARN("mlock failed: %s", report_.mlock_problem.c_str());
    }
    MO_LOG_INFO(
        "arena ready: %s, %u chunks of %s, on %s, pre-fault %.3f s (%.2f GB/s), mlock %s",
        FormatSize(arena_->capacity_bytes()).c_str(), arena_->chunk_count(),
        FormatSize(arena_->chunk_size_bytes()).c_str(),
        DescribePages(arena_->capacity_bytes(), report_.hugetlb_bytes, report_.thp_bytes).c_str(),
        report_.build_seconds,
        arena_->capacity_bytes() / 1e9 / std::max(report_.build_seconds, 1e-9),
        report_.mlocked ? "yes" : "no");
    if (!report_.pages_note.empty()) {
      MO_LOG_INFO("arena not all on huge pages: %s", report_.pages_note.c_str());
    }
    return Status::Ok();
  }

  // The table (with what the start took back), the metrics, the service and
  // the gRPC server: everything but the listeners.
  Status BuildService() {
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
    MetricsInfo state_info;
    Result<std::unique_ptr<StateStore>> store = ResumeKeptState(
        &kept_, arena_.get(), table_.get(), config_.prefault_threads, instance_id,
        takeover_client_ != nullptr ? takeover_client_->owners() : kept_.state.owners, &state_info);
    if (!store.ok()) return store.status();
    state_store_ = std::move(store).value();

    MEMOFFLOAD_RETURN_IF_ERROR(LoadLinkKeys(config_, &link_keys_));

    Result<JobLabels> job_labels = ParseJobLabels(config_.metrics_job_labels);
    if (!job_labels.ok()) return job_labels.status();
    metrics_ = std::make_unique<Metrics>(
        table_.get(),
        MetricsInfo{
            DaemonVersion(), arena_->chunk_count(), arena_->chunk_size_bytes(), arena_->mlocked(),
            *job_labels, arena_->hugetlb_bytes(), arena_->thp_bytes(), state_info.state_store,
            state_info.recovered_regions, state_info.recovered_bytes, state_info.dropped_regions,
            state_info.unverified_regions, state_info.recovery_seconds, [this]() -> uint64_t {
              return state_store_ != nullptr ? state_store_->Stats().errors : 0;
            }});
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

  // Starts accepting: the metrics port, the gRPC listener, the broker, the
  // take-over socket.
  Status StartServing() {
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
                      [this] { StopLoop(); }});
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

  // --take-over, first part: the serving daemon's state (after its drain).
  Status RequestTakeover() {
    takeover_started_ = Clock::now();
    if (notifier_.Enabled()) {
      return FailedPrecondition(
          "--take-over under systemd: restart the unit instead (systemctl restart memoffloadd; "
          "its fd store keeps the checkpoint regions)");
    }
    Result<std::string> token = NewSessionToken();
    if (!token.ok()) return token.status();
    admin_token_ = *token;
    MEMOFFLOAD_RETURN_IF_ERROR(PrepareListening());
    MO_LOG_INFO(
        "taking over the node from the daemon serving %s (its sessions pause, then resume "
        "here)",
        config_.runtime_dir.c_str());
    Result<std::unique_ptr<TakeoverClient>> client =
        TakeoverClient::Request(config_.runtime_dir, config_.drain_timeout_ms);
    if (!client.ok()) return client.status();
    takeover_client_ = std::move(client).value();
    // The store this daemon keeps state in (what the old one put there is
    // replaced by Begin).
    Result<StateLoad> load = LoadState(config_.state_store, config_.keeper_socket);
    if (!load.ok()) {
      takeover_client_->Refuse("cannot open the state store: " + load.status().message());
      return load.status();
    }
    kept_ = std::move(load).value();
    UseHandedState(*takeover_client_, &kept_);
    return Status::Ok();
  }

  // --take-over, second part: "ready", then the serving daemon's listeners.
  Status TakeListeners() {
    Result<HandoffListeners> l = takeover_client_->Ready(
        broker_path_, grpc_path_, config_.runtime_dir + "/" + kInstanceLockName);
    if (!l.ok()) return l.status();
    Result<std::unique_ptr<RuntimeDirClaim>> claim =
        RuntimeDirClaim::Adopt(config_.runtime_dir, l->lock_fd);
    if (!claim.ok()) {
      close(l->grpc_fd);
      close(l->broker_fd);
      return claim.status();
    }
    claim_ = std::move(claim).value();
    claim_->Own(grpc_path_);
    claim_->Own(broker_path_);
    return ListenOn(l->grpc_fd, l->broker_fd, /*lenient=*/true);
  }

  void LogListening() const {
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

  HealthState Probe() const {
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

  std::string StatusText() const {
    const ArenaSnapshot s = table_->Snapshot();
    return "arena " + FormatSize(s.capacity_bytes - s.free_bytes) + " of " +
           FormatSize(s.capacity_bytes) + " used, " + std::to_string(s.sessions) + " sessions" +
           (s.draining ? ", draining" : "");
  }

  // Deletes checkpoint regions past their TTL, once a second.
  void ArmRegionTimer() {
    region_timer_.expires_after(std::chrono::seconds(1));
    region_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      for (const std::string& line : table_->CloseUnresumed(Clock::now())) {
        MO_LOG_WARN("handed sessions: %s", line.c_str());
      }
      if (uint64_t expired = table_->ExpireRegions(Clock::now()); expired != 0) {
        MO_LOG_INFO("deleted %lu checkpoint region%s past %s TTL",
                    static_cast<unsigned long>(expired), expired == 1 ? "" : "s",
                    expired == 1 ? "its" : "their");
      }
      ArmRegionTimer();
    });
  }

  // WATCHDOG=1 and a fresh STATUS= from the event loop, every half watchdog
  // timeout (every 10 s without one); it keeps going while draining.
  void ArmNotifyTimer() {
    notify_timer_.expires_after(notifier_.WatchdogEnabled()
                                    ? notifier_.WatchdogInterval()
                                    : std::chrono::microseconds(std::chrono::seconds(10)));
    notify_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      notifier_.WatchdogPing();
      notifier_.Status(StatusText());
      ArmNotifyTimer();
    });
  }

  void OnSignal(const boost::system::error_code& ec, int signo) {
    if (ec) return;
    if (handed_over_) {
      MO_LOG_INFO("received %s after the hand-over", strsignal(signo));
      io_.stop();
      return;
    }
    if (signo == SIGHUP) {
      Reload();
    } else if (signo == SIGTERM && !draining_for_exit_) {
      if (KeepsSessions()) {
        KeepSessions();
      } else {
        BeginDrain();
      }
    } else {
      MO_LOG_INFO("received %s: stopping now", strsignal(signo));
      notifier_.Stopping();
      StopLoop();
      return;
    }
    signals_.async_wait([this](const boost::system::error_code& e, int n) { OnSignal(e, n); });
  }

  // SIGHUP: access, quotas, region limits and replication keys change live;
  // the rest waits for a restart.
  void Reload() {
    Result<DaemonConfig> fresh = ReloadConfig(config_, argc_, argv_, ProcessEnvironment());
    if (!fresh.ok()) {
      MO_LOG_ERROR("config reload rejected, keeping the previous configuration: %s",
                   fresh.status().message().c_str());
      return;
    }
    if (std::string problem = ReloadProblem(*fresh, arena_->capacity_bytes()); !problem.empty()) {
      MO_LOG_ERROR("config reload rejected, keeping the previous configuration: %s",
                   problem.c_str());
      return;
    }
    LogConfigChanges(config_, *fresh);
    ApplyLiveSettings(*fresh, &config_);
    table_->SetPolicy(config_.policy);
    broker_->SetPolicy(config_.policy);
    grpc_listener_.SetPolicy(config_.policy);
    service_->SetConfig(config_);
    if (Status keys = LoadLinkKeys(config_, &link_keys_); !keys.ok()) {
      MO_LOG_ERROR("replication keys not reloaded, keeping the previous ones: %s",
                   keys.message().c_str());
    }
    MO_LOG_INFO("config reloaded from %s", config_.config_file.c_str());
  }

  // SIGTERM with a state store keeps the sessions for the next start
  // (app/systemd_job.h says when).
  bool KeepsSessions() const {
    return SigtermKeepsSessions(config_.keep_sessions, state_store_ != nullptr, notifier_.Enabled(),
                                *table_);
  }

  // Freezes the table (every call is answered "send it again"), takes its
  // sessions' records, tells each process to resume on the next daemon, and
  // stops once those notices are written (KeepState stores the records).
  void KeepSessions() {
    draining_for_exit_ = true;
    notifier_.Stopping();
    table_->SetFrozen(true);
    kept_sessions_ = table_->SessionRecords();
    kept_owners_ = table_->ChunkOwners();
    // Closing the sessions as the daemon exits changes nothing kept.
    table_->SetRecorder(nullptr);
    const ArenaSnapshot s = table_->Snapshot();
    MO_LOG_INFO(
        "received SIGTERM: keeping %zu session%s (%s in groups) and %u checkpoint region%s (%s) "
        "in %s for the next start; their processes resume them within %lld s of it "
        "(memoffloadctl drain before a stop ends them instead)",
        kept_sessions_.size(), kept_sessions_.size() == 1 ? "" : "s",
        FormatSize(s.group_bytes()).c_str(), s.committed_regions,
        s.committed_regions == 1 ? "" : "s", FormatSize(s.committed_region_bytes).c_str(),
        state_store_->Describe().c_str(), static_cast<long long>(kResumeWithin.count()));
    broker_->NoticeResume("memoffloadd restarts keeping this session: resume it on the next one");
    drain_deadline_ = Clock::now() + std::chrono::milliseconds(500);
    StopOnceNoticed();
  }

  void StopOnceNoticed() {
    if (broker_->Flushed() || Clock::now() >= drain_deadline_) return StopLoop();
    drain_timer_.expires_after(std::chrono::milliseconds(5));
    drain_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (!ec) StopOnceNoticed();
    });
  }

  // SIGTERM: refuse new work, wait until no group is held or the deadline.
  void BeginDrain() {
    draining_for_exit_ = true;
    notifier_.Stopping();
    const ArenaSnapshot s = table_->Snapshot();
    // The bytes waited for are the groups'; regions are not (CheckDrained).
    MO_LOG_INFO(
        "received SIGTERM: draining (%u sessions, %s held in groups; deadline %lu ms; "
        "%u checkpoint region%s (%s) not waited for)",
        s.sessions, FormatSize(s.group_bytes()).c_str(),
        static_cast<unsigned long>(config_.drain_timeout_ms), s.regions, s.regions == 1 ? "" : "s",
        FormatSize(s.region_bytes).c_str());
    table_->BeginShutdown();
    drain_deadline_ = Clock::now() + std::chrono::milliseconds(config_.drain_timeout_ms);
    CheckDrained();
  }

  void CheckDrained() {
    const ArenaSnapshot s = table_->Snapshot();
    // Groups are what sessions still need to hand back; checkpoint regions
    // do not survive the exit whatever the wait, so they are not waited for.
    const uint64_t groups_bytes = s.group_bytes();
    const bool empty = groups_bytes == 0;
    if (empty || Clock::now() >= drain_deadline_) {
      if (!empty) {
        MO_LOG_WARN("drain deadline passed with %s still held by %u sessions; stopping",
                    FormatSize(groups_bytes).c_str(), s.sessions);
      } else {
        MO_LOG_INFO("drained: no groups held");
      }
      if (s.regions != 0 && state_store_ == nullptr) {
        MO_LOG_WARN(
            "%u checkpoint region%s (%s) end with the daemon; jobs load from their "
            "durable checkpoints after it restarts",
            s.regions, s.regions == 1 ? "" : "s", FormatSize(s.region_bytes).c_str());
      }
      StopLoop();
      return;
    }
    drain_timer_.expires_after(std::chrono::milliseconds(50));
    drain_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (!ec) CheckDrained();
    });
  }

  // Stops accepting, closes every session and leaves the event loop.
  void StopLoop() {
    notify_timer_.cancel();
    region_timer_.cancel();
    drain_timer_.cancel();
    if (!WaitsAfterHandover()) health_.Stop();
    metrics_port_.Stop();
    if (broker_ != nullptr) broker_->StopAccepting();
    grpc_listener_.Stop();
    if (broker_ != nullptr) broker_->CloseAll();
    io_.stop();
  }

  // Nothing new reaches the gRPC server; what is still in flight is cancelled.
  void StopServing() {
    grpc_listener_.Stop();
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    server_->Wait();
    server_.reset();
  }

  DaemonConfig config_;
  const int argc_;
  const char* const* argv_;
  std::unique_ptr<RuntimeDirClaim> claim_;  // first made, last gone
  gid_t socket_gid_ = static_cast<gid_t>(-1);
  std::string grpc_path_, broker_path_;
  asio::io_context io_;
  asio::signal_set signals_{io_};
  GrpcListener grpc_listener_;
  asio::local::stream_protocol::acceptor broker_acceptor_{io_};
  HealthServer health_;
  std::string health_bound_;
  MetricsPort metrics_port_;  // the metrics listener until Serve takes it
  std::string admin_token_;
  ArenaBuildReport report_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<FreshBacking> fresh_backing_;
  StateLoad kept_;  // what the start took back
  uint64_t instance_id_ = 0;
  // Take-over: the request this daemon made (until it serves), and its
  // listening socket until the server that answers others' takes it.
  std::unique_ptr<TakeoverClient> takeover_client_;
  Clock::time_point takeover_started_;
  int takeover_fd_ = -1;
  bool handed_over_ = false;
  bool standing_by_ = false;                 // StandBy: the start found the hand-over mark
  std::unique_ptr<StateStore> state_store_;  // outlives table_, which records into it
  std::unique_ptr<SessionTable> table_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<OffloadService> service_;
  std::unique_ptr<grpc::Server> server_;
  LinkKeys link_keys_;  // before broker_, which points at it
  std::unique_ptr<Broker> broker_;
  std::unique_ptr<LoopTakeoverHost> takeover_host_;
  std::unique_ptr<TakeoverServer> takeover_server_;  // its thread uses what is above
  Notifier notifier_;
  asio::steady_timer notify_timer_{io_};
  asio::steady_timer drain_timer_{io_};
  asio::steady_timer region_timer_{io_};
  Clock::time_point drain_deadline_;
  bool draining_for_exit_ = false;
  // SIGTERM with a state store: the sessions the next start resumes.
  std::vector<SessionRecord> kept_sessions_;
  std::vector<ChunkOwnerRecord> kept_owners_;
};

}  // namespace

Status RunDaemon(const DaemonConfig& config, int argc, const char* const* argv) {
  Daemon daemon(config, argc, argv);
  MEMOFFLOAD_RETURN_IF_ERROR(daemon.Start());
  daemon.Run();
  return Status::Ok();
}

}  // namespace memoffload::daemon
