// What a SIGTERM does with the sessions (docs/restarts.md, "Sessions
// resume"): under systemd a restart keeps them for the next start and a stop
// drains them, told apart by the job systemd runs on the daemon's unit,
// asked over the system bus (read-only properties any uid may read).
#ifndef MEMOFFLOAD_DAEMON_SYSTEMD_JOB_H_
#define MEMOFFLOAD_DAEMON_SYSTEMD_JOB_H_

#include <string>

#include "core/session_table.h"
#include "memoffload/common/status.h"

namespace memoffload::daemon {

// The type of the job systemd runs on this process's unit ("restart",
// "stop", ...), or "" when it runs none (a SIGTERM sent by hand).
// UNAVAILABLE when the bus or systemd cannot be asked.
Result<std::string> SystemdUnitJob();

// Whether a job of that type starts the unit again once stopped.
bool IsRestartJob(const std::string& type);

// Whether a SIGTERM keeps the table's sessions for the next start
// (lifecycle.keep_sessions `mode`: restart, always, never), else they are
// drained as without a store; logs why not when there were some. Kept: with
// a store, not drained on purpose (memoffloadctl drain), under systemd (with
// "restart") only when systemd restarts the unit, and only when every
// session has a known pid (one outside a containerized daemon's pid
// namespace could never resume).
bool SigtermKeepsSessions(const std::string& mode, bool has_store, bool under_systemd,
                          const SessionTable& table);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SYSTEMD_JOB_H_
