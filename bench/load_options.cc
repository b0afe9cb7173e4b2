#include "load_options.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "memoffload/common/units.h"

namespace memoffload::bench {

WorkerData::WorkerData(const LoadOptions& o)
    : max_group_(o.max_group),
      rng_(o.seed * 1000003 + static_cast<uint64_t>(o.index)),
      source_(o.max_group + kShiftSpan),
      log_size_(std::log(static_cast<double>(o.min_group)),
                std::log(static_cast<double>(o.max_group))) {
  for (size_t i = 0; i < source_.size(); i += 8) {
    const uint64_t v = rng_();
    std::memcpy(source_.data() + i, &v, std::min<size_t>(8, source_.size() - i));
  }
}

uint64_t WorkerData::NextSize() {
  return std::min(max_group_, static_cast<uint64_t>(std::exp(log_size_(rng_))));
}

bool WaitForEveryWindowToEnd() {
  std::printf("TIMED\n");
  std::fflush(stdout);
  char word = 0;
  return read(STDIN_FILENO, &word, 1) == 1;
}

void StayUntilTheParentCloses() {
  std::fflush(stdout);
  char c = 0;
  while (read(STDIN_FILENO, &c, 1) > 0) {
  }
}

int Usage(const char* message) {
  std::fprintf(
      stderr,
      "memoffload-bench load: %s\n"
      "usage: memoffload-bench load --runtime-dir DIR --clients N --seconds S [--json]\n"
      "         [--max-bytes B] [--min-group B] [--max-group B] [--window N]\n"
      "         [--job-id ID] [--seed N] [--baseline [--pairs N] [--floor-copies]] [--warm]\n"
      "         [--no-copies]\n"
      "  --baseline       also run a trivial gRPC service with the same clients, in turn\n"
      "  --pairs N        N (daemon, floor) pairs; ratios are medians with their spread\n"
      "  --floor-copies   the floor's clients copy as the load's do (needs --baseline)\n"
      "  --no-copies      the load's clients copy nothing: the request path alone\n"
      "                   (not with --floor-copies)\n"
      "  --warm           claim every chunk first; clients populate them at attach\n",
      message);
  return 2;
}

bool ParseFlags(int argc, char** argv, LoadOptions* o, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--baseline") {
      o->baseline = true;
      continue;
    }
    if (flag == "--json") {
      o->json = true;
      continue;
    }
    if (flag == "--warm") {
      o->warm = true;
      continue;
    }
    if (flag == "--floor-copies") {
      o->floor_copies = true;
      continue;
    }
    if (flag == "--no-copies") {
      o->no_copies = true;
      continue;
    }
    static const char* const kValueFlags[] = {"--runtime-dir", "--clients",      "--seconds",
                                              "--pairs",       "--window",       "--seed",
                                              "--index",       "--floor-socket", "--job-id",
                                              "--max-bytes",   "--min-group",    "--max-group"};
    if (std::find(std::begin(kValueFlags), std::end(kValueFlags), flag) == std::end(kValueFlags)) {
      *error = "unknown flag '" + flag + "'";
      return false;
    }
    if (i + 1 >= argc) {
      *error = "flag " + flag + " needs a value";
      return false;
    }
    const std::string value = argv[++i];
    auto size = [&](uint64_t* out) {
      Result<uint64_t> v = ParseSize(value);
      if (!v.ok()) *error = flag + ": " + v.status().message();
      if (v.ok()) *out = *v;
      return v.ok();
    };
    char* end = nullptr;
    if (flag == "--runtime-dir") {
      o->runtime_dir = value;
    } else if (flag == "--clients") {
      o->clients = static_cast<int>(std::strtol(value.c_str(), &end, 10));
      if (*end != '\0' || o->clients < 1 || o->clients > 1024) {
        *error = "--clients '" + value + "' is not an integer in 1..1024";
        return false;
      }
    } else if (flag == "--seconds") {
      o->seconds = std::strtod(value.c_str(), &end);
      if (*end != '\0' || !(o->seconds > 0) || o->seconds > 86400) {
        *error = "--seconds '" + value + "' is not a number in (0, 86400]";
        return false;
      }
    } else if (flag == "--pairs") {
      o->pairs = static_cast<int>(std::strtol(value.c_str(), &end, 10));
      if (*end != '\0' || o->pairs < 1 || o->pairs > 100) {
        *error = "--pairs '" + value + "' is not an integer in 1..100";
        return false;
      }
    } else if (flag == "--window") {
      o->window = static_cast<int>(std::strtol(value.c_str(), &end, 10));
      if (*end != '\0' || o->window < 1 || o->window > 4096) {
        *error = "--window '" + value + "' is not an integer in 1..4096";
        return false;
      }
    } else if (flag == "--seed" || flag == "--index") {
      const uint64_t v = std::strtoull(value.c_str(), &end, 10);
      if (*end != '\0' || value.empty()) {
        *error = flag + " '" + value + "' is not a non-negative integer";
        return false;
      }
      if (flag == "--seed") o->seed = v;
      if (flag == "--index") o->index = static_cast<int>(v);
    } else if (flag == "--floor-socket") {
      o->floor_socket = value;
    } else if (flag == "--job-id") {
      o->job_id = value;
    } else if (flag == "--max-bytes") {
      if (!size(&o->max_bytes)) return false;
    } else if (flag == "--min-group") {
      if (!size(&o->min_group)) return false;
    } else if (flag == "--max-group") {
      if (!size(&o->max_group)) return false;
    } else {
      *error = "unknown flag '" + flag + "'";
      return false;
    }
  }
  if (o->runtime_dir.empty() && o->floor_socket.empty()) {
    *error = "--runtime-dir is required";
    return false;
  }
  if (o->no_copies && o->floor_copies) {
    *error =
        "--no-copies and --floor-copies contradict each other (clients copying nothing, "
        "a floor copying as they do)";
    return false;
  }
  if (o->min_group == 0 || o->min_group > o->max_group || o->max_group > (uint64_t{1} << 34)) {
    *error = "need 0 < --min-group <= --max-group <= 16GiB";
    return false;
  }
  return true;
}

}  // namespace memoffload::bench
