#include "memoffload/daemon/config.h"

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <string_view>

#include "memoffload/shared_mem/chunk.h"
#include "memoffload/shared_mem/runtime_dir.h"
#include "memoffload/shared_mem/units.h"

namespace memoffload::daemon {
namespace {

struct Flag {
  const char* name;
  const char* value_help;  // nullptr: boolean flag taking no value
  const char* help;
  std::function<Status(DaemonConfig*, const std::string&)> apply;
};

Status SetSize(uint64_t* out, const std::string& flag, const std::string& v) {
  Result<uint64_t> r = ParseSize(v);
  if (!r.ok()) return InvalidArgument("--" + flag + ": " + r.status().message());
  *out = *r;
  return Status::Ok();
}

const std::vector<Flag>& Flags() {
  static const std::vector<Flag> flags = {
      {"runtime-dir", "DIR",
       "directory holding broker.sock and memoffload.sock (default: "
       "/run/memoffload as root, else $XDG_RUNTIME_DIR/memoffload or "
       "/tmp/memoffload-$UID; env MEMOFFLOAD_RUNTIME_DIR)",
       [](DaemonConfig* c, const std::string& v) {
         if (v.empty()) return InvalidArgument("--runtime-dir: empty path");
         c->runtime_dir = v;
         return Status::Ok();
       }},
      {"arena-size", "SIZE", "arena size, e.g. 512MiB, 64GiB (default: min(1GiB, 25% of RAM))",
       [](DaemonConfig* c, const std::string& v) {
         return SetSize(&c->arena_size_bytes, "arena-size", v);
       }},
      {"chunk-size", "SIZE", "size of one memfd chunk (default: min(1GiB, arena))",
       [](DaemonConfig* c, const std::string& v) {
         return SetSize(&c->chunk_size_bytes, "chunk-size", v);
       }},
      {"metrics-address", "HOST:PORT",
       "Prometheus /metrics listener (default 127.0.0.1:9477; 'none' disables)",
       [](DaemonConfig* c, const std::string& v) {
         c->metrics_address = (v == "none") ? "" : v;
         if (!c->metrics_address.empty() && c->metrics_address.find(':') == std::string::npos) {
           return InvalidArgument("--metrics-address: '" + v + "' is not HOST:PORT or 'none'");
         }
         return Status::Ok();
       }},
      {"prefault-threads", "N", "threads that pre-fault the arena (default: cores)",
       [](DaemonConfig* c, const std::string& v) {
         char* end = nullptr;
         long n = std::strtol(v.c_str(), &end, 10);
         if (v.empty() || *end != '\0' || n < 0 || n > 1024) {
           return InvalidArgument("--prefault-threads: '" + v +
                                  "' is not an integer in 0..1024 (0: one per core)");
         }
         c->prefault_threads = static_cast<int>(n);
         return Status::Ok();
       }},
      {"session-max-bytes", "SIZE", "byte limit per session (default: none)",
       [](DaemonConfig* c, const std::string& v) {
         return SetSize(&c->session_max_bytes, "session-max-bytes", v);
       }},
      {"log-level", "LEVEL", "debug, info, warn or error (default info)",
       [](DaemonConfig* c, const std::string& v) {
         if (v != "debug" && v != "info" && v != "warn" && v != "error") {
           return InvalidArgument("--log-level: '" + v +
                                  "' is not one of debug, info, warn, error");
         }
         c->log_level = v;
         return Status::Ok();
       }},
      {"hugepages", nullptr, "back chunks with hugepages (MFD_HUGETLB)",
       [](DaemonConfig* c, const std::string&) {
         c->hugepages = true;
         return Status::Ok();
       }},
      {"no-mlock", nullptr, "do not mlock the arena",
       [](DaemonConfig* c, const std::string&) {
         c->mlock = false;
         return Status::Ok();
       }},
      {"help", nullptr, "print this help and exit",
       [](DaemonConfig* c, const std::string&) {
         c->show_help = true;
         return Status::Ok();
       }},
      {"version", nullptr, "print the version and exit",
       [](DaemonConfig* c, const std::string&) {
         c->show_version = true;
         return Status::Ok();
       }},
  };
  return flags;
}

}  // namespace

Result<DaemonConfig> ParseFlags(int argc, const char* const* argv) {
  DaemonConfig config;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg.substr(0, 2) != "--") {
      return InvalidArgument("unexpected argument '" + std::string(arg) +
                             "'; flags start with -- (see --help)");
    }
    arg.remove_prefix(2);
    std::string name(arg), value;
    bool has_value = false;
    if (size_t eq = arg.find('='); eq != std::string_view::npos) {
      name = std::string(arg.substr(0, eq));
      value = std::string(arg.substr(eq + 1));
      has_value = true;
    }
    auto it =
        std::find_if(Flags().begin(), Flags().end(), [&](const Flag& f) { return name == f.name; });
    if (it == Flags().end()) {
      return InvalidArgument("unknown flag '--" + name + "' (see --help)");
    }
    if (it->value_help == nullptr) {
      if (has_value) {
        return InvalidArgument("flag '--" + name + "' takes no value");
      }
    } else if (!has_value) {
      if (i + 1 >= argc) {
        return InvalidArgument("flag '--" + name + "' needs a value: " + it->value_help);
      }
      value = argv[++i];
    }
    MEMOFFLOAD_RETURN_IF_ERROR(it->apply(&config, value));
  }
  return config;
}

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

Status ResolveAndValidate(DaemonConfig* c) {
  c->runtime_dir = ResolveRuntimeDir(c->runtime_dir);
  const uint64_t page = SystemPageBytes();
  const uint64_t ram = PhysicalMemoryBytes();
  if (c->arena_size_bytes == 0) {
    c->arena_size_bytes = std::min<uint64_t>(kGiB, ram / 4);
  }
  c->arena_size_bytes = c->arena_size_bytes / page * page;
  if (c->arena_size_bytes == 0) {
    return InvalidArgument("--arena-size: must be at least one page (" + std::to_string(page) +
                           " bytes)");
  }
  if (ram != 0 && c->arena_size_bytes > ram) {
    return InvalidArgument("--arena-size: " + FormatSize(c->arena_size_bytes) +
                           " exceeds this machine's RAM of " + FormatSize(ram));
  }
  if (c->chunk_size_bytes == 0) {
    c->chunk_size_bytes = std::min<uint64_t>(kGiB, c->arena_size_bytes);
  }
  if (c->chunk_size_bytes % page != 0) {
    return InvalidArgument("--chunk-size: " + std::to_string(c->chunk_size_bytes) +
                           " is not a multiple of the page size (" + std::to_string(page) + ")");
  }
  if (c->chunk_size_bytes > c->arena_size_bytes) {
    c->chunk_size_bytes = c->arena_size_bytes;
  }
  const uint64_t chunks = (c->arena_size_bytes + c->chunk_size_bytes - 1) / c->chunk_size_bytes;
  if (chunks > 65536) {
    return InvalidArgument("--chunk-size: " + FormatSize(c->chunk_size_bytes) + " gives " +
                           std::to_string(chunks) +
                           " chunks; at most 65536 are supported, use larger chunks");
  }
  if (c->prefault_threads == 0) {
    c->prefault_threads = std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN));
  }
  return Status::Ok();
}

std::string FlagsHelp() {
  std::string out =
      "usage: memoffloadd [flags]\n\n"
      "Serves a shared, pre-faulted host-memory arena to training processes.\n\n";
  for (const Flag& f : Flags()) {
    std::string left = std::string("  --") + f.name;
    if (f.value_help != nullptr) left += std::string("=") + f.value_help;
    if (left.size() < 30)
      left.resize(30, ' ');
    else
      left += "\n" + std::string(30, ' ');
    out += left + f.help + "\n";
  }
  return out;
}

}  // namespace memoffload::daemon
