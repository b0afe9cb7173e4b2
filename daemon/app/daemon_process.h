// The running daemon (app/daemon.h runs it): every part it wires together
// is a member, declared in the order it is made, so that whatever step
// fails, the parts made so far are undone by their own destructors (the
// runtime dir claim last: the files this instance created, and only those,
// go with it). Its member functions live in daemon.cc (start and serving),
// daemon_stop.cc (signals, drain, stop) and daemon_handover.cc (take-over,
// hand-over, standing by). Internal to app/.
#ifndef MEMOFFLOAD_DAEMON_DAEMON_PROCESS_H_
#define MEMOFFLOAD_DAEMON_DAEMON_PROCESS_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "app/notifier.h"
#include "app/runtime_dir_claim.h"
#include "app/state_recovery.h"
#include "app/takeover.h"
#include "app/takeover_host.h"
#include "config/config.h"
#include "core/link_keys.h"
#include "core/session_table.h"
#include "edge/broker.h"
#include "edge/grpc_listener.h"
#include "edge/service.h"
#include "memory/arena.h"
#include "observe/health.h"
#include "observe/metrics.h"
#include "observe/metrics_port.h"

namespace memoffload::daemon {

class Daemon {
 public:
  using Clock = std::chrono::steady_clock;
  // How often a taken metrics port is tried again (metrics_port.h).
  static constexpr int kMetricsRetryMs = 5000;

  Daemon(DaemonConfig config, int argc, const char* const* argv)
      : config_(std::move(config)),
        argc_(argc),
        argv_(argv),
        grpc_listener_(io_, config_.policy, config_.max_connections,
                       config_.max_connections_per_uid),
        health_(io_, [this] { return Probe(); }),
        metrics_port_(io_, config_.metrics_address, kMetricsRetryMs) {}
  ~Daemon() {
    StopMappingKept();
    StopServing();
    if (takeover_fd_ >= 0) close(takeover_fd_);
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Claims the runtime dir, binds every listener, builds the arena and starts
  // serving. One clear error otherwise.
  Status Start();

  // Runs the event loop until a signal stops it, then stops serving.
  void Run();

 private:
  // lifecycle.take_over: "always" (--take-over), or "auto" when a daemon
  // holds the runtime dir's instance lock.
  bool TakesOver() const;

  // A start whose store holds the hand-over mark: it answers its probes
  // (/readyz 503) and waits for a signal, touching nothing of the node.
  Status StandBy();

  bool WaitsAfterHandover() const { return handed_over_ && config_.after_handover == "wait"; }

  // lifecycle.after_handover = "wait": the process stays, doing nothing with
  // the node, until a signal (a pod's container that exited would be started
  // again, and take the node back); its health port says so meanwhile.
  void WaitForStop();

  void MarkHandedOver();

  // At exit: a snapshot of the regions for the next start (state_store.h).
  void KeepState();

  // Every listener is bound before the arena is built: a busy port or a bad
  // address is found in milliseconds, not after pre-faulting the arena.
  Status Listen();

  // The socket group, the policy and the paths: before any listener.
  Status PrepareListening();

  // Adopts the listening sockets (bound here, or handed on by a take-over),
  // then binds the rest: the take-over socket, health, metrics, the admin token.
  // With `lenient` (a take-over, after "ready": the node is this daemon's
  // whatever happens), what fails past the listeners is logged, not fatal.
  Status ListenOn(int grpc_fd, int broker_fd, bool lenient);

  Status BuildArena();

  // The table (with what the start took back), the metrics, the service and
  // the gRPC server: everything but the listeners.
  Status BuildService();

  // Starts accepting: the metrics port, the gRPC listener, the broker, the
  // take-over socket.
  Status StartServing();

  // --take-over, first part: the serving daemon's state (after its drain).
  Status RequestTakeover();

  // --take-over, second part: "ready", then the serving daemon's listeners.
  Status TakeListeners();
  // --take-over, last: the store keeps this daemon's state from now on.
  void KeepTakenState();

  void LogListening() const;

  HealthState Probe() const;

  std::string StatusText() const;

  // Deletes checkpoint regions past their TTL, once a second.
  void ArmRegionTimer();

  // Maps the chunks the start kept into this process on a thread of its own
  // (memory/kept_mapping.h), once serving; StopMappingKept ends it.
  void MapKeptChunks();
  void StopMappingKept();

  // WATCHDOG=1 and a fresh STATUS= from the event loop, every half watchdog
  // timeout (every 10 s without one); it keeps going while draining.
  void ArmNotifyTimer();

  void OnSignal(const boost::system::error_code& ec, int signo);

  // SIGHUP: access, quotas, region limits and replication keys change live;
  // the rest waits for a restart.
  void Reload();

  // SIGTERM with a state store keeps the sessions for the next start
  // (app/systemd_job.h says when).
  bool KeepsSessions() const;

  // Freezes the table (every call is answered "send it again"), takes its
  // sessions' records, tells each process to resume on the next daemon, and
  // stops once those notices are written (KeepState stores the records).
  void KeepSessions();

  void StopOnceNoticed();

  // SIGTERM: refuse new work, wait until no group is held or the deadline.
  void BeginDrain();

  void CheckDrained();

  // Stops accepting, closes every session and leaves the event loop.
  void StopLoop();

  // Nothing new reaches the gRPC server; what is still in flight is cancelled.
  void StopServing();

  DaemonConfig config_;
  const int argc_;
  const char* const* argv_;
  std::unique_ptr<RuntimeDirClaim> claim_;  // first made, last gone
  gid_t socket_gid_ = static_cast<gid_t>(-1);
  std::string grpc_path_, broker_path_;
  boost::asio::io_context io_;
  boost::asio::signal_set signals_{io_};
  GrpcListener grpc_listener_;
  boost::asio::local::stream_protocol::acceptor broker_acceptor_{io_};
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
  bool state_store_lost_ = false;            // KeepTakenState: it failed after a take-over
  std::unique_ptr<SessionTable> table_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<OffloadService> service_;
  std::unique_ptr<grpc::Server> server_;
  LinkKeys link_keys_;  // before broker_, which points at it
  std::unique_ptr<Broker> broker_;
  std::unique_ptr<LoopTakeoverHost> takeover_host_;
  std::unique_ptr<TakeoverServer> takeover_server_;  // its thread uses what is above
  Notifier notifier_;
  boost::asio::steady_timer notify_timer_{io_};
  boost::asio::steady_timer drain_timer_{io_};
  boost::asio::steady_timer region_timer_{io_};
  Clock::time_point drain_deadline_;
  bool draining_for_exit_ = false;
  // SIGTERM with a state store: the sessions the next start resumes.
  std::vector<SessionRecord> kept_sessions_;
  std::vector<ChunkOwnerRecord> kept_owners_;
  std::vector<std::weak_ptr<const Chunk>> kept_to_map_;
  std::thread kept_mapper_;
  std::atomic<bool> stop_mapping_{false};
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_DAEMON_PROCESS_H_
