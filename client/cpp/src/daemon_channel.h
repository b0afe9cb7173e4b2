// DaemonChannel: the client's gRPC connection to a daemon it verified
// (internal to the client library).
//
// gRPC never dials a path here: each connection is a socket made by
// ConnectVerified (daemon_trust.h) over the runtime dir's resolved path, its
// peer checked, then handed to gRPC. When that connection breaks (the daemon
// restarted, or its edge closed it), the next Stub() verifies the runtime
// dir again from the start (systemd recreates /run/memoffload at each
// restart, so nothing held from before is relied on) and connects anew. A
// symlink flipped after the first check, or a dir replaced under a path
// another uid controls, is never followed (issue 38).
#ifndef MEMOFFLOAD_CLIENT_SRC_DAEMON_CHANNEL_H_
#define MEMOFFLOAD_CLIENT_SRC_DAEMON_CHANNEL_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "memoffload/client/daemon_trust.h"
#include "memoffload/common/status.h"
#include "memoffload/v1/memoffload.grpc.pb.h"

namespace memoffload::client {

class DaemonChannel {
 public:
  // Connects to `dir`'s gRPC socket (ConnectVerified).
  static Result<std::unique_ptr<DaemonChannel>> Open(const TrustedRuntimeDir& dir);
  ~DaemonChannel();
  DaemonChannel(const DaemonChannel&) = delete;
  DaemonChannel& operator=(const DaemonChannel&) = delete;

  // The stub of the current connection; when it broke, the runtime dir is
  // verified again and a new connection made first (its error otherwise:
  // UNAVAILABLE when no daemon is there, PERMISSION_DENIED when what is
  // there may not be trusted). Thread-safe; the stub stays usable by the
  // caller after another thread replaced it.
  Result<std::shared_ptr<v1::Offload::Stub>> Stub() ABSL_LOCKS_EXCLUDED(mu_);

  // Tells that a call on `stub` failed in gRPC's transport (UNAVAILABLE not
  // from the daemon): the next Stub() reconnects even if the socket still
  // looks open (gRPC may have given up on it on its own).
  void Failed(const std::shared_ptr<v1::Offload::Stub>& stub) ABSL_LOCKS_EXCLUDED(mu_);

  // The next Stub() connects anew: the session moved to the daemon that
  // took the node over, and the old one's connection may still answer.
  void Renew() ABSL_LOCKS_EXCLUDED(mu_);

  // The gRPC socket's resolved path, for messages (FromGrpc); the first
  // connection's (a reconnect may resolve another, named in its errors).
  const std::string& socket_path() const { return socket_path_; }
  // The runtime dir as last verified.
  TrustedRuntimeDir dir() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  DaemonChannel() = default;
  // A new connection over `dir_` (verified again when `reverify`).
  Status Connect(bool reverify) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the peer closed the current connection (poll on watch_fd_).
  bool Broken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::string socket_path_;  // set once in Open
  mutable absl::Mutex mu_;
  TrustedRuntimeDir dir_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<v1::Offload::Stub> stub_ ABSL_GUARDED_BY(mu_);
  // A duplicate of the socket gRPC owns, only polled: it tells a connection
  // the peer closed (or gRPC shut down) before a call is made on it.
  int watch_fd_ ABSL_GUARDED_BY(mu_) = -1;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;  // Failed() on the current stub
};

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_SRC_DAEMON_CHANNEL_H_
