#include "memoffload/daemon/daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <cerrno>
#include <cstring>

#include "memoffload/daemon/arena.h"
#include "memoffload/daemon/broker.h"
#include "memoffload/daemon/log.h"
#include "memoffload/daemon/metrics.h"
#include "memoffload/daemon/service.h"
#include "memoffload/daemon/session_table.h"
#include "memoffload/shared_mem/runtime_dir.h"
#include "memoffload/shared_mem/units.h"

#ifndef MEMOFFLOAD_VERSION
#define MEMOFFLOAD_VERSION "0.0.0-dev"
#endif

namespace memoffload::daemon {
namespace {

// True when something accepts connections on the Unix socket at `path`.
bool SocketIsLive(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool live = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return live;
}

// Creates the runtime dir if its parent exists, and refuses to start when
// another daemon serves it.
Status PrepareRuntimeDir(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return ErrnoStatus("runtime dir " + dir, errno);
    if (mkdir(dir.c_str(), 0755) != 0) {
      return FailedPrecondition("cannot create runtime dir " + dir + ": " + std::strerror(errno));
    }
  } else if (!S_ISDIR(st.st_mode)) {
    return FailedPrecondition("runtime dir " + dir + " exists but is not a directory");
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    return FailedPrecondition("runtime dir " + dir + " is not writable by uid " +
                              std::to_string(geteuid()));
  }
  const std::string broker = BrokerSocketPath(dir);
  if (SocketIsLive(broker)) {
    return FailedPrecondition("another memoffloadd is already serving " + dir +
                              " (its broker socket accepts connections)");
  }
  const size_t max_path = sizeof(sockaddr_un{}.sun_path) - 1;
  if (GrpcSocketPath(dir).size() > max_path) {
    return FailedPrecondition("runtime dir " + dir + " is too long for a Unix socket path (" +
                              std::to_string(max_path) + " bytes max)");
  }
  return Status::Ok();
}

}  // namespace

const char* DaemonVersion() { return MEMOFFLOAD_VERSION; }

Status RunDaemon(const DaemonConfig& config) {
  MEMOFFLOAD_RETURN_IF_ERROR(PrepareRuntimeDir(config.runtime_dir));

  ArenaOptions arena_options;
  arena_options.size_bytes = config.arena_size_bytes;
  arena_options.chunk_size_bytes = config.chunk_size_bytes;
  arena_options.prefault_threads = config.prefault_threads;
  arena_options.hugepages = config.hugepages;
  arena_options.mlock = config.mlock;
  MO_LOG_INFO("building arena: %s in %s chunks, pre-faulting with %d threads",
              FormatSize(config.arena_size_bytes).c_str(),
              FormatSize(config.chunk_size_bytes).c_str(), config.prefault_threads);
  ArenaBuildReport report;
  Result<std::unique_ptr<Arena>> arena_or = Arena::Build(arena_options, &report);
  if (!arena_or.ok()) return arena_or.status();
  std::unique_ptr<Arena> arena = std::move(arena_or).value();
  if (!report.mlocked && config.mlock)
    MO_LOG_WARN("mlock failed: %s", report.mlock_problem.c_str());
  MO_LOG_INFO("arena ready: %s, %u chunks of %s, pre-fault %.3f s (%.2f GB/s), mlock %s",
              FormatSize(arena->capacity_bytes()).c_str(), arena->chunk_count(),
              FormatSize(arena->chunk_size_bytes()).c_str(), report.build_seconds,
              arena->capacity_bytes() / 1e9 / std::max(report.build_seconds, 1e-9),
              report.mlocked ? "yes" : "no");

  SessionTableOptions table_options;
  table_options.session_max_bytes = config.session_max_bytes;
  SessionTable table(arena.get(), table_options);

  MetricsInfo metrics_info{DaemonVersion(), arena->chunk_count(), arena->chunk_size_bytes(),
                           arena->mlocked()};
  Metrics metrics(&table, metrics_info);
  std::string metrics_bound;
  if (!config.metrics_address.empty()) {
    Result<std::string> bound = metrics.Serve(config.metrics_address);
    if (!bound.ok()) return bound.status();
    metrics_bound = *bound;
  }

  const std::string grpc_path = GrpcSocketPath(config.runtime_dir);
  unlink(grpc_path.c_str());
  OffloadService service(arena.get(), &table, &metrics,
                         {DaemonVersion(), config.runtime_dir, metrics_bound});
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + grpc_path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return Unavailable("cannot start the gRPC server on " + grpc_path);
  }
  chmod(grpc_path.c_str(), 0660);

  boost::asio::io_context io;
  BrokerOptions broker_options;
  broker_options.socket_path = BrokerSocketPath(config.runtime_dir);
  broker_options.grpc_socket_path = grpc_path;
  Broker broker(io, arena.get(), &table, &metrics, broker_options);
  if (Status st = broker.Start(); !st.ok()) {
    server->Shutdown();
    unlink(grpc_path.c_str());
    return st;
  }

  MO_LOG_INFO("listening: runtime dir %s", config.runtime_dir.c_str());
  MO_LOG_INFO("  broker  %s", broker_options.socket_path.c_str());
  MO_LOG_INFO("  gRPC    unix:%s", grpc_path.c_str());
  MO_LOG_INFO("  metrics %s", metrics_bound.empty()
                                  ? "disabled"
                                  : ("http://" + metrics_bound + "/metrics").c_str());
  MO_LOG_INFO("clients: export MEMOFFLOAD_RUNTIME_DIR=%s", config.runtime_dir.c_str());

  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](const boost::system::error_code& ec, int signo) {
    if (ec) return;
    MO_LOG_INFO("received %s: shutting down", strsignal(signo));
    broker.StopAccepting();
    broker.CloseAll();
    io.stop();
  });
  io.run();

  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server->Wait();
  unlink(grpc_path.c_str());
  unlink(broker_options.socket_path.c_str());
  MO_LOG_INFO("stopped cleanly");
  return Status::Ok();
}

}  // namespace memoffload::daemon
