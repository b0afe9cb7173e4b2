// The table of memoffloadd's settings (internal to daemon/): for each, its
// TOML section and key, flag and environment names, how its value is parsed
// and printed. config.cc reads the sources through it.
#ifndef MEMOFFLOAD_DAEMON_SRC_CONFIG_SETTINGS_H_
#define MEMOFFLOAD_DAEMON_SRC_CONFIG_SETTINGS_H_

#include <algorithm>
#include <cctype>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"

namespace memoffload::daemon::config_internal {

enum class Kind { kString, kSize, kDuration, kInt, kBool, kIdList, kMode, kFraction };

const char* KindHelp(Kind kind);

struct Setting {
  const char* section;
  const char* key;
  Kind kind;
  const char* help;
  std::function<Status(DaemonConfig*, const std::string&)> apply;
  std::function<std::string(const DaemonConfig&)> format;

  std::string Name() const { return std::string(section) + "." + key; }
  std::string Flag() const {
    std::string f = key;
    std::replace(f.begin(), f.end(), '_', '-');
    if (std::string_view(section) == "arena" && f == "size") return "arena-size";
    // Checkpoint regions' keys repeat the quotas' names (job_max_bytes).
    if (std::string_view(section) == "regions") return "regions-" + f;
    if (std::string_view(section) == "metrics") return "metrics-" + f;
    if (std::string_view(section) == "replication") return "replication-" + f;
    return f;
  }
  std::string Env() const {
    std::string e = "MEMOFFLOAD_" + Flag();
    for (char& c : e) c = c == '-' ? '_' : static_cast<char>(std::toupper(c));
    return e;
  }
};

// Every setting, in documentation order.
const std::vector<Setting>& Settings();
// The setting whose flag is --`flag`, or nullptr.
const Setting* FindByFlag(const std::string& flag);

}  // namespace memoffload::daemon::config_internal

#endif  // MEMOFFLOAD_DAEMON_SRC_CONFIG_SETTINGS_H_
