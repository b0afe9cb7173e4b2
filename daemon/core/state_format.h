// The node's state as it outlives the daemon process: the formats of the
// journal and the snapshot (docs/deploy.md, "Restarts keep the node").
//
// What is kept: every committed checkpoint region (its job, name, extents,
// used bytes, per-extent CRC32Cs, TTL and commit time), the node's
// instance_id and the arena's layout. A take-over's snapshot (v2) also
// carries the live sessions (their peer, hello, token, groups, placed
// blocks, the regions they were writing and those they had open), which the
// new daemon resumes; a restart still ends sessions, so the journal and the
// stored snapshot hold none.
//
// Journal (one memfd, fixed size): a 64-byte header (magic, version, the
// first sequence number, instance_id, layout, the writing daemon's
// generation, zero before it was added; its own CRC32C), then records,
// 8-byte aligned: payload length (u32), CRC32C (u32) of everything after it
// through the payload, sequence number (u64), type (u16), 6 zero bytes,
// payload. Records are appended in sequence, one per region committed or
// deleted, before the commit is answered; a record cut short by a SIGKILL
// fails its CRC and ends the readable prefix there.
//
// Snapshot (one sealed memfd, written whole): magic, version, the last
// sequence number it includes, instance_id, layout, the regions, (v2) the
// sessions, and a CRC32C of all of it. A snapshot without sessions is
// written as v1, which a daemon of either version reads.
//
// Integers are little-endian. Every decoder bounds every length by the bytes
// it has (fuzzed: tests/fuzz/fuzz_state.cc). A newer version than this code
// reads is refused with FAILED_PRECONDITION naming both versions.
#ifndef MEMOFFLOAD_DAEMON_STATE_FORMAT_H_
#define MEMOFFLOAD_DAEMON_STATE_FORMAT_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "memoffload/common/status.h"
#include "memoffload/shared_mem/extent.h"

namespace memoffload::daemon {

// The newest version this code writes and reads. v2: sessions.
inline constexpr uint32_t kStateFormatVersion = 2;
inline constexpr size_t kJournalHeaderBytes = 64;
inline constexpr size_t kJournalRecordHeaderBytes = 24;
// Bounds a decoder holds a record to (far above anything the daemon writes).
inline constexpr uint32_t kMaxStateString = 4096;
inline constexpr uint32_t kMaxStateExtents = 1 << 20;

struct ArenaLayout {
  uint64_t capacity_bytes = 0;
  uint64_t chunk_bytes = 0;
  uint32_t page_bytes = 0;
  uint32_t chunk_count() const {
    return chunk_bytes == 0
               ? 0
               : static_cast<uint32_t>((capacity_bytes + chunk_bytes - 1) / chunk_bytes);
  }
  bool operator==(const ArenaLayout& o) const {
    return capacity_bytes == o.capacity_bytes && chunk_bytes == o.chunk_bytes &&
           page_bytes == o.page_bytes;
  }
};

// A committed region as kept.
struct RegionRecord {
  uid_t uid = 0;
  std::string job_id;
  std::string tenant;
  std::string name;
  uint64_t used_bytes = 0;
  uint64_t ttl_ms = 0;
  double committed_unix = 0;
  std::vector<Extent> extents;
  std::vector<uint32_t> extent_crc32c;  // empty: saved without checksums
  uint64_t held_bytes() const;
};
using RegionKey = std::tuple<uid_t, std::string, std::string>;  // uid, job id, name
inline RegionKey KeyOf(const RegionRecord& r) { return {r.uid, r.job_id, r.name}; }

// A live session as a take-over hands it on (snapshot v2).
struct GroupRecord {
  uint64_t id = 0;
  uint16_t state = 0;  // GroupState
  uint64_t used_bytes = 0;
  std::vector<Extent> extents;
  std::vector<uint32_t> extent_crc32c;
};
struct SessionRecord {
  uint64_t id = 0;
  std::string token;
  uid_t uid = 0;
  gid_t gid = 0;
  int32_t pid = 0;
  std::string job_id;
  int32_t rank = -1;
  int32_t local_rank = -1;
  uint64_t max_bytes = 0;
  uint64_t job_max_bytes = 0;
  uint16_t kind = 0;  // SessionKind
  uint64_t limit_bytes = 0;
  std::vector<GroupRecord> groups;
  std::vector<RegionRecord> writing;  // regions it was writing (not committed)
  std::vector<std::string> opened;    // its job's regions it had open, once per open
  // Regions of its job deleted while it had them open (hidden, freed when
  // their last reader closes), once per open.
  std::vector<RegionRecord> deleted_open;
};
inline constexpr uint32_t kMaxStateSessions = 1 << 16;
// A chunk's tenant (per uid or per job) in a snapshot with sessions: the
// chunks their processes map stay their tenants' until they resume.
struct ChunkOwnerRecord {
  uint32_t chunk = 0;
  std::string tenant;
  uid_t uid = 0;
};

enum class JournalRecordType : uint16_t { kRegionCommitted = 1, kRegionDeleted = 2 };

// The encoders (what the daemon writes).
// `generation`: the writing daemon's (StateStore's), which its record of
// the chunks handed out carries too (app/handed_chunks.h); 0: none.
std::string EncodeJournalHeader(const ArenaLayout& layout, uint64_t instance_id, uint64_t first_seq,
                                uint64_t generation = 0);
std::string EncodeRegionCommitted(uint64_t seq, const RegionRecord& region);
std::string EncodeRegionDeleted(uint64_t seq, const RegionKey& key);

struct SnapshotContents {
  uint32_t version = kStateFormatVersion;
  uint64_t last_seq = 0;  // the journal records it includes: every one up to this
  uint64_t instance_id = 0;
  ArenaLayout layout;
  std::map<RegionKey, RegionRecord> regions;
  // v2: the sessions to resume (a take-over's, or a SIGTERM's with a
  // state store) and the chunks' owners.
  std::vector<SessionRecord> sessions;
  std::vector<ChunkOwnerRecord> owners;
};
std::string EncodeSnapshot(const SnapshotContents& snapshot);

// The decoders. A snapshot is whole or refused (DATA_LOSS for a bad CRC or
// a malformed body, FAILED_PRECONDITION for a newer version).
Result<SnapshotContents> DecodeSnapshot(const void* data, size_t size);

struct JournalEntry {
  uint64_t seq = 0;
  JournalRecordType type = JournalRecordType::kRegionCommitted;
  RegionRecord region;  // kRegionDeleted: uid, job_id and name only
};
struct JournalContents {
  uint64_t first_seq = 0;
  uint64_t instance_id = 0;
  ArenaLayout layout;
  uint64_t generation = 0;            // of the daemon that wrote it (0: an older one)
  std::vector<JournalEntry> entries;  // the readable prefix, in sequence
  size_t end_offset = 0;              // where the next record goes
  std::string stopped;                // why reading stopped early, "" at a clean end
};
// The header must be whole (DATA_LOSS, or FAILED_PRECONDITION for a newer
// version); the records are read up to the first that is torn, fails its
// CRC or breaks the sequence (`stopped` says which, and where).
Result<JournalContents> DecodeJournal(const void* data, size_t size);

// The state a start rebuilds: the snapshot (if any), then the journals'
// records after it, in sequence; a gap ends the replay.
struct ReplayedState {
  bool found = false;  // a snapshot or a journal was there
  uint64_t instance_id = 0;
  ArenaLayout layout;
  uint64_t last_seq = 0;
  std::map<RegionKey, RegionRecord> regions;
  std::vector<SessionRecord> sessions;  // to resume (a snapshot's)
  std::vector<ChunkOwnerRecord> owners;
  uint64_t journal_records = 0;    // replayed after the snapshot
  std::vector<std::string> notes;  // what was skipped, and why
};
ReplayedState Replay(const SnapshotContents* snapshot,
                     const std::vector<JournalContents>& journals);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_STATE_FORMAT_H_
