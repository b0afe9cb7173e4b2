// RunDaemon wires arena, session table, metrics, broker and gRPC server
// together and owns their lifetimes. Signals:
//   SIGTERM  drain: refuse new attaches and reserves, wait until no group is
//            held (or lifecycle.drain_timeout passes), then stop; exit 0.
//   SIGINT   stop at once (a second SIGTERM too).
//   SIGHUP   reload access policy and quotas from the config file; an invalid
//            file is rejected with the reason and the old config stays.
// Stopping closes every session, stops gRPC, removes the socket and token
// files and releases the arena.
#ifndef MEMOFFLOAD_DAEMON_DAEMON_H_
#define MEMOFFLOAD_DAEMON_DAEMON_H_

#include "config/config.h"
#include "memoffload/common/status.h"

namespace memoffload::daemon {

// The version string reported by --version, GetStatus and build_info.
const char* DaemonVersion();

// Runs the daemon with a resolved config until it stops. argv is kept for
// SIGHUP reloads (flags keep their precedence over the file). Returns OK on a
// clean shutdown; an error (one clear message) otherwise.
Status RunDaemon(const DaemonConfig& config, int argc, const char* const* argv);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_DAEMON_H_
