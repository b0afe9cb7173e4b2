// The records SessionTable keeps under its lock: a session and its groups,
// and checkpoint regions (what they hold is counted in the Ledger).
// Plain data with no lock of their own: only SessionTable (session_table.h)
// holds them, and its mu_ guards every one it owns.
#ifndef MEMOFFLOAD_DAEMON_SESSION_RECORDS_H_
#define MEMOFFLOAD_DAEMON_SESSION_RECORDS_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "core/ledger.h"
#include "core/session_types.h"
#include "core/tenant_chunks.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/extent.h"

namespace memoffload::daemon::session_records {

using Clock = std::chrono::steady_clock;

struct Group {
  GroupState state = GroupState::kReserved;
  std::vector<Extent> extents;
  uint64_t held_bytes = 0;              // sum of extent lengths
  uint64_t used_bytes = 0;              // valid bytes after Commit
  std::vector<uint32_t> extent_crc32c;  // optional, from Commit

  Clock::time_point committed_at;
};
using GroupMap = absl::node_hash_map<uint64_t, Group>;

struct Session {
  SessionGrant grant;
  Hello hello;
  std::string tenant;
  const TenantChunks::Owned* owned = nullptr;  // its tenant's; null with TenantMode::kNone
  std::string job_key;                         // "<uid>:<job_id>", its job in the Ledger
  Ledger::Account account;                     // what its groups hold, and its job and uid

  PeerCredentials peer;
  Clock::time_point opened_at;
  GroupMap groups;
  std::shared_ptr<RankSeries> series;  // may be null
  // Handed on by a take-over and not resumed yet by its process: its calls
  // are refused until then, and it is closed at resume_by.
  bool detached = false;
  Clock::time_point handed_at;
  Clock::time_point resume_by;
};

struct Region {
  std::string name;
  uid_t uid = 0;
  std::string job_id;
  std::string tenant;
  RegionState state = RegionState::kWriting;
  uint64_t writer = 0;            // the creating session, while writing
  std::vector<uint64_t> readers;  // sessions that opened it (once per open)
  bool deleted = false;           // hidden; freed when the last reader closes
  std::vector<Extent> extents;
  uint64_t held_bytes = 0;
  uint64_t used_bytes = 0;
  std::vector<uint32_t> extent_crc32c;
  std::chrono::milliseconds ttl{0};
  Clock::time_point expires_at;
  double committed_unix = 0;
  bool recovered = false;  // kept across a restart of the daemon
};
struct JobRegions {
  uint64_t held_bytes = 0;
  std::map<std::string, Region> by_name;
};
// What each uid's regions hold, over all its job ids (a uid names as many
// jobs as it likes): regions.uid_max_bytes and max_per_uid bound it. With
// tenants, chunk_bytes is what its regions keep from other tenants: the
// bytes of the chunks that hold any of its regions (a tenant is of one uid,
// so a chunk's regions are all of one uid).
struct UidRegions {
  uint64_t held_bytes = 0;
  uint64_t count = 0;
  uint64_t chunk_bytes = 0;
};

}  // namespace memoffload::daemon::session_records

#endif  // MEMOFFLOAD_DAEMON_SESSION_RECORDS_H_
