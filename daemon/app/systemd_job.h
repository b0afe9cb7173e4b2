// What systemd is doing to this daemon's unit when a SIGTERM comes: a
// restart keeps the sessions for the next start, a stop drains them
// (docs/restarts.md, "Sessions resume"). Asked over the system bus
// (read-only properties any uid may read).
#ifndef MEMOFFLOAD_DAEMON_SYSTEMD_JOB_H_
#define MEMOFFLOAD_DAEMON_SYSTEMD_JOB_H_

#include <string>

#include "memoffload/common/status.h"

namespace memoffload::daemon {

// The type of the job systemd runs on this process's unit ("restart",
// "stop", ...), or "" when it runs none (a SIGTERM sent by hand).
// UNAVAILABLE when the bus or systemd cannot be asked.
Result<std::string> SystemdUnitJob();

// Whether a job of that type starts the unit again once stopped.
bool IsRestartJob(const std::string& type);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SYSTEMD_JOB_H_
