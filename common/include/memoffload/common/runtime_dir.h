// Where the daemon's sockets live. One knob (--runtime-dir for the daemon,
// MEMOFFLOAD_RUNTIME_DIR for clients) moves both sockets.
#ifndef MEMOFFLOAD_SHARED_MEM_RUNTIME_DIR_H_
#define MEMOFFLOAD_SHARED_MEM_RUNTIME_DIR_H_

#include <cstdint>
#include <string>

namespace memoffload {

inline constexpr const char kRuntimeDirEnv[] = "MEMOFFLOAD_RUNTIME_DIR";
inline constexpr const char kSystemRuntimeDir[] = "/run/memoffload";
inline constexpr const char kBrokerSocketName[] = "broker.sock";
inline constexpr const char kGrpcSocketName[] = "memoffload.sock";
// The error_details of every non-OK status the daemon's service returns, so
// that a client tells the daemon's own UNAVAILABLE ("shutting down") from
// gRPC's (no daemon answered).
inline constexpr const char kDaemonStatusDetails[] = "memoffloadd";

// The daemon's default runtime dir when nothing is configured:
// /run/memoffload for root, else the per-user dir ($XDG_RUNTIME_DIR/memoffload,
// else /tmp/memoffload-$UID).
std::string DefaultRuntimeDir();
// DefaultRuntimeDir() as it resolves for effective uid `uid` (for tests).
std::string DefaultRuntimeDirForUid(uint32_t uid);

// How a client's runtime dir was found; the trust rules differ (see
// memoffload/client/daemon_trust.h and docs/security.md).
enum class RuntimeDirSource {
  kExplicit,  // the caller's argument or $MEMOFFLOAD_RUNTIME_DIR
  kSystem,    // /run/memoffload, whose broker socket exists
  kPerUser,   // $XDG_RUNTIME_DIR/memoffload or /tmp/memoffload-$UID
};

struct RuntimeDirChoice {
  std::string path;
  RuntimeDirSource source = RuntimeDirSource::kExplicit;
};

// The clients' discovery order (the Python package's runtime_dir_of is the
// same): `explicit_dir` if non-empty, else $MEMOFFLOAD_RUNTIME_DIR if set and
// non-empty, else /run/memoffload when its broker socket exists, else
// $XDG_RUNTIME_DIR/memoffload, else /tmp/memoffload-$EUID. The first candidate
// that applies is the answer: one that then fails verification is refused,
// never skipped for the next.
RuntimeDirChoice DiscoverRuntimeDir(const std::string& explicit_dir);
// DiscoverRuntimeDir with its inputs given (for tests).
RuntimeDirChoice DiscoverRuntimeDirFrom(const std::string& explicit_dir, const char* env_dir,
                                        bool system_broker_exists, const char* xdg_dir,
                                        uint32_t uid);

std::string BrokerSocketPath(const std::string& runtime_dir);
std::string GrpcSocketPath(const std::string& runtime_dir);

}  // namespace memoffload

#endif  // MEMOFFLOAD_SHARED_MEM_RUNTIME_DIR_H_
