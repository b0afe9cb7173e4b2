// memoffloadd: the per-node activation offload daemon.
#include <absl/synchronization/mutex.h>

#include <csignal>
#include <cstdio>
#include <string>

#include "app/daemon.h"
#include "app/fd_store.h"
#include "base/log.h"
#include "config/config.h"

int main(int argc, char** argv) {
  using namespace memoffload::daemon;
  std::signal(SIGPIPE, SIG_IGN);
  // Debian's Abseil is built without NDEBUG, so absl::Mutex (all of gRPC's
  // locks) keeps a lock-order graph for deadlock detection on every lock:
  // a debugging aid that cost the request path some 5% of the daemon's CPU
  // under load (perf: GraphCycles::GetId/InsertEdge/RemoveNode). Off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // `memoffloadd keeper [--runtime-dir DIR] [--keeper-socket PATH]`: holds the daemon's memfds
  // across its restarts where there is no systemd (app/fd_store.h).
  const bool keeper = argc > 1 && std::string(argv[1]) == "keeper";
  if (keeper) {
    --argc;
    ++argv;
  }
  memoffload::Result<DaemonConfig> config = LoadConfig(argc, argv, ProcessEnvironment());
  if (!config.ok()) {
    std::fprintf(stderr, "memoffloadd: %s\n", config.status().message().c_str());
    return 2;
  }
  if (config->show_help) {
    std::fputs(FlagsHelp().c_str(), stdout);
    return 0;
  }
  if (config->show_version) {
    std::printf("memoffloadd %s\n", DaemonVersion());
    return 0;
  }
  if (memoffload::Status st = ResolveAndValidate(&*config); !st.ok()) {
    std::fprintf(stderr, "memoffloadd: %s\n", st.message().c_str());
    return 2;
  }
  if (keeper) {
    if (memoffload::Status st = RunKeeper(config->keeper_socket); !st.ok()) {
      std::fprintf(stderr, "memoffloadd keeper: %s\n", st.message().c_str());
      return 1;
    }
    return 0;
  }
  if (config->print_config) {
    std::fputs(FormatConfig(*config).c_str(), stdout);
    return 0;
  }
  const std::string& level = config->log_level;
  SetLogLevel(level == "debug"   ? LogLevel::kDebug
              : level == "warn"  ? LogLevel::kWarning
              : level == "error" ? LogLevel::kError
                                 : LogLevel::kInfo);
  if (memoffload::Status st = RunDaemon(*config, argc, argv); !st.ok()) {
    std::fprintf(stderr, "memoffloadd: %s\n", st.message().c_str());
    return 1;
  }
  return 0;
}
