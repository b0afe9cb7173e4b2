// The clients' discovery order (DiscoverRuntimeDir): the explicit argument,
// then MEMOFFLOAD_RUNTIME_DIR, then /run/memoffload when its broker socket
// exists, then $XDG_RUNTIME_DIR/memoffload, then /tmp/memoffload-$UID; and the
// daemon's default (/run/memoffload for root, else the per-user dir).
#include "memoffload/common/runtime_dir.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace memoffload {
namespace {

// Sets (or unsets, with nullopt) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      setenv(name, value->c_str(), 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(RuntimeDir, ExplicitArgumentWinsOverEnvironment) {
  ScopedEnv env(kRuntimeDirEnv, "/from/env");
  ScopedEnv xdg("XDG_RUNTIME_DIR", "/run/user/1000");
  EXPECT_EQ(DiscoverRuntimeDir("/from/arg").path, "/from/arg");
}

TEST(RuntimeDir, EnvironmentVariableWhenNoArgument) {
  ScopedEnv env(kRuntimeDirEnv, "/from/env");
  ScopedEnv xdg("XDG_RUNTIME_DIR", "/run/user/1000");
  EXPECT_EQ(DiscoverRuntimeDir("").path, "/from/env");
}

TEST(RuntimeDir, EmptyEnvironmentVariableFallsBackToDiscovery) {
  ScopedEnv env(kRuntimeDirEnv, "");
  ScopedEnv xdg("XDG_RUNTIME_DIR", "/run/user/4242");
  const std::string dir = DiscoverRuntimeDir("").path;
  EXPECT_TRUE(dir == "/run/memoffload" || dir == "/run/user/4242/memoffload") << dir;
}

// Each step of the order wins over the ones after it, whatever the uid.
TEST(RuntimeDir, DiscoveryOrder) {
  for (uint32_t uid : {0u, 1000u}) {
    const std::string tmp = "/tmp/memoffload-" + std::to_string(uid);
    auto d = DiscoverRuntimeDirFrom("/arg", "/env", true, "/xdg", uid);
    EXPECT_EQ(d.path, "/arg");
    EXPECT_EQ(d.source, RuntimeDirSource::kExplicit);
    d = DiscoverRuntimeDirFrom("", "/env", true, "/xdg", uid);
    EXPECT_EQ(d.path, "/env");
    EXPECT_EQ(d.source, RuntimeDirSource::kExplicit);
    d = DiscoverRuntimeDirFrom("", "", true, "/xdg", uid);
    EXPECT_EQ(d.path, "/run/memoffload");
    EXPECT_EQ(d.source, RuntimeDirSource::kSystem);
    d = DiscoverRuntimeDirFrom("", nullptr, false, "/xdg", uid);
    EXPECT_EQ(d.path, "/xdg/memoffload");
    EXPECT_EQ(d.source, RuntimeDirSource::kPerUser);
    d = DiscoverRuntimeDirFrom("", nullptr, false, "", uid);
    EXPECT_EQ(d.path, tmp);
    EXPECT_EQ(d.source, RuntimeDirSource::kPerUser);
    EXPECT_EQ(DiscoverRuntimeDirFrom("", nullptr, false, nullptr, uid).path, tmp);
  }
}

TEST(RuntimeDir, DaemonDefaultIsForTheEffectiveUid) {
  EXPECT_EQ(DefaultRuntimeDir(), DefaultRuntimeDirForUid(geteuid()));
}

TEST(RuntimeDir, RootDefaultsToRunEvenWithXdgSet) {
  ScopedEnv xdg("XDG_RUNTIME_DIR", "/run/user/0");
  EXPECT_EQ(DefaultRuntimeDirForUid(0), "/run/memoffload");
}

TEST(RuntimeDir, NonRootUsesXdgRuntimeDir) {
  ScopedEnv xdg("XDG_RUNTIME_DIR", "/run/user/1000");
  EXPECT_EQ(DefaultRuntimeDirForUid(1000), "/run/user/1000/memoffload");
}

TEST(RuntimeDir, NonRootWithoutXdgUsesTmpPerUid) {
  {
    ScopedEnv xdg("XDG_RUNTIME_DIR", std::nullopt);
    EXPECT_EQ(DefaultRuntimeDirForUid(1000), "/tmp/memoffload-1000");
  }
  ScopedEnv empty_xdg("XDG_RUNTIME_DIR", "");
  EXPECT_EQ(DefaultRuntimeDirForUid(65534), "/tmp/memoffload-65534");
}

TEST(RuntimeDir, SocketPathsAreInsideTheRuntimeDir) {
  EXPECT_EQ(BrokerSocketPath("/x"), "/x/broker.sock");
  EXPECT_EQ(GrpcSocketPath("/x"), "/x/memoffload.sock");
}

}  // namespace
}  // namespace memoffload
