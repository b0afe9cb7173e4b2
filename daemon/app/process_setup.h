// The process-level steps of starting memoffloadd (app/daemon.cc): the
// socket group, the descriptor limit, the admin token, the instance id.
#ifndef MEMOFFLOAD_DAEMON_APP_PROCESS_SETUP_H_
#define MEMOFFLOAD_DAEMON_APP_PROCESS_SETUP_H_

#include <sys/resource.h>
#include <sys/types.h>

#include <cstdint>
#include <string>

#include "config/config.h"
#include "memoffload/common/status.h"

namespace memoffload::daemon {

// The admin token's file name in the runtime dir.
inline constexpr char kAdminTokenName[] = "admin.token";

// server.socket_group: the gid of the group named (or given by number);
// (gid_t)-1 when empty, INVALID_ARGUMENT when no such group exists.
Result<gid_t> ResolveGroup(const std::string& name);

// Raises the soft descriptor limit to the hard one, and warns when the
// connection limits of the two sockets could still exhaust it.
// Raises the soft RLIMIT_NOFILE to the hard one; returns the limit now.
rlimit RaiseSoftDescriptorLimit();
void RaiseDescriptorLimit(const DaemonConfig& config);

// Writes `token` (NewSessionToken's) to dir/kAdminTokenName, readable by the
// daemon's user only, replacing the file whole (a rename).
Status WriteAdminToken(const std::string& dir, const std::string& token);

// Random per start, never 0: tells clients and logs a restart from a reclaim.
uint64_t RandomInstanceId();

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_APP_PROCESS_SETUP_H_
