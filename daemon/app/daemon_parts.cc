#include "app/daemon_parts.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <unistd.h>

#include <cstdlib>

#include "app/config_changes.h"
#include "base/log.h"
#include "edge/h2_guard.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

// Threads of gRPC's synchronous pool (only reflection's: every other method is a callback).
constexpr int kMaxSyncThreads = 64;
// Calls one gRPC connection may have open at once (a rank may have a
// thousand waiting Reserves; a stalled call costs memory, not a thread).
constexpr int kMaxStreamsPerConnection = 4096;

}  // namespace

std::unique_ptr<grpc::Server> BuildGrpcServer(grpc::Service* service) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // No listening port: GrpcListener accepts and hands each admitted
  // connection to the server.
  builder.RegisterService(service);
  // A call whose reply the peer never takes (its HTTP/2 window at 0) is
  // held until the peer goes. Our service's methods and health are
  // callbacks (no thread per call); on the synchronous pool, now only
  // reflection's, each such call holds a thread: bound the pool (past it
  // a call is refused, RESOURCE_EXHAUSTED) and the calls one connection
  // may have open at once.
  grpc::ResourceQuota sync_threads("memoffloadd-sync");
  sync_threads.SetMaxThreads(kMaxSyncThreads);
  builder.SetResourceQuota(sync_threads);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  // What gRPC advertises is what the edge relay's guard enforces.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE,
                             static_cast<int>(H2Limits{}.max_frame_bytes));
  return builder.BuildAndStart();
}

Status LoadLinkKeys(const DaemonConfig& config, LinkKeys* keys) {
  std::string path = config.replication_key_file;
  const auto source = config.sources.find("replication.key_file");
  const bool defaulted = source == config.sources.end() || source->second == "default";
  bool credential = false;
  std::string missing;  // systemd gave credentials, but not this one
  if (path.empty() && defaulted) {
    if (const char* creds = std::getenv("CREDENTIALS_DIRECTORY"); creds != nullptr && *creds) {
      const std::string candidate = std::string(creds) + "/replication-key";
      credential = access(candidate.c_str(), F_OK) == 0;
      if (credential) {
        path = candidate;
      } else {
        missing = "; " + candidate + " does not exist";
      }
    }
  }
  keys->SetRequired(config.replication_require_key);
  MEMOFFLOAD_RETURN_IF_ERROR(keys->Load(path, credential));
  if (path.empty()) {
    MO_LOG_INFO("replication keys: none (replication.key_file)%s%s", missing.c_str(),
                config.replication_require_key
                    ? "; required: no checkpoint is replicated from or to this node"
                    : "; jobs on several nodes make a key of their own in their store");
  } else {
    MO_LOG_INFO("replication keys: %s from %s", keys->Ids().c_str(), path.c_str());
  }
  return Status::Ok();
}

std::string ReloadProblem(const DaemonConfig& fresh, uint64_t arena_capacity_bytes) {
  if (fresh.policy.node_reserve_bytes < arena_capacity_bytes) return "";
  // The file is validated against the arena size it names; the reserve must
  // fit the arena that is actually running.
  return "quotas.node_reserve_bytes " + FormatSize(fresh.policy.node_reserve_bytes) + " (" +
         std::to_string(fresh.policy.node_reserve_bytes) +
         " bytes) leaves nothing of the running " + FormatSize(arena_capacity_bytes) + " (" +
         std::to_string(arena_capacity_bytes) +
         " bytes) arena; it must be smaller than the running arena (arena.size changes take "
         "effect at restart)";
}

void ApplyLiveSettings(const DaemonConfig& fresh, DaemonConfig* config) {
  const int64_t socket_gid = config->policy.socket_gid;  // fixed at start
  config->policy = fresh.policy;
  config->policy.socket_gid = socket_gid;
  // Sources of the applied settings only: the others keep the value (and
  // so the source) they started with.
  for (const auto& [key, source] : fresh.sources) {
    if (IsLiveSetting(key)) config->sources[key] = source;
  }
  config->replication_key_file = fresh.replication_key_file;
  config->replication_require_key = fresh.replication_require_key;
}

}  // namespace memoffload::daemon
