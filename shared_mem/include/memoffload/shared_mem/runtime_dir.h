// Where the daemon's sockets live. Daemon and clients resolve it the same way
// so that one knob (--runtime-dir / MEMOFFLOAD_RUNTIME_DIR) moves both sockets.
#ifndef MEMOFFLOAD_SHARED_MEM_RUNTIME_DIR_H_
#define MEMOFFLOAD_SHARED_MEM_RUNTIME_DIR_H_

#include <cstdint>
#include <string>

namespace memoffload {

inline constexpr const char kRuntimeDirEnv[] = "MEMOFFLOAD_RUNTIME_DIR";
inline constexpr const char kBrokerSocketName[] = "broker.sock";
inline constexpr const char kGrpcSocketName[] = "memoffload.sock";

// The default runtime dir when nothing is configured: /run/memoffload for
// root, else $XDG_RUNTIME_DIR/memoffload, else /tmp/memoffload-$UID.
std::string DefaultRuntimeDir();
// DefaultRuntimeDir() as it resolves for effective uid `uid` (for tests).
std::string DefaultRuntimeDirForUid(uint32_t uid);

// `explicit_dir` if non-empty, else $MEMOFFLOAD_RUNTIME_DIR if set and
// non-empty, else DefaultRuntimeDir().
std::string ResolveRuntimeDir(const std::string& explicit_dir);

std::string BrokerSocketPath(const std::string& runtime_dir);
std::string GrpcSocketPath(const std::string& runtime_dir);

}  // namespace memoffload

#endif  // MEMOFFLOAD_SHARED_MEM_RUNTIME_DIR_H_
