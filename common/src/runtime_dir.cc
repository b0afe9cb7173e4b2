#include "memoffload/common/runtime_dir.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

namespace memoffload {
namespace {

std::string PerUserDir(const char* xdg_dir, uint32_t uid) {
  if (xdg_dir != nullptr && xdg_dir[0] != '\0') return std::string(xdg_dir) + "/memoffload";
  return "/tmp/memoffload-" + std::to_string(uid);
}

}  // namespace

std::string DefaultRuntimeDir() { return DefaultRuntimeDirForUid(geteuid()); }

std::string DefaultRuntimeDirForUid(uint32_t uid) {
  if (uid == 0) return kSystemRuntimeDir;
  return PerUserDir(std::getenv("XDG_RUNTIME_DIR"), uid);
}

RuntimeDirChoice DiscoverRuntimeDirFrom(const std::string& explicit_dir, const char* env_dir,
                                        bool system_broker_exists, const char* xdg_dir,
                                        uint32_t uid) {
  if (!explicit_dir.empty()) return {explicit_dir, RuntimeDirSource::kExplicit};
  if (env_dir != nullptr && env_dir[0] != '\0') return {env_dir, RuntimeDirSource::kExplicit};
  if (system_broker_exists) return {kSystemRuntimeDir, RuntimeDirSource::kSystem};
  return {PerUserDir(xdg_dir, uid), RuntimeDirSource::kPerUser};
}

RuntimeDirChoice DiscoverRuntimeDir(const std::string& explicit_dir) {
  struct stat st;
  const bool system_broker =
      lstat(BrokerSocketPath(kSystemRuntimeDir).c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
  return DiscoverRuntimeDirFrom(explicit_dir, std::getenv(kRuntimeDirEnv), system_broker,
                                std::getenv("XDG_RUNTIME_DIR"), geteuid());
}

std::string BrokerSocketPath(const std::string& runtime_dir) {
  return runtime_dir + "/" + kBrokerSocketName;
}

std::string GrpcSocketPath(const std::string& runtime_dir) {
  return runtime_dir + "/" + kGrpcSocketName;
}

}  // namespace memoffload
