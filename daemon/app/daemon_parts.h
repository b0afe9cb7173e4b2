// Parts of the daemon built from its configuration (app/daemon.cc wires
// them): the gRPC server, the replication keys, what a SIGHUP applies.
#ifndef MEMOFFLOAD_DAEMON_DAEMON_PARTS_H_
#define MEMOFFLOAD_DAEMON_DAEMON_PARTS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "config/config.h"
#include "core/link_keys.h"
#include "memoffload/common/status.h"

namespace memoffload::daemon {

// The gRPC server for `service`, with no listening port (GrpcListener hands
// it each admitted connection) and its limits; null when it cannot start.
std::unique_ptr<grpc::Server> BuildGrpcServer(grpc::Service* service);

// Loads the replication key file (replication.key_file, else systemd's
// credential `replication-key`) into *keys and logs which; an error keeps
// the keys it had.
Status LoadLinkKeys(const DaemonConfig& config, LinkKeys* keys);

// Why a reloaded configuration cannot apply to the running arena ("" when
// it can): its node reserve must leave some of it.
std::string ReloadProblem(const DaemonConfig& fresh, uint64_t arena_capacity_bytes);
// Applies the live settings of `fresh` (IsLiveSetting: the policy, their
// sources, the replication key settings) to *config.
void ApplyLiveSettings(const DaemonConfig& fresh, DaemonConfig* config);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_DAEMON_PARTS_H_
