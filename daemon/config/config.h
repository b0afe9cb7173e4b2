// DaemonConfig: every setting of memoffloadd, where it came from, and how it
// is parsed from each source.
//
// Precedence, lowest first: embedded defaults < config file (TOML, --config or
// MEMOFFLOAD_CONFIG) < MEMOFFLOAD_* environment variables < command-line
// flags. Every setting has one name in each source: TOML `[section] key`,
// environment MEMOFFLOAD_<KEY>, flag --<key-with-dashes>. Unknown keys, flags
// and bad values are errors that name the key and what it accepts. Nothing
// here exits or throws.
#ifndef MEMOFFLOAD_DAEMON_CONFIG_H_
#define MEMOFFLOAD_DAEMON_CONFIG_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload::daemon {

inline constexpr const char kDefaultMetricsAddress[] = "127.0.0.1:9477";

// Upper bound of quotas.max_wait (1 hour).
inline constexpr uint64_t kMaxWaitLimitMs = 3600 * 1000;

// Bounds of lifecycle.hello_timeout and lifecycle.drain_timeout: past them
// the deadlines overflow (and a hello timeout of 0 drops every attach).
inline constexpr uint64_t kMinHelloTimeoutMs = 100;
inline constexpr uint64_t kMaxHelloTimeoutMs = 3600 * 1000;
inline constexpr uint64_t kMaxDrainTimeoutMs = 24 * 3600 * 1000;
// Upper bound of regions.ttl (30 days).
inline constexpr uint64_t kMaxRegionTtlMs = 30ull * 24 * 3600 * 1000;
// Upper bound of server.max_connections.
inline constexpr uint64_t kMaxConnectionsLimit = 1 << 20;
// Upper bound of quotas.max_extents_per_reserve: a reply of at most about
// 2.2 MiB (22 bytes per extent), under gRPC's 4 MiB default receive limit.
inline constexpr uint64_t kMaxExtentsPerReserveLimit = 100000;

// Settings SIGHUP may change without a restart (access policy, quotas and
// region limits; app/config_changes.h's IsLiveSetting names their sections).
struct Policy {
  std::vector<uint32_t> allowed_uids;  // besides the daemon's uid and root
  std::vector<uint32_t> allowed_gids;  // peers in these groups are allowed too
  uint64_t session_max_bytes = 0;      // 0: no per-session limit
  uint64_t job_max_bytes = 0;          // 0: no per-job limit
  // What a job's state-kind sessions (place_state) may hold together: this
  // fraction, in (0, 1], of the job's limit (the usable arena when it has
  // none). The job's other kinds keep the rest.
  double state_share = 0.5;
  uint64_t uid_max_bytes = 0;       // all sessions of one uid; 0: no limit
  uint64_t uid_max_chunks = 0;      // chunks one uid's tenants own (tenant uid/job); 0: no limit
  uint64_t node_reserve_bytes = 0;  // never handed out
  uint64_t max_wait_ms = 30000;     // cap for waiting reserves without deadline
  uint64_t max_waiting_reserves = 1024;            // queued at once, all tenants
  uint64_t max_waiting_reserves_per_tenant = 256;  // queued at once, one tenant
  uint64_t reserve_aging_ms = 2000;                // then a waiter's bytes are kept free for it
  uint64_t max_extents_per_reserve = 16384;        // a reply of about 400 KiB
  uint64_t max_groups_per_session = 16384;         // about 490 B of daemon memory each
  // [regions]: checkpoint regions, under their own limits (apart from the
  // sessions' quotas above; docs/checkpoints.md has the policy between them).
  uint64_t region_max_bytes = 0;      // node cap; resolved: half the arena (set 0: disabled)
  uint64_t region_job_max_bytes = 0;  // one job's regions; 0: only the node cap
  // One uid's regions, all its jobs; resolved: half of region_max_bytes
  // (set 0: only the node cap).
  uint64_t region_uid_max_bytes = 0;
  uint64_t region_ttl_ms = 24 * 3600 * 1000;  // commit to deletion, at most
  uint64_t max_regions_per_job = 1024;
  uint64_t max_regions_per_uid = 0;  // all its jobs; resolved: max_regions / 8 (set 0: none)
  uint64_t max_regions = 65536;      // all jobs: bounds the daemon's bookkeeping (~0.5 KiB each)
  // The sockets' group (server.socket_group, else the daemon's gid): its
  // members may attach, by primary or supplementary gid, as the 0660 sockets
  // already let them connect. Set by the daemon at start, not from the file.
  int64_t socket_gid = -1;
};

struct DaemonConfig {
  // [server]
  std::string runtime_dir;                               // resolved: never empty after Resolve
  std::string metrics_address = kDefaultMetricsAddress;  // "" disables
  std::string health_address;                            // "" (default): no HTTP health listener
  std::string log_level = "info";
  uint32_t socket_mode = 0660;
  std::string socket_group;  // "" keeps the daemon's group
  // Open connections on each of the broker and gRPC sockets, in total and
  // per peer uid; past them a new connection is closed at accept.
  uint64_t max_connections = 1024;
  uint64_t max_connections_per_uid = 256;
  // [metrics]: the job id label of the per-rank series: plain, hash or none
  // (JobLabels, metrics.h). /metrics is not behind the access list.
  std::string metrics_job_labels = "plain";
  // [arena]
  uint64_t arena_size_bytes = 0;  // resolved: min(1 GiB, 25% of RAM)
  uint64_t chunk_size_bytes = 0;  // resolved: min(1 GiB, arena size)
  int prefault_threads = 0;       // resolved: one per online core
  bool hugepages = false;
  bool mlock = true;
  int numa_node = -1;  // bind the arena's memory to this node; -1: no binding
  // [access] and [quotas]
  std::string tenant = "uid";  // uid, job or none; see TenantMode
  Policy policy;

  // [replication]: keys of the link between nodes (core/link_keys.h).
  std::string replication_key_file;  // "": none (or $CREDENTIALS_DIRECTORY/replication-key)
  bool replication_require_key = false;

  // [lifecycle]
  uint64_t drain_timeout_ms = 30000;
  uint64_t hello_timeout_ms = 10000;
  // Where the arena and the regions outlive a restart (app/state_store.h):
  // auto, systemd, keeper or none.
  std::string state_store = "auto";
  // At SIGTERM with a state store: "restart" keeps the sessions for the next
  // start unless systemd is stopping the unit for good; "always"; "never"
  // (drain and end them, as without a store).
  std::string keep_sessions = "restart";
  // The keeper's socket (app/fd_store.h): "" is <runtime dir>/keeper.sock.
  // Pods that share a runtime dir give each keeper a path of its own.
  std::string keeper_socket;
  // How a start meets a daemon already serving the runtime dir: "never"
  // (refuse: one daemon per dir), "always" (--take-over: take the node from
  // it, app/takeover.h; with none serving the start fails) or "auto" (take
  // it over when one serves, else start as usual: a DaemonSet's surge pod).
  std::string take_over = "never";
  // After handing the node on: "exit" (0) or "wait" until a signal, serving
  // /livez (200) and /readyz (503) meanwhile: in a pod, a container that
  // exits is started again, and would take the node back.
  std::string after_handover = "exit";

  std::string config_file;  // "" when none
  // Where each key's value came from: "default", "file", "env" or "flag".
  std::map<std::string, std::string> sources;

  // Actions (print and exit).
  bool show_help = false;
  bool show_version = false;
  bool print_config = false;
};

// Builds the config from all sources. `env` is the process environment
// (environ-style "KEY=VALUE" strings; tests pass their own).
Result<DaemonConfig> LoadConfig(int argc, const char* const* argv,
                                const std::vector<std::string>& env);

// Re-reads `path` on top of defaults, env and the original flags, for SIGHUP.
// Only Policy changes take effect; the caller compares the rest and warns.
Result<DaemonConfig> ReloadConfig(const DaemonConfig& current, int argc, const char* const* argv,
                                  const std::vector<std::string>& env);

// Resolves machine-dependent defaults (RAM, cores, uid) and checks
// cross-field consistency.
Status ResolveAndValidate(DaemonConfig* config);

// The effective configuration as an annotated TOML document.
std::string FormatConfig(const DaemonConfig& config);
// (key, value, source) for every setting, in documentation order.
struct ConfigEntry {
  std::string key;  // "section.key"
  std::string value;
  std::string source;
};
std::vector<ConfigEntry> ConfigEntries(const DaemonConfig& config);

// The help text listing every flag with its default.
std::string FlagsHelp();

// Total physical memory of this machine in bytes.
uint64_t PhysicalMemoryBytes();

// The process environment as a vector of "KEY=VALUE".
std::vector<std::string> ProcessEnvironment();

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_CONFIG_H_
