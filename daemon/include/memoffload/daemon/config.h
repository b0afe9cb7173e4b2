// DaemonConfig: every setting of memoffloadd, with its default.
//
// Sources, lowest precedence first: embedded defaults, then command-line
// flags. ParseFlags never exits; it returns the config or a one-line error
// naming the flag and what it accepts.
#ifndef MEMOFFLOAD_DAEMON_CONFIG_H_
#define MEMOFFLOAD_DAEMON_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/shared_mem/status.h"

namespace memoffload::daemon {

inline constexpr const char kDefaultMetricsAddress[] = "127.0.0.1:9477";

struct DaemonConfig {
  std::string runtime_dir;                               // resolved: never empty after parsing
  uint64_t arena_size_bytes = 0;                         // resolved: min(1 GiB, 25% of RAM)
  uint64_t chunk_size_bytes = 0;                         // resolved: min(1 GiB, arena size)
  std::string metrics_address = kDefaultMetricsAddress;  // "" disables
  int prefault_threads = 0;                              // 0: one per online core
  bool hugepages = false;
  bool mlock = true;
  uint64_t session_max_bytes = 0;  // 0: no per-session limit
  std::string log_level = "info";

  // Action flags (the daemon prints and exits).
  bool show_help = false;
  bool show_version = false;
};

// Parses argv (argv[0] is skipped). Accepts --name=value and --name value.
Result<DaemonConfig> ParseFlags(int argc, const char* const* argv);

// Resolves defaults that depend on the machine (RAM, cores, uid) and checks
// cross-field consistency (chunk size a page multiple, chunk <= arena, ...).
Status ResolveAndValidate(DaemonConfig* config);

// The help text listing every flag with its default.
std::string FlagsHelp();

// Total physical memory of this machine in bytes.
uint64_t PhysicalMemoryBytes();

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_CONFIG_H_
