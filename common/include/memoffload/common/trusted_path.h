// Resolving a path so that nobody but trusted users can change where it
// leads: the client's runtime dir (client/cpp daemon_trust.cc) and the
// daemon's replication key file (daemon/core/link_keys.cc).
#ifndef MEMOFFLOAD_COMMON_TRUSTED_PATH_H_
#define MEMOFFLOAD_COMMON_TRUSTED_PATH_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace memoffload {

// What stopped a walk (kNone: nothing).
struct TrustedPathProblem {
  enum class Kind {
    kNone,
    kMissing,        // `at` does not exist (errno `error`)
    kNotDirectory,   // `at` is on the way but not a directory
    kUntrustedDir,   // directory `at` belongs to `uid` or has `mode`
    kUntrustedLink,  // symlink `at` in `parent` belongs to `uid`
    kTooManyLinks,
    kError,  // a system call failed on `at` (errno `error`)
  };
  Kind kind = Kind::kNone;
  std::string at;
  std::string parent;
  uint32_t uid = 0;
  mode_t mode = 0;
  int error = 0;
};

// Whether a directory with `st_uid` and `st_mode` can be changed only by one
// of `trusted`: owned by one of them and not writable by group or others,
// unless sticky (/tmp: an entry there belongs to whoever made it). "" if so,
// else why not ("belongs to uid N" / "has mode 0777").
std::string TrustedDirProblem(uint32_t st_uid, mode_t st_mode,
                              const std::vector<uint32_t>& trusted);

// Resolves `path` (made absolute against the working directory) one
// component at a time, as the kernel would, and checks every directory it
// passes through and every symlink it follows: every directory is
// TrustedDirProblem-free and every symlink belongs to one of `trusted` (a
// symlink in a sticky dir belongs to whoever made it). So nobody else can
// change where the path leads. The last component is not checked (the
// caller has its own rules for it). Returns the path with no symlink, "."
// or "..", or "" with `problem` set.
std::string ResolveTrustedPath(const std::string& path, const std::vector<uint32_t>& trusted,
                               TrustedPathProblem* problem);

}  // namespace memoffload

#endif  // MEMOFFLOAD_COMMON_TRUSTED_PATH_H_
