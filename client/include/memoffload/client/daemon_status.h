// The daemon's status as plain values, for callers that must not see the
// generated protobuf types (the torch layer: pip wheels of torch carry their
// own protobuf headers, which do not match the ones our code is generated
// with). Same data as AdminClient::GetStatus.
#ifndef MEMOFFLOAD_CLIENT_DAEMON_STATUS_H_
#define MEMOFFLOAD_CLIENT_DAEMON_STATUS_H_

#include <cstdint>
#include <string>

#include "memoffload/shared_mem/status.h"

namespace memoffload::client {

struct DaemonStatus {
  std::string version;
  std::string runtime_dir;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint64_t committed_bytes = 0;
  uint64_t read_bytes = 0;
  uint64_t largest_free_extent_bytes = 0;
  uint32_t chunks = 0;
  uint64_t chunk_size_bytes = 0;
  uint32_t sessions = 0;
  uint64_t groups = 0;
  bool draining = false;
};

// GetStatus of the daemon at `runtime_dir` (resolved like
// AttachOptions::runtime_dir). UNAVAILABLE, naming the socket, when no daemon
// answers.
Result<DaemonStatus> QueryDaemonStatus(const std::string& runtime_dir, int timeout_ms = 5000);

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_DAEMON_STATUS_H_
