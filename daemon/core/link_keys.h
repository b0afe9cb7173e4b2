// LinkKeys: the node's replication secret and the per-job keys derived from
// it (docs/checkpoints.md, "The link between nodes").
//
// The operator provisions one cluster secret, the same on every node, in a
// file only the daemon's user can read ([replication] key_file; under
// systemd a LoadCredential= file, on Kubernetes a Secret mounted 0400). Its
// lines are `KEY_ID HEX_SECRET` (at least 32 bytes of secret; '#' starts a
// comment): the first line's key is the one ranks connect with, every
// line's is accepted, so a secret is rotated by adding the new one second on
// every node, then moving it first, then removing the old one (SIGHUP
// re-reads the file).
//
// A job's key is HKDF-SHA256 (OpenSSL's EVP_KDF) of the secret over the
// label "memoffload-link-v1" and the length-prefixed uid and job id: ranks of
// one uid and job id get the same key on every node, and no other uid's
// ranks can get it (the broker hands a session the keys of its own uid,
// from SO_PEERCRED, and of its hello's job id). One compromised daemon
// exposes every uid's keys; pods that share a uid share keys.
//
// Thread-safe (its own mutex): the broker derives while SIGHUP reloads.
#ifndef MEMOFFLOAD_DAEMON_CORE_LINK_KEYS_H_
#define MEMOFFLOAD_DAEMON_CORE_LINK_KEYS_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "memoffload/common/status.h"

namespace memoffload::daemon {

inline constexpr char kLinkKeyLabel[] = "memoffload-link-v1";
inline constexpr size_t kLinkKeyBytes = 32;
inline constexpr size_t kMinLinkSecretBytes = 32;
inline constexpr size_t kMaxLinkKeyIdBytes = 64;

struct LinkSecret {
  std::string id;
  std::string secret;  // raw bytes
};

struct DerivedLinkKey {
  std::string id;
  std::string key;  // kLinkKeyBytes raw bytes
};

// The secrets of `text` (a key file's contents); INVALID_ARGUMENT naming the
// line that is wrong.
Result<std::vector<LinkSecret>> ParseLinkSecrets(const std::string& text);

// HKDF-SHA256(secret, info = label, len(uid) uid, len(job) job), 32 bytes.
Result<std::string> DeriveLinkKey(const std::string& secret, uid_t uid, const std::string& job_id);

class LinkKeys {
 public:
  // `required`: a node without a key file refuses replication rather than
  // let its ranks fall back to a key published in the job's store.
  explicit LinkKeys(bool required = false) : required_(required) {}

  // Reads `path` ("": no key file): it must be a regular file, owned by the
  // daemon's uid (or root), not readable or writable by group or others,
  // reached only through directories and symlinks of root's or the
  // daemon's. `systemd_credential`: systemd's copy in $CREDENTIALS_DIRECTORY,
  // which may carry an ACL for the service's user (group bits show its
  // mask) in a dir only the service reads: others' bits alone are checked.
  // On an error nothing changes.
  Status Load(const std::string& path, bool systemd_credential = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  void SetRequired(bool required) ABSL_LOCKS_EXCLUDED(mu_);

  // The keys of (uid, job id), the one to connect with first. NOT_FOUND
  // without a key file (ranks may use the job's store), FAILED_PRECONDITION
  // when one is required, or without a job id.
  Result<std::vector<DerivedLinkKey>> KeysFor(uid_t uid, const std::string& job_id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The key ids loaded, first first ("" when none): for the start-up log.
  std::string Ids() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::vector<LinkSecret> secrets_ ABSL_GUARDED_BY(mu_);
  std::string path_ ABSL_GUARDED_BY(mu_);
  bool required_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_CORE_LINK_KEYS_H_
