// ResolveRuntimeDir's order: the explicit argument, then
// MEMOFFLOAD_RUNTIME_DIR, then the default (/run/memoffload for root, else
// $XDG_RUNTIME_DIR/memoffload, else /tmp/memoffload-$UID).
#include "memoffload/shared_mem/runtime_dir.h"

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
  EXPECT_EQ(ResolveRuntimeDir("/from/arg"), "/from/arg");
}

TEST(RuntimeDir, EnvironmentVariableWhenNoArgument) {
  ScopedEnv env(kRuntimeDirEnv, "/from/env");
  ScopedEnv xdg("XDG_RUNTIME_DIR", "/run/user/1000");
  EXPECT_EQ(ResolveRuntimeDir(""), "/from/env");
}

TEST(RuntimeDir, EmptyEnvironmentVariableFallsBackToDefault) {
  ScopedEnv env(kRuntimeDirEnv, "");
  EXPECT_EQ(ResolveRuntimeDir(""), DefaultRuntimeDir());
}

TEST(RuntimeDir, UnsetEnvironmentVariableFallsBackToDefault) {
  ScopedEnv env(kRuntimeDirEnv, std::nullopt);
  ScopedEnv xdg("XDG_RUNTIME_DIR", "/run/user/4242");
  EXPECT_EQ(ResolveRuntimeDir(""), DefaultRuntimeDir());
  // The default is the one for this process's effective uid.
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
