#include "app/config_changes.h"

#include "base/log.h"

namespace memoffload::daemon {

bool IsLiveSetting(const std::string& key) {
  if (key == "access.tenant") return false;
  return key.rfind("access.", 0) == 0 || key.rfind("quotas.", 0) == 0 ||
         key.rfind("regions.", 0) == 0 || key.rfind("replication.", 0) == 0;
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

}  // namespace memoffload::daemon
