#include "memoffload/daemon/daemon.h"

#include <fcntl.h>
#include <grp.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <prometheus/exposer.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <cstring>
#include <random>

#include "memoffload/daemon/arena.h"
#include "memoffload/daemon/broker.h"
#include "memoffload/daemon/grpc_listener.h"
#include "memoffload/daemon/health.h"
#include "memoffload/daemon/log.h"
#include "memoffload/daemon/metrics.h"
#include "memoffload/daemon/notifier.h"
#include "memoffload/daemon/runtime_dir_claim.h"
#include "memoffload/daemon/service.h"
#include "memoffload/daemon/session_table.h"
#include "memoffload/shared_mem/runtime_dir.h"
#include "memoffload/shared_mem/units.h"

#ifndef MEMOFFLOAD_VERSION
#define MEMOFFLOAD_VERSION "0.0.0-dev"
#endif

namespace memoffload::daemon {
namespace {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

constexpr char kAdminTokenName[] = "admin.token";

Result<gid_t> ResolveGroup(const std::string& name) {
  if (name.empty()) return static_cast<gid_t>(-1);
  std::vector<char> buf(16384);
  group gr{};
  group* found = nullptr;
  if (getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    char* end = nullptr;
    unsigned long gid = std::strtoul(name.c_str(), &end, 10);
    if (*end == '\0' && !name.empty()) return static_cast<gid_t>(gid);
    return InvalidArgument("server.socket_group: no group named '" + name + "'");
  }
  return found->gr_gid;
}

// Raises the soft descriptor limit to the hard one, and warns when the
// connection limits of the two sockets could still exhaust it.
void RaiseDescriptorLimit(const DaemonConfig& config) {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) getrlimit(RLIMIT_NOFILE, &lim);
  }
  const uint64_t needed = 2 * config.max_connections + 256;
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < needed) {
    MO_LOG_WARN(
        "the descriptor limit (%llu) is below what server.max_connections = %llu on two sockets "
        "needs (about %llu): a connection flood can exhaust descriptors (the daemon then backs "
        "off and recovers, and /readyz says 503); raise LimitNOFILE or lower max_connections",
        static_cast<unsigned long long>(lim.rlim_cur),
        static_cast<unsigned long long>(config.max_connections),
        static_cast<unsigned long long>(needed));
  }
}

// Writes a fresh random admin token, readable by the daemon's user only.
Result<std::string> WriteAdminToken(const std::string& dir) {
  Result<std::string> token = NewSessionToken();
  if (!token.ok()) return token.status();
  const std::string path = dir + "/" + kAdminTokenName;
  unlink(path.c_str());
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus("creating " + path, errno);
  const bool ok = write(fd, token->data(), token->size()) == static_cast<ssize_t>(token->size());
  close(fd);
  if (!ok) return Internal("writing " + path + " failed");
  return token;
}

// Settings a SIGHUP applies to the running daemon: the access policy and the
// quotas (access.tenant is fixed at start: chunks already belong to tenants).
bool IsLiveSetting(const std::string& key) {
  if (key == "access.tenant") return false;
  return key.rfind("access.", 0) == 0 || key.rfind("quotas.", 0) == 0;
}

void LogConfigChanges(const DaemonConfig& before, const DaemonConfig& after) {
  const auto old_entries = ConfigEntries(before);
  const auto new_entries = ConfigEntries(after);
  for (size_t i = 0; i < old_entries.size() && i < new_entries.size(); ++i) {
    if (old_entries[i].value == new_entries[i].value) continue;
    const std::string& key = new_entries[i].key;
    const bool live = IsLiveSetting(key);
    MO_LOG_INFO("config %s: %s -> %s%s", key.c_str(), old_entries[i].value.c_str(),
                new_entries[i].value.c_str(), live ? "" : " (takes effect at restart)");
  }
}

}  // namespace

const char* DaemonVersion() { return MEMOFFLOAD_VERSION; }

namespace {
// Random per start, never 0: tells clients and logs a restart from a reclaim.
uint64_t RandomInstanceId() {
  std::random_device rd;
  uint64_t id = 0;
  while (id == 0) id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return id;
}
}  // namespace

Status RunDaemon(const DaemonConfig& initial_config, int argc, const char* const* argv) {
  DaemonConfig config = initial_config;
  Result<std::unique_ptr<RuntimeDirClaim>> claim_or = RuntimeDirClaim::Claim(config.runtime_dir);
  if (!claim_or.ok()) return claim_or.status();
  // Declared first, destroyed last: whatever happens below, the files this
  // instance created (and only those) go when RunDaemon returns.
  std::unique_ptr<RuntimeDirClaim> claim = std::move(claim_or).value();
  Result<gid_t> socket_gid = ResolveGroup(config.socket_group);
  if (!socket_gid.ok()) return socket_gid.status();
  if (!config.config_file.empty()) MO_LOG_INFO("config file %s", config.config_file.c_str());
  RaiseDescriptorLimit(config);

  // Every listener is bound before the arena is built: a busy port or a bad
  // address is found in milliseconds, not after pre-faulting the arena.
  const std::string grpc_path = GrpcSocketPath(config.runtime_dir);
  const std::string broker_path = BrokerSocketPath(config.runtime_dir);
  Result<int> grpc_fd = claim->ListenUnix(grpc_path, config.socket_mode, *socket_gid);
  if (!grpc_fd.ok()) return grpc_fd.status();
  Result<int> broker_fd = claim->ListenUnix(broker_path, config.socket_mode, *socket_gid);
  if (!broker_fd.ok()) {
    close(*grpc_fd);
    return broker_fd.status();
  }
  asio::io_context io;
  // Installed before the arena is built: the sockets accept (into their
  // backlog) from now on, and a SIGTERM or SIGINT that arrives during the
  // pre-fault is handled once the event loop runs, as a clean stop.
  asio::signal_set signals(io, SIGINT, SIGTERM, SIGHUP);
  // Listening fds move into their owners right away, so early returns close them.
  GrpcListener grpc_listener(io, config.policy, config.max_connections,
                             config.max_connections_per_uid);
  asio::local::stream_protocol::acceptor broker_acceptor(io);
  {
    boost::system::error_code ec;
    broker_acceptor.assign(asio::local::stream_protocol(), *broker_fd, ec);
    if (ec) close(*broker_fd);
    Status adopted = grpc_listener.Adopt(*grpc_fd);
    if (ec) return Internal("cannot watch the broker socket: " + ec.message());
    MEMOFFLOAD_RETURN_IF_ERROR(adopted);
  }

  SessionTable* table_for_probes = nullptr;
  HealthServer health(io, [&table_for_probes, &grpc_listener] {
    HealthState state;
    state.draining = table_for_probes != nullptr && table_for_probes->draining();
    state.not_ready = grpc_listener.Problem();
    return state;
  });
  std::string health_bound;
  if (!config.health_address.empty()) {
    Result<std::string> bound = health.Start(config.health_address);
    if (!bound.ok()) return bound.status();
    health_bound = *bound;
  }
  std::unique_ptr<prometheus::Exposer> exposer;
  std::string metrics_bound;
  if (!config.metrics_address.empty()) {
    Result<std::unique_ptr<prometheus::Exposer>> listening =
        Metrics::Listen(config.metrics_address, &metrics_bound);
    if (!listening.ok()) return listening.status();
    exposer = std::move(listening).value();
  }

  Result<std::string> admin_token = WriteAdminToken(config.runtime_dir);
  if (!admin_token.ok()) return admin_token.status();
  claim->Own(config.runtime_dir + "/" + kAdminTokenName);

  ArenaOptions arena_options;
  arena_options.size_bytes = config.arena_size_bytes;
  arena_options.chunk_size_bytes = config.chunk_size_bytes;
  arena_options.prefault_threads = config.prefault_threads;
  arena_options.hugepages = config.hugepages;
  arena_options.mlock = config.mlock;
  arena_options.numa_node = config.numa_node;
  MO_LOG_INFO("building arena: %s in %s chunks, pre-faulting with %d threads",
              FormatSize(config.arena_size_bytes).c_str(),
              FormatSize(config.chunk_size_bytes).c_str(), config.prefault_threads);
  ArenaBuildReport report;
  Result<std::unique_ptr<Arena>> arena_or = Arena::Build(arena_options, &report);
  if (!arena_or.ok()) return arena_or.status();
  std::unique_ptr<Arena> arena = std::move(arena_or).value();
  if (!report.mlocked && config.mlock) {
    MO_LOG_WARN("mlock failed: %s", report.mlock_problem.c_str());
  }
  MO_LOG_INFO("arena ready: %s, %u chunks of %s, pre-fault %.3f s (%.2f GB/s), mlock %s",
              FormatSize(arena->capacity_bytes()).c_str(), arena->chunk_count(),
              FormatSize(arena->chunk_size_bytes()).c_str(), report.build_seconds,
              arena->capacity_bytes() / 1e9 / std::max(report.build_seconds, 1e-9),
              report.mlocked ? "yes" : "no");

  Result<TenantMode> tenant_mode = ParseTenantMode(config.tenant);
  if (!tenant_mode.ok()) return tenant_mode.status();
  FreshBackingOptions fresh_options;
  fresh_options.chunk_size_bytes = arena->chunk_size_bytes();
  fresh_options.spares = *tenant_mode == TenantMode::kNone ? 0 : 1;
  fresh_options.hugepages = config.hugepages && report.hugepage_chunks > 0;
  fresh_options.mlock = arena->mlocked();
  fresh_options.numa_node = config.numa_node;
  FreshBacking fresh_backing(fresh_options);
  SessionTable table(arena.get(), config.policy, *tenant_mode, &fresh_backing);
  table_for_probes = &table;
  const uint64_t instance_id = RandomInstanceId();
  MO_LOG_INFO("instance id %016lx", static_cast<unsigned long>(instance_id));

  MetricsInfo metrics_info{DaemonVersion(), arena->chunk_count(), arena->chunk_size_bytes(),
                           arena->mlocked()};
  Metrics metrics(&table, metrics_info);
  if (exposer != nullptr) metrics.Serve(std::move(exposer));

  OffloadService service(
      arena.get(), &table, &metrics,
      {DaemonVersion(), config.runtime_dir, metrics_bound, *admin_token, instance_id}, config);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // No listening port: GrpcListener accepts and hands each admitted
  // connection to the server.
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return Unavailable("cannot start the gRPC server for " + grpc_path);
  grpc_listener.Start(server.get());

  BrokerOptions broker_options;
  broker_options.socket_path = broker_path;
  broker_options.grpc_socket_path = grpc_path;
  broker_options.socket_mode = config.socket_mode;
  broker_options.socket_gid = *socket_gid;
  broker_options.hello_timeout_ms = static_cast<int>(config.hello_timeout_ms);
  broker_options.instance_id = instance_id;
  broker_options.max_connections = config.max_connections;
  broker_options.max_connections_per_uid = config.max_connections_per_uid;
  Broker broker(io, arena.get(), &table, &metrics, broker_options, config.policy);
  if (Status st = broker.Start(broker_acceptor.release()); !st.ok()) {
    grpc_listener.Stop();
    server->Shutdown();
    return st;
  }

  MO_LOG_INFO("listening: runtime dir %s", config.runtime_dir.c_str());
  MO_LOG_INFO("  broker  %s", broker_options.socket_path.c_str());
  MO_LOG_INFO("  gRPC    unix:%s", grpc_path.c_str());
  MO_LOG_INFO("  metrics %s", metrics_bound.empty()
                                  ? "disabled"
                                  : ("http://" + metrics_bound + "/metrics").c_str());
  MO_LOG_INFO("  health  %s", health_bound.empty()
                                  ? "disabled"
                                  : ("http://" + health_bound + "/readyz, /livez").c_str());
  MO_LOG_INFO("clients: export MEMOFFLOAD_RUNTIME_DIR=%s", config.runtime_dir.c_str());

  Notifier notifier;
  auto status_text = [&table] {
    const ArenaSnapshot s = table.Snapshot();
    return "arena " + FormatSize(s.capacity_bytes - s.free_bytes) + " of " +
           FormatSize(s.capacity_bytes) + " used, " + std::to_string(s.sessions) + " sessions" +
           (s.draining ? ", draining" : "");
  };
  // WATCHDOG=1 and a fresh STATUS= from the event loop, every half watchdog
  // timeout (every 10 s without one); it keeps going while draining.
  asio::steady_timer notify_timer(io);
  std::function<void()> arm_notify_timer = [&] {
    notify_timer.expires_after(notifier.WatchdogEnabled()
                                   ? notifier.WatchdogInterval()
                                   : std::chrono::microseconds(std::chrono::seconds(10)));
    notify_timer.async_wait([&](const boost::system::error_code& ec) {
      if (ec) return;
      notifier.WatchdogPing();
      notifier.Status(status_text());
      arm_notify_timer();
    });
  };

  auto stop = [&] {
    notify_timer.cancel();
    health.Stop();
    broker.StopAccepting();
    grpc_listener.Stop();
    broker.CloseAll();
    io.stop();
  };

  // Drain: wait until no group is held or the deadline passes.
  asio::steady_timer drain_timer(io);
  Clock::time_point drain_deadline;
  bool draining_for_exit = false;
  std::function<void()> check_drained = [&] {
    const ArenaSnapshot s = table.Snapshot();
    const bool empty = s.capacity_bytes == s.free_bytes;
    if (empty || Clock::now() >= drain_deadline) {
      if (!empty) {
        MO_LOG_WARN("drain deadline passed with %s still held by %u sessions; stopping",
                    FormatSize(s.capacity_bytes - s.free_bytes).c_str(), s.sessions);
      } else {
        MO_LOG_INFO("drained: no groups held");
      }
      stop();
      return;
    }
    drain_timer.expires_after(std::chrono::milliseconds(50));
    drain_timer.async_wait([&](const boost::system::error_code& ec) {
      if (!ec) check_drained();
    });
  };

  std::function<void(const boost::system::error_code&, int)> on_signal =
      [&](const boost::system::error_code& ec, int signo) {
        if (ec) return;
        if (signo == SIGHUP) {
          Result<DaemonConfig> fresh = ReloadConfig(config, argc, argv, ProcessEnvironment());
          if (!fresh.ok()) {
            MO_LOG_ERROR("config reload rejected, keeping the previous configuration: %s",
                         fresh.status().message().c_str());
          } else if (fresh->policy.node_reserve_bytes >= arena->capacity_bytes()) {
            // The file is validated against the arena size it names; the
            // reserve must fit the arena that is actually running.
            MO_LOG_ERROR(
                "config reload rejected, keeping the previous configuration: "
                "quotas.node_reserve_bytes %s (%llu bytes) leaves nothing of the running "
                "%s (%llu bytes) arena; it must be smaller than the running arena (arena.size "
                "changes take effect at restart)",
                FormatSize(fresh->policy.node_reserve_bytes).c_str(),
                static_cast<unsigned long long>(fresh->policy.node_reserve_bytes),
                FormatSize(arena->capacity_bytes()).c_str(),
                static_cast<unsigned long long>(arena->capacity_bytes()));
          } else {
            LogConfigChanges(config, *fresh);
            // Only access and quotas change live; the rest waits for a restart.
            config.policy = fresh->policy;
            // Sources of the applied settings only: the others keep the
            // value (and so the source) they started with.
            for (const auto& [key, source] : fresh->sources) {
              if (IsLiveSetting(key)) config.sources[key] = source;
            }
            table.SetPolicy(config.policy);
            broker.SetPolicy(config.policy);
            grpc_listener.SetPolicy(config.policy);
            service.SetConfig(config);
            MO_LOG_INFO("config reloaded from %s", config.config_file.c_str());
          }
        } else if (signo == SIGTERM && !draining_for_exit) {
          draining_for_exit = true;
          notifier.Stopping();
          const ArenaSnapshot s = table.Snapshot();
          MO_LOG_INFO("received SIGTERM: draining (%u sessions, %s held; deadline %lu ms)",
                      s.sessions, FormatSize(s.capacity_bytes - s.free_bytes).c_str(),
                      static_cast<unsigned long>(config.drain_timeout_ms));
          table.BeginShutdown();
          drain_deadline = Clock::now() + std::chrono::milliseconds(config.drain_timeout_ms);
          check_drained();
        } else {
          MO_LOG_INFO("received %s: stopping now", strsignal(signo));
          notifier.Stopping();
          stop();
          return;
        }
        signals.async_wait(on_signal);
      };
  signals.async_wait(on_signal);

  // systemd (Type=notify): the arena is built, every listener accepts and
  // the signal handlers are installed, so a SIGTERM from now on drains.
  notifier.Ready(status_text());
  if (notifier.Enabled()) arm_notify_timer();
  io.run();

  // Sessions are closed; cancel whatever RPC is still in flight.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  server->Wait();
  claim->RemoveOwned();
  MO_LOG_INFO("stopped cleanly");
  return Status::Ok();
}

}  // namespace memoffload::daemon
