// What a SIGHUP reload changes (app/daemon.cc's Reload).
#ifndef MEMOFFLOAD_DAEMON_APP_CONFIG_CHANGES_H_
#define MEMOFFLOAD_DAEMON_APP_CONFIG_CHANGES_H_

#include <string>

#include "config/config.h"

namespace memoffload::daemon {

// Settings a SIGHUP applies to the running daemon, the fields of Policy: the
// access policy, the quotas and the region limits (access.tenant is fixed at
// start: chunks already belong to tenants).
bool IsLiveSetting(const std::string& key);

// Logs each setting whose value differs, and whether it takes effect only at
// restart.
void LogConfigChanges(const DaemonConfig& before, const DaemonConfig& after);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_APP_CONFIG_CHANGES_H_
