#include "memoffload/shared_mem/runtime_dir.h"

#include <unistd.h>

#include <cstdlib>

namespace memoffload {

std::string DefaultRuntimeDir() { return DefaultRuntimeDirForUid(geteuid()); }

std::string DefaultRuntimeDirForUid(uint32_t uid) {
  if (uid == 0) return "/run/memoffload";
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && xdg[0] != '\0') return std::string(xdg) + "/memoffload";
  return "/tmp/memoffload-" + std::to_string(uid);
}

std::string ResolveRuntimeDir(const std::string& explicit_dir) {
  if (!explicit_dir.empty()) return explicit_dir;
  const char* env = std::getenv(kRuntimeDirEnv);
  if (env != nullptr && env[0] != '\0') return env;
  return DefaultRuntimeDir();
}

std::string BrokerSocketPath(const std::string& runtime_dir) {
  return runtime_dir + "/" + kBrokerSocketName;
}

std::string GrpcSocketPath(const std::string& runtime_dir) {
  return runtime_dir + "/" + kGrpcSocketName;
}

}  // namespace memoffload
