// The daemon's status and its node-wide region listing as plain values, for
// callers that must not see the generated protobuf types (the torch layer:
// pip wheels of torch carry their own protobuf headers, which do not match
// the ones our code is generated with). Same data as AdminClient::GetStatus
// and AdminClient::ListRegions.
#ifndef MEMOFFLOAD_CLIENT_DAEMON_STATUS_H_
#define MEMOFFLOAD_CLIENT_DAEMON_STATUS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

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
  uint64_t groups = 0;  // placed state's blocks apart (state_blocks)
  bool draining = false;
  uint64_t state_blocks = 0;  // placed state (place_state): its blocks
  uint64_t state_bytes = 0;   // and their bytes
  // The arena's pages as the kernel gave them at start: bytes on 2 MiB
  // pages of hugetlbfs and of shared-memory THP, and in words.
  uint64_t hugetlb_bytes = 0;
  uint64_t thp_bytes = 0;
  std::string pages;
};

// GetStatus of the daemon at `runtime_dir` (resolved like
// AttachOptions::runtime_dir). UNAVAILABLE, naming the socket, when no daemon
// answers.
Result<DaemonStatus> QueryDaemonStatus(const std::string& runtime_dir, int timeout_ms = 5000);

// One region of the node listing (any uid, any job id).
struct NodeRegion {
  std::string name;
  uint32_t uid = 0;
  std::string job_id;
  bool committed = false;     // else being written
  double committed_unix = 0;  // 0 while written
};

struct NodeRegions {
  std::vector<NodeRegion> regions;  // by uid, job id, name
  uint32_t omitted = 0;             // past the daemon's reply limit
};

// Every region of the node whose name starts with `prefix` (the admin read
// of ListRegions, no session): what lets a user find the job ids their
// regions are under. UNAVAILABLE, naming the socket, when no daemon answers.
Result<NodeRegions> QueryNodeRegions(const std::string& runtime_dir, const std::string& prefix,
                                     int timeout_ms = 5000);

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_DAEMON_STATUS_H_
