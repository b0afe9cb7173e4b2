#include "config/config_settings.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "memoffload/common/units.h"

namespace memoffload::daemon::config_internal {

const char* KindHelp(Kind kind) {
  switch (kind) {
    case Kind::kString:
      return "STRING";
    case Kind::kSize:
      return "SIZE";
    case Kind::kDuration:
      return "DURATION";
    case Kind::kInt:
      return "N";
    case Kind::kBool:
      return "BOOL";
    case Kind::kIdList:
      return "ID,ID,...";
    case Kind::kMode:
      return "OCTAL";
    case Kind::kFraction:
      return "FRACTION";
  }
  return "";
}

namespace {

Status ParseBool(const std::string& v, bool* out) {
  std::string l = v;
  for (char& c : l) c = static_cast<char>(std::tolower(c));
  if (l == "true" || l == "1" || l == "yes" || l == "on")
    *out = true;
  else if (l == "false" || l == "0" || l == "no" || l == "off")
    *out = false;
  else
    return InvalidArgument("'" + v + "' is not a boolean (true/false)");
  return Status::Ok();
}

Status ParseIdList(const std::string& v, std::vector<uint32_t>* out) {
  out->clear();
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(std::remove_if(item.begin(), item.end(), ::isspace), item.end());
    if (item.empty()) continue;
    char* end = nullptr;
    unsigned long id = std::strtoul(item.c_str(), &end, 10);
    if (*end != '\0' || !std::isdigit(static_cast<unsigned char>(item[0])) || id > 0xfffffffeul) {
      return InvalidArgument("'" + item + "' is not a numeric uid/gid");
    }
    out->push_back(static_cast<uint32_t>(id));
  }
  return Status::Ok();
}

// "IPv4:PORT" or "[IPv6]:PORT" with a numeric IP (the health listener binds
// it directly, no name lookup) and a port in 0..65535 (0 picks a free one).
Status ValidateIpPort(const std::string& v) {
  const std::string expected = "'" + v + "' is not IP:PORT (e.g. 127.0.0.1:9478) or 'none'";
  const size_t colon = v.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == v.size() || v.size() - colon > 6 ||
      v.find_first_not_of("0123456789", colon + 1) != std::string::npos ||
      std::stoul(v.substr(colon + 1)) > 65535) {
    return InvalidArgument(expected);
  }
  std::string host = v.substr(0, colon);
  unsigned char addr[sizeof(in6_addr)];
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    if (inet_pton(AF_INET6, host.c_str(), addr) == 1) return Status::Ok();
  } else if (inet_pton(AF_INET, host.c_str(), addr) == 1) {
    return Status::Ok();
  }
  return InvalidArgument(expected);
}

std::string JoinIds(const std::vector<uint32_t>& ids) {
  std::string s;
  for (uint32_t id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

std::string Octal(uint32_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0%o", mode);
  return buf;
}

// Helpers that build the apply/format pair for a field of a given kind.
using U64Field = uint64_t* (*)(DaemonConfig*);

// A byte size (kSize) or a duration in milliseconds (kDuration).
Setting U64Setting(const char* section, const char* key, Kind kind, const char* help,
                   U64Field field) {
  const bool duration = kind == Kind::kDuration;
  return {section,
          key,
          kind,
          help,
          [field, duration](DaemonConfig* c, const std::string& v) {
            Result<uint64_t> r = duration ? ParseDurationMs(v) : ParseSize(v);
            if (!r.ok()) return r.status();
            *field(c) = *r;
            return Status::Ok();
          },
          [field, duration](const DaemonConfig& c) {
            return std::to_string(*field(const_cast<DaemonConfig*>(&c))) + (duration ? "ms" : "");
          }};
}

// A count in min..max: by default 1..max, a limit that must exist (0 is
// not "none"); min 0 where the help says what 0 means.
Setting CountSetting(const char* section, const char* key, const char* help, uint64_t max,
                     U64Field field, uint64_t min = 1) {
  return {section,
          key,
          Kind::kInt,
          help,
          [field, max, min](DaemonConfig* c, const std::string& v) {
            char* end = nullptr;
            errno = 0;
            const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
            if (v.empty() || v[0] == '-' || *end != '\0' || errno != 0 || n < min || n > max) {
              return InvalidArgument("'" + v + "' is not an integer in " + std::to_string(min) +
                                     ".." + std::to_string(max));
            }
            *field(c) = n;
            return Status::Ok();
          },
          [field](const DaemonConfig& c) {
            return std::to_string(*field(const_cast<DaemonConfig*>(&c)));
          }};
}

// A fraction in (0, 1] (e.g. 0.5), printed in its shortest exact form.
Setting FractionSetting(const char* section, const char* key, const char* help,
                        double* (*field)(DaemonConfig*)) {
  return {section,
          key,
          Kind::kFraction,
          help,
          [field](DaemonConfig* c, const std::string& v) {
            double x = 0;
            const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
            if (v.empty() || ec != std::errc() || end != v.data() + v.size() || !std::isfinite(x) ||
                x <= 0 || x > 1) {
              return InvalidArgument("'" + v + "' is not a fraction in (0, 1], e.g. 0.5");
            }
            *field(c) = x;
            return Status::Ok();
          },
          [field](const DaemonConfig& c) {
            char buf[32];
            const auto [end, ec] =
                std::to_chars(buf, buf + sizeof(buf), *field(const_cast<DaemonConfig*>(&c)));
            return ec == std::errc() ? std::string(buf, end) : std::string("?");
          }};
}

// A string that is one of `choices` ("a, b, c" in the error).
Setting ChoiceSetting(const char* section, const char* key, const char* help,
                      std::vector<std::string> choices, std::string DaemonConfig::*field) {
  return {section,
          key,
          Kind::kString,
          help,
          [choices, field](DaemonConfig* c, const std::string& v) {
            if (std::find(choices.begin(), choices.end(), v) == choices.end()) {
              std::string all;
              for (const std::string& choice : choices) all += (all.empty() ? "" : ", ") + choice;
              return InvalidArgument("'" + v + "' is not one of " + all);
            }
            c->*field = v;
            return Status::Ok();
          },
          [field](const DaemonConfig& c) { return c.*field; }};
}

Setting BoolSetting(const char* section, const char* key, const char* help,
                    bool DaemonConfig::*field) {
  return {section,
          key,
          Kind::kBool,
          help,
          [field](DaemonConfig* c, const std::string& v) { return ParseBool(v, &(c->*field)); },
          [field](const DaemonConfig& c) { return std::string(c.*field ? "true" : "false"); }};
}

}  // namespace

const std::vector<Setting>& Settings() {
  static const std::vector<Setting> settings = {
      {"server", "runtime_dir", Kind::kString,
       "directory of broker.sock and memoffload.sock (default /run/memoffload as root, else "
       "$XDG_RUNTIME_DIR/memoffload or /tmp/memoffload-$UID)",
       [](DaemonConfig* c, const std::string& v) {
         if (v.empty() || v[0] != '/')
           return InvalidArgument("'" + v + "' is not an absolute path");
         c->runtime_dir = v;
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return c.runtime_dir; }},
      {"server", "metrics_address", Kind::kString,
       "Prometheus listener HOST:PORT (default 127.0.0.1:9477; 'none' disables)",
       [](DaemonConfig* c, const std::string& v) {
         if (v == "none" || v.empty()) {
           c->metrics_address.clear();
           return Status::Ok();
         }
         const size_t colon = v.rfind(':');
         if (colon == std::string::npos || colon + 1 == v.size() ||
             v.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
           return InvalidArgument("'" + v + "' is not HOST:PORT or 'none'");
         }
         c->metrics_address = v;
         return Status::Ok();
       },
       [](const DaemonConfig& c) {
         return c.metrics_address.empty() ? std::string("none") : c.metrics_address;
       }},
      {"server", "health_address", Kind::kString,
       "HTTP health listener IP:PORT for probes (/livez, /readyz, /healthz), e.g. "
       "127.0.0.1:9478 or 0.0.0.0:9478 in a pod (default none: disabled)",
       [](DaemonConfig* c, const std::string& v) {
         if (v == "none" || v.empty()) {
           c->health_address.clear();
           return Status::Ok();
         }
         if (Status st = ValidateIpPort(v); !st.ok()) return st;
         c->health_address = v;
         return Status::Ok();
       },
       [](const DaemonConfig& c) {
         return c.health_address.empty() ? std::string("none") : c.health_address;
       }},
      {"server", "log_level", Kind::kString, "debug, info, warn or error (default info)",
       [](DaemonConfig* c, const std::string& v) {
         if (v != "debug" && v != "info" && v != "warn" && v != "error") {
           return InvalidArgument("'" + v + "' is not one of debug, info, warn, error");
         }
         c->log_level = v;
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return c.log_level; }},
      {"server", "socket_mode", Kind::kMode, "file mode of both sockets (default 0660)",
       [](DaemonConfig* c, const std::string& v) {
         char* end = nullptr;
         unsigned long m = std::strtoul(v.c_str(), &end, 8);
         if (v.empty() || *end != '\0' || m > 0777) {
           return InvalidArgument("'" + v + "' is not an octal file mode like 0660");
         }
         c->socket_mode = static_cast<uint32_t>(m);
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return Octal(c.socket_mode); }},
      {"server", "socket_group", Kind::kString,
       "group owning the sockets, so its members may attach (default: the daemon's group)",
       [](DaemonConfig* c, const std::string& v) {
         c->socket_group = v;
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return c.socket_group; }},
      CountSetting("server", "max_connections",
                   "open connections on each of the broker and gRPC sockets (default 1024)",
                   kMaxConnectionsLimit, [](DaemonConfig* c) { return &c->max_connections; }),
      CountSetting("server", "max_connections_per_uid",
                   "open connections of one peer uid on each socket (default 256)",
                   kMaxConnectionsLimit,
                   [](DaemonConfig* c) { return &c->max_connections_per_uid; }),
      {"metrics", "job_labels", Kind::kString,
       "the job_id label of the per-rank series on /metrics, which any local user can read: "
       "plain (default: the job id), hash (the first 12 hex digits of its SHA-256) or none "
       "(no per-rank series; the node totals stay)",
       [](DaemonConfig* c, const std::string& v) {
         if (v != "plain" && v != "hash" && v != "none") {
           return InvalidArgument("'" + v + "' is not one of plain, hash, none");
         }
         c->metrics_job_labels = v;
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return c.metrics_job_labels; }},
      U64Setting("arena", "size", Kind::kSize,
                 "arena size, e.g. 512MiB, 64GiB (default min(1GiB, 25% of RAM))",
                 [](DaemonConfig* c) { return &c->arena_size_bytes; }),
      U64Setting("arena", "chunk_size", Kind::kSize,
                 "size of one memfd chunk (default min(1GiB, arena))",
                 [](DaemonConfig* c) { return &c->chunk_size_bytes; }),
      {"arena", "prefault_threads", Kind::kInt, "threads pre-faulting the arena (0: one per core)",
       [](DaemonConfig* c, const std::string& v) {
         char* end = nullptr;
         long n = std::strtol(v.c_str(), &end, 10);
         if (v.empty() || *end != '\0' || n < 0 || n > 1024) {
           return InvalidArgument("'" + v + "' is not an integer in 0..1024");
         }
         c->prefault_threads = static_cast<int>(n);
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return std::to_string(c.prefault_threads); }},
      BoolSetting("arena", "hugepages", "back chunks with hugepages (MFD_HUGETLB)",
                  &DaemonConfig::hugepages),
      BoolSetting("arena", "mlock", "mlock the arena (default true; --no-mlock disables)",
                  &DaemonConfig::mlock),
      {"arena", "numa_node", Kind::kInt,
       "NUMA node the arena's memory is bound to (default -1: no binding)",
       [](DaemonConfig* c, const std::string& v) {
         char* end = nullptr;
         long n = std::strtol(v.c_str(), &end, 10);
         if (v.empty() || *end != '\0' || n < -1 || n > 65535) {
           return InvalidArgument("'" + v +
                                  "' is not a NUMA node number (0..65535, or -1 for none)");
         }
         c->numa_node = static_cast<int>(n);
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return std::to_string(c.numa_node); }},
      {"access", "allowed_uids", Kind::kIdList,
       "uids allowed to attach besides the daemon's own uid and root (always allowed)",
       [](DaemonConfig* c, const std::string& v) {
         return ParseIdList(v, &c->policy.allowed_uids);
       },
       [](const DaemonConfig& c) { return JoinIds(c.policy.allowed_uids); }},
      {"access", "tenant", Kind::kString,
       "who may share a chunk: uid (default), job, or none (every session maps every chunk)",
       [](DaemonConfig* c, const std::string& v) {
         if (v != "uid" && v != "job" && v != "none") {
           return InvalidArgument("'" + v + "' is not one of uid, job, none");
         }
         c->tenant = v;
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return c.tenant; }},
      {"access", "allowed_gids", Kind::kIdList, "peers in these groups may attach too",

       [](DaemonConfig* c, const std::string& v) {
         return ParseIdList(v, &c->policy.allowed_gids);
       },
       [](const DaemonConfig& c) { return JoinIds(c.policy.allowed_gids); }},
      U64Setting("quotas", "session_max_bytes", Kind::kSize, "byte limit of one session (0: none)",
                 [](DaemonConfig* c) { return &c->policy.session_max_bytes; }),
      U64Setting("quotas", "job_max_bytes", Kind::kSize,
                 "byte limit of all sessions of one job id (0: none)",
                 [](DaemonConfig* c) { return &c->policy.job_max_bytes; }),
      FractionSetting(
          "quotas", "state_share",
          "what one job's placed state (place_state's sessions) may hold together: this fraction "
          "of the job's limit (quotas.job_max_bytes, or a lower one its hello asked for; the "
          "usable arena when it has none); its activations and checkpoints keep the rest "
          "(default 0.5)",
          [](DaemonConfig* c) { return &c->policy.state_share; }),
      U64Setting("quotas", "uid_max_bytes", Kind::kSize,
                 "byte limit of all sessions of one uid, whatever job ids they name (0: none)",
                 [](DaemonConfig* c) { return &c->policy.uid_max_bytes; }),
      CountSetting(
          "quotas", "uid_max_chunks",
          "chunks the tenants of one uid may own at once, for its groups and its "
          "regions, whatever job ids they name (0: no limit; ignored with tenant = none)",
          1 << 23, [](DaemonConfig* c) { return &c->policy.uid_max_chunks; }, 0),
      U64Setting("quotas", "node_reserve_bytes", Kind::kSize,
                 "arena bytes never handed out (default 0)",
                 [](DaemonConfig* c) { return &c->policy.node_reserve_bytes; }),
      U64Setting("quotas", "max_wait", Kind::kDuration,
                 "longest a waiting reserve waits when its call has no deadline",
                 [](DaemonConfig* c) { return &c->policy.max_wait_ms; }),
      CountSetting("quotas", "max_waiting_reserves",
                   "waiting reserves queued at once, all tenants (default 1024)", 1 << 20,
                   [](DaemonConfig* c) { return &c->policy.max_waiting_reserves; }),
      CountSetting("quotas", "max_waiting_reserves_per_tenant",
                   "waiting reserves queued at once by one tenant, and by all tenants of one uid "
                   "together (default 256)",
                   1 << 20,
                   [](DaemonConfig* c) { return &c->policy.max_waiting_reserves_per_tenant; }),
      U64Setting("quotas", "reserve_aging", Kind::kDuration,
                 "after this wait, a waiting reserve's bytes are kept free for it against "
                 "other tenants (default 2s)",
                 [](DaemonConfig* c) { return &c->policy.reserve_aging_ms; }),
      CountSetting("quotas", "max_extents_per_reserve",
                   "extents one Reserve may return; beyond, it fails and reserves nothing "
                   "(default 16384, a reply of about 400 KiB)",
                   kMaxExtentsPerReserveLimit,
                   [](DaemonConfig* c) { return &c->policy.max_extents_per_reserve; }),
      CountSetting("quotas", "max_groups_per_session",
                   "groups one session may hold at once (default 16384)", 1 << 24,
                   [](DaemonConfig* c) { return &c->policy.max_groups_per_session; }),
      U64Setting("regions", "max_bytes", Kind::kSize,
                 "arena bytes all checkpoint regions may hold, counted in whole chunks with "
                 "tenants (default half the arena, at least one chunk; 0 disables regions)",
                 [](DaemonConfig* c) { return &c->policy.region_max_bytes; }),
      U64Setting("regions", "job_max_bytes", Kind::kSize,
                 "arena bytes one job's checkpoint regions may hold (0: only regions.max_bytes)",
                 [](DaemonConfig* c) { return &c->policy.region_job_max_bytes; }),
      U64Setting("regions", "uid_max_bytes", Kind::kSize,
                 "arena bytes the checkpoint regions of one uid may hold, over all its job ids, "
                 "and, with tenants, the whole chunks they may keep from other tenants (a uid's "
                 "first region may always pin its chunks; default half of regions.max_bytes; 0: "
                 "only regions.max_bytes)",
                 [](DaemonConfig* c) { return &c->policy.region_uid_max_bytes; }),
      U64Setting("regions", "ttl", Kind::kDuration,
                 "a committed region is deleted this long after its commit; a request may ask "
                 "for less (default 24h)",
                 [](DaemonConfig* c) { return &c->policy.region_ttl_ms; }),
      CountSetting("regions", "max_per_job", "regions one job may hold at once (default 1024)",
                   1 << 20, [](DaemonConfig* c) { return &c->policy.max_regions_per_job; }),
      CountSetting(
          "regions", "max_per_uid",
          "regions one uid may hold at once, over all its job ids (default an eighth of "
          "regions.max_count, at least 1; 0: only regions.max_count)",
          1 << 24, [](DaemonConfig* c) { return &c->policy.max_regions_per_uid; },
          /*min=*/0),
      CountSetting("regions", "max_count",
                   "regions all jobs may hold at once (default 65536, about 0.5 KiB of daemon "
                   "memory each)",
                   1 << 24, [](DaemonConfig* c) { return &c->policy.max_regions; }),
      {"replication", "key_file", Kind::kString,
       "file of the cluster secret the daemon derives each job's key for checkpoint "
       "replication from ('KEY_ID HEX_SECRET' lines, the first used, all accepted; owned by the "
       "daemon's user, mode 0400; default: $CREDENTIALS_DIRECTORY/replication-key when systemd "
       "loaded one, else none: ranks make a key of their own in the job's store)",
       [](DaemonConfig* c, const std::string& v) {
         c->replication_key_file = v;
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return c.replication_key_file; }},
      BoolSetting("replication", "require_key",
                  "refuse checkpoint replication from and to this node without a key file (ranks "
                  "never fall back to a key published in the job's store; default false)",
                  &DaemonConfig::replication_require_key),
      U64Setting("lifecycle", "drain_timeout", Kind::kDuration,
                 "on SIGTERM, how long to wait for sessions to release (default 30s)",
                 [](DaemonConfig* c) { return &c->drain_timeout_ms; }),
      ChoiceSetting(
          "lifecycle", "state_store",
          "where the arena and its checkpoint regions outlive a restart of the daemon: systemd "
          "(its fd store), keeper (memoffloadd keeper, for containers), none, or auto (default: "
          "systemd under systemd, else the keeper when its socket is in the runtime dir)",
          {"auto", "systemd", "keeper", "none"}, &DaemonConfig::state_store),
      ChoiceSetting(
          "lifecycle", "keep_sessions",
          "at SIGTERM with a state store, keep the sessions for the next start (their processes "
          "resume them): restart (default: unless systemd stops the unit for good), always, or "
          "never (drain and end them, as without a store)",
          {"restart", "always", "never"}, &DaemonConfig::keep_sessions),
      {"lifecycle", "keeper_socket", Kind::kString,
       "the keeper's socket, for lifecycle.state_store and 'memoffloadd keeper' (default "
       "<runtime dir>/keeper.sock; pods that share the runtime dir give each keeper its own)",
       [](DaemonConfig* c, const std::string& v) {
         if (!v.empty() && v.front() != '/') {
           return InvalidArgument("'" + v + "' is not an absolute path");
         }
         c->keeper_socket = v;
         return Status::Ok();
       },
       [](const DaemonConfig& c) { return c.keeper_socket; }},
      ChoiceSetting(
          "lifecycle", "take_over",
          "at start, with a daemon serving the runtime dir: never (refuse, the default), always "
          "(take the node from it: it pauses its sessions and hands on its arena, regions, "
          "sessions and sockets; fail when none serves) or auto (take it over when one serves, "
          "else start as usual: a DaemonSet's surge pod; docs/restarts.md)",
          {"never", "always", "auto"}, &DaemonConfig::take_over),
      ChoiceSetting(
          "lifecycle", "after_handover",
          "once a take-over has the node: exit (0, the default) or wait for a signal, answering "
          "/livez 200 and /readyz 503 (in a pod, whose exited container would start again)",
          {"exit", "wait"}, &DaemonConfig::after_handover),
      U64Setting("lifecycle", "hello_timeout", Kind::kDuration,
                 "drop a broker connection that sends no hello in this time",
                 [](DaemonConfig* c) { return &c->hello_timeout_ms; }),
  };
  return settings;
}

const Setting* FindByFlag(const std::string& flag) {
  for (const Setting& s : Settings()) {
    if (s.Flag() == flag) return &s;
  }
  return nullptr;
}

}  // namespace memoffload::daemon::config_internal
