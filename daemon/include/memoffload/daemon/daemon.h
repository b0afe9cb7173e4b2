// Daemon: wires arena, session table, metrics, broker and gRPC server
// together and owns their lifetimes. Run() blocks until SIGINT or SIGTERM,
// then shuts down cleanly: stops accepting, closes sessions, stops gRPC,
// removes its socket files and releases the arena.
#ifndef MEMOFFLOAD_DAEMON_DAEMON_H_
#define MEMOFFLOAD_DAEMON_DAEMON_H_

#include "memoffload/daemon/config.h"
#include "memoffload/shared_mem/status.h"

namespace memoffload::daemon {

// The version string reported by --version, GetStatus and build_info.
const char* DaemonVersion();

// Runs the daemon with a resolved config until a termination signal.
// Returns OK on a clean shutdown; an error (one clear message) otherwise.
Status RunDaemon(const DaemonConfig& config);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_DAEMON_H_
