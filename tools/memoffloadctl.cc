// memoffloadctl: operator CLI for memoffloadd.
//
//   memoffloadctl [--runtime-dir DIR] [--json] status|sessions|drain|undrain|config
//   memoffloadctl [--runtime-dir DIR] [--json] regions [PREFIX]
//   memoffloadctl [--runtime-dir DIR] [--json] delete-region UID JOB NAME
//
// Exit codes: 0 success, 1 the daemon answered with an error, 2 usage error,
// 3 the daemon is not reachable (the message names the socket tried),
// 4 permission denied (drain/undrain without access to the admin token).
#include <google/protobuf/util/json_util.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "memoffload/client/admin.h"
#include "memoffload/common/units.h"

namespace {

using memoffload::FormatSize;
using memoffload::Status;
using memoffload::StatusCode;

constexpr int kExitOk = 0;
constexpr int kExitDaemonError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitUnreachable = 3;
constexpr int kExitPermission = 4;

void Usage(FILE* out) {
  std::fputs(
      "usage: memoffloadctl [--runtime-dir DIR] [--json] <command>\n\n"
      "commands:\n"
      "  status     arena capacity, use by state, sessions by kind, groups, placed state\n"
      "  sessions   attached sessions: job, kind, rank, pid, uid, bytes held, groups, placed\n"
      "             blocks, age\n"
      "  drain      refuse new attaches and reserves; existing sessions finish, and\n"
      "             sessions of placed state are asked to move it out and leave\n"
      "  undrain    accept attaches and reserves again\n"
      "  config     the daemon's effective configuration and where each value came from\n"
      "  regions [PREFIX]\n"
      "             checkpoint regions: uid, job, name, state, size, expiry, readers\n"
      "  delete-region UID JOB NAME\n"
      "             delete a committed checkpoint region (needs the admin token)\n\n"
      "The runtime dir defaults to $MEMOFFLOAD_RUNTIME_DIR, else /run/memoffload\n"
      "(root), $XDG_RUNTIME_DIR/memoffload or /tmp/memoffload-$UID.\n"
      "Exit codes: 0 ok, 1 daemon error, 2 usage, 3 daemon not reachable,\n"
      "4 permission denied (drain, undrain and delete-region need root or the\n"
      "daemon's user).\n",
      out);
}

int Fail(const Status& st) {
  std::fprintf(stderr, "memoffloadctl: %s\n", st.message().c_str());
  if (st.code() == StatusCode::kUnavailable || st.code() == StatusCode::kDeadlineExceeded) {
    return kExitUnreachable;
  }
  if (st.code() == StatusCode::kPermissionDenied) return kExitPermission;
  return kExitDaemonError;
}

// Prints the reply as JSON; an error (and kExitDaemonError) if protobuf
// cannot, rather than an empty line a script would take for an answer.
int PrintJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  const auto st = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!st.ok()) {
    std::fprintf(stderr, "memoffloadctl: cannot print the reply as JSON: %s\n",
                 st.ToString().c_str());
    return kExitDaemonError;
  }
  std::printf("%s\n", json.c_str());
  return kExitOk;
}

std::string Percent(uint64_t part, uint64_t whole) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.1f%%", whole == 0 ? 0.0 : 100.0 * part / whole);
  return buf;
}

int Status_(memoffload::client::AdminClient& admin, bool json) {
  auto s = admin.GetStatus();
  if (!s.ok()) return Fail(s.status());
  if (json) {
    return PrintJson(*s);
  }
  auto row = [](const char* k, const std::string& v) { std::printf("%-20s %s\n", k, v.c_str()); };
  row("version", s->version());
  row("runtime dir", s->runtime_dir());
  row("metrics",
      s->metrics_address().empty() ? "disabled" : "http://" + s->metrics_address() + "/metrics");
  row("capacity", FormatSize(s->capacity_bytes()));
  row("used",
      FormatSize(s->used_bytes()) + " (" + Percent(s->used_bytes(), s->capacity_bytes()) + ")");
  row("  reserved", FormatSize(s->reserved_bytes()));
  row("  committed", FormatSize(s->committed_bytes()));
  row("  read", FormatSize(s->read_bytes()));
  row("free", FormatSize(s->free_bytes()));
  row("node reserve", FormatSize(s->node_reserve_bytes()));
  row("largest free extent", FormatSize(s->largest_free_extent_bytes()));
  row("chunks", std::to_string(s->chunks()) + " x " + FormatSize(s->chunk_size_bytes()));
  row("mlocked", s->mlocked() ? "yes" : "no");
  if (!s->pages().empty()) row("pages", s->pages());
  row("stale backings", std::to_string(s->stale_backings()) + " (" + FormatSize(s->stale_bytes()) +
                            " still kept by processes of a previous tenant, outside capacity)");
  row("fresh backings", std::to_string(s->replaced_backings()) + " replaced, " +
                            std::to_string(s->spare_backings()) + " spare ready");
  char instance[32];
  std::snprintf(instance, sizeof(instance), "%016llx",
                static_cast<unsigned long long>(s->instance_id()));
  row("instance", instance);
  row("sessions", std::to_string(s->sessions()));
  // By what they attached for; placed state's blocks are not groups.
  for (const auto& k : s->kinds()) {
    std::string line = std::to_string(k.sessions()) + " holding " + FormatSize(k.held_bytes());
    if (k.kind() == "state") {
      char share[32];
      std::snprintf(share, sizeof(share), "%g", s->state_share());
      line += " in " + std::to_string(s->state_blocks()) +
              (s->state_blocks() == 1 ? " block" : " blocks") + " (at most quotas.state_share " +
              share + " of a job's limit)";
    }
    row(("  " + k.kind()).c_str(), line);
  }
  row("groups", std::to_string(s->groups()));
  row("waiting reserves", std::to_string(s->waiting_reserves()));
  row("regions", std::to_string(s->regions()) + " holding " + FormatSize(s->region_bytes()) +
                     " of " + FormatSize(s->region_max_bytes()) + " (regions.max_bytes)");
  // Per uid, next to the limits that count it ("of" only where one is set).
  auto of = [](const std::string& value, uint64_t limit, const std::string& limit_text) {
    return limit == 0 ? value : value + " of " + limit_text;
  };
  for (const auto& u : s->uids()) {
    row(("uid " + std::to_string(u.uid())).c_str(),
        std::to_string(u.sessions()) + (u.sessions() == 1 ? " session, " : " sessions, ") +
            of(FormatSize(u.held_bytes()), s->uid_max_bytes(), FormatSize(s->uid_max_bytes())) +
            " held, " +
            of(std::to_string(u.owned_chunks()), s->uid_max_chunks(),
               std::to_string(s->uid_max_chunks())) +
            " chunks, " +
            of(std::to_string(u.regions()), s->max_regions_per_uid(),
               std::to_string(s->max_regions_per_uid())) +
            (u.regions() == 1 ? " region holding " : " regions holding ") +
            of(FormatSize(u.region_bytes()), s->region_uid_max_bytes(),
               FormatSize(s->region_uid_max_bytes())));
  }
  row("draining", s->draining() ? "yes" : "no");
  row("uptime", std::to_string(static_cast<uint64_t>(s->uptime_seconds())) + " s");
  return kExitOk;
}

int Sessions(memoffload::client::AdminClient& admin, bool json) {
  auto r = admin.ListSessions();
  if (!r.ok()) return Fail(r.status());
  if (json) {
    return PrintJson(*r);
  }
  // KIND: what the session attached for (activations, state, checkpoints,
  // other); a state session holds placed BLOCKS, not groups.
  std::printf("%-8s %-20s %-11s %6s %8s %6s %12s %7s %7s %8s\n", "SESSION", "JOB", "KIND", "RANK",
              "PID", "UID", "HELD", "GROUPS", "BLOCKS", "AGE");
  for (const auto& s : r->sessions()) {
    const std::string rank = s.rank() < 0 ? "-" : std::to_string(s.rank());  // -1: unknown
    std::printf("%-8lu %-20s %-11s %6s %8d %6u %12s %7lu %7lu %7.0fs\n",
                static_cast<unsigned long>(s.session_id()),
                s.job_id().empty() ? "-" : s.job_id().c_str(),
                s.kind().empty() ? "-" : s.kind().c_str(), rank.c_str(), s.pid(), s.uid(),
                FormatSize(s.held_bytes()).c_str(), static_cast<unsigned long>(s.groups()),
                static_cast<unsigned long>(s.blocks()), s.age_seconds());
  }
  if (r->sessions_size() == 0) std::printf("(no sessions)\n");
  return kExitOk;
}

int Drain(memoffload::client::AdminClient& admin, bool drain, bool json) {
  auto r = admin.Drain(drain);
  if (!r.ok()) return Fail(r.status());
  if (json) {
    return PrintJson(*r);
  }
  if (r->draining()) {
    std::printf("draining: new attaches and reserves are refused; %u sessions still hold %s\n",
                r->sessions(), FormatSize(r->used_bytes()).c_str());
  } else {
    std::printf("serving: attaches and reserves are accepted\n");
  }
  return kExitOk;
}

int Config(memoffload::client::AdminClient& admin, bool json) {
  auto r = admin.GetConfig();
  if (!r.ok()) return Fail(r.status());
  if (json) {
    return PrintJson(*r);
  }
  std::fputs(r->toml().c_str(), stdout);
  return kExitOk;
}

int Regions(memoffload::client::AdminClient& admin, const std::string& prefix, bool json) {
  auto r = admin.ListRegions(prefix);
  if (!r.ok()) return Fail(r.status());
  if (json) {
    return PrintJson(*r);
  }
  std::printf("%6s %-20s %-40s %-9s %12s %10s %7s %4s\n", "UID", "JOB", "NAME", "STATE", "USED",
              "EXPIRES", "READERS", "CRC");
  for (const auto& g : r->regions()) {
    char expires[32] = "-";
    if (g.state() == "committed") {
      std::snprintf(expires, sizeof(expires), "%.0fs", g.expires_in_seconds());
    }
    std::printf("%6u %-20s %-40s %-9s %12s %10s %7u %4s\n", g.uid(), g.job_id().c_str(),
                g.name().c_str(), g.state().c_str(), FormatSize(g.used_bytes()).c_str(), expires,
                g.readers(), g.checksummed() ? "yes" : "no");
  }
  if (r->regions_size() == 0) std::printf("(no regions)\n");
  if (r->omitted() != 0) {
    std::printf("(%u more not listed: give a name prefix, e.g. 'regions dcp/')\n", r->omitted());
  }
  return kExitOk;
}

int DeleteRegion(memoffload::client::AdminClient& admin, const std::vector<std::string>& args,
                 bool json) {
  char* end = nullptr;
  const unsigned long uid = args.empty() ? 0 : std::strtoul(args[0].c_str(), &end, 10);
  if (args.size() != 3 || args[0].empty() || *end != '\0' || uid > 0xfffffffeul) {
    std::fprintf(stderr, "memoffloadctl: delete-region takes UID JOB NAME (as 'regions' lists)\n");
    return kExitUsage;
  }
  auto r = admin.DeleteRegion(static_cast<uint32_t>(uid), args[1], args[2]);
  if (!r.ok()) return Fail(r.status());
  if (json) {
    return PrintJson(*r);
  }
  if (r->freed_bytes() != 0) {
    std::printf("deleted %s: %s freed\n", args[2].c_str(), FormatSize(r->freed_bytes()).c_str());
  } else {
    std::printf("deleted %s: freed when its last reader closes it\n", args[2].c_str());
  }
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  std::string runtime_dir, command;
  std::vector<std::string> args;  // after the command
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--json") {
      json = true;
    } else if (arg == "--runtime-dir" && i + 1 < argc) {
      runtime_dir = argv[++i];
    } else if (arg.rfind("--runtime-dir=", 0) == 0) {
      runtime_dir = arg.substr(std::strlen("--runtime-dir="));
    } else if (arg == "--help" || arg == "-h") {
      Usage(stdout);
      return kExitOk;
    } else if (!arg.empty() && arg[0] != '-' && command.empty()) {
      command = arg;
    } else if (!arg.empty() && arg[0] != '-') {
      args.push_back(arg);
    } else {
      std::fprintf(stderr, "memoffloadctl: unexpected argument '%s'\n", arg.c_str());
      Usage(stderr);
      return kExitUsage;
    }
  }
  if (command.empty()) {
    Usage(stderr);
    return kExitUsage;
  }
  auto admin = memoffload::client::AdminClient::Connect(runtime_dir);
  if (!admin.ok()) return Fail(admin.status());
  if (command == "status") return Status_(**admin, json);
  if (command == "sessions") return Sessions(**admin, json);
  if (command == "drain" || command == "undrain") return Drain(**admin, command == "drain", json);
  if (command == "config") return Config(**admin, json);
  if (command == "regions" && args.size() <= 1) {
    return Regions(**admin, args.empty() ? "" : args[0], json);
  }
  if (command == "delete-region") return DeleteRegion(**admin, args, json);
  if (!args.empty()) {
    std::fprintf(stderr, "memoffloadctl: unexpected argument '%s'\n", args[0].c_str());
    Usage(stderr);
    return kExitUsage;
  }
  std::fprintf(stderr, "memoffloadctl: unknown command '%s'\n", command.c_str());
  Usage(stderr);
  return kExitUsage;
}
