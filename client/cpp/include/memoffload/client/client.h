// memoffload::client::Client: one training process's session with memoffloadd.
//
// Attach() connects to the daemon's broker socket, maps the chunks this
// session's tenant owns, and opens the gRPC channel; chunks its reservations
// land in later are fetched over the broker connection and mapped on demand. The broker connection
// stays open for the Client's lifetime: destroying the Client (or the process dying) ends the
// session, and the daemon reclaims every group it still holds.
//
// Group ids are chosen by the caller and scoped to this session. Extents
// returned by Reserve are writable until Commit; extents returned by Prefetch
// are readable until Release. Thread-safe: RPC methods may be called from
// several threads at once.
#ifndef MEMOFFLOAD_CLIENT_CLIENT_H_
#define MEMOFFLOAD_CLIENT_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "memoffload/common/status.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/extent.h"

namespace memoffload::client {

struct AttachOptions {
  // Runtime dir of the daemon; "" means $MEMOFFLOAD_RUNTIME_DIR or the default.
  std::string runtime_dir;
  std::string job_id;  // printable ASCII, <= 128 bytes
  int32_t rank = -1;
  int32_t local_rank = -1;
  uint64_t max_bytes = 0;      // ask for a lower session limit; 0: daemon default
  uint64_t job_max_bytes = 0;  // ask for a lower limit for the whole job; 0: default
  // What the session is for (memoffloadctl sessions, status, metrics; the
  // state kind has its own share of the job's limit and is asked to leave
  // when the daemon drains: see leave_requested()).
  SessionKind kind = SessionKind::kOther;
  // How this process's page tables for a chunk get filled (the daemon has
  // already allocated, zeroed and locked every page; only mappings are
  // missing). Default: on first use, Write, Read and Address map the pages of
  // the range they are given with MADV_POPULATE_READ, tracked per 2 MiB
  // block, so mapping a chunk costs microseconds whatever its size and a
  // first write runs at ~0.75-0.85 (median 0.77 measured) of a memcpy into
  // faulted memory instead of ~0.3 with one write fault per page
  // (docs/arena.md). With populate, each
  // chunk's page tables are filled when it is mapped (MAP_POPULATE, ~0.1 s
  // per GiB on the attach/first-Reserve path). populate_on_first_use = false
  // leaves pages to fault one by one on touch (for benchmarks).
  bool populate = false;
  bool populate_on_first_use = true;
  int rpc_timeout_ms = 30000;
  // Integrity check: Commit sends a CRC32C of each extent's used bytes (read
  // from the arena, so call it once the data is in place), and Prefetch
  // verifies them, failing with DATA_LOSS naming group, session, chunk and
  // offset on a mismatch. Costs one extra pass over the data each way (see
  // docs/reliability.md).
  bool checksums = false;
};

struct ReserveOptions {
  bool single_extent = false;
  // Wait up to wait_timeout_ms (default: the client's rpc timeout; the
  // daemon caps it at quotas.max_wait) for space instead of failing at once.
  bool wait_for_space = false;
  int wait_timeout_ms = 0;
};

struct Reservation {
  std::vector<Extent> extents;
  uint64_t reserved_bytes = 0;
};

struct Placement {
  std::vector<Extent> extents;
  uint64_t used_bytes = 0;
  std::vector<uint32_t> extent_crc32c;  // empty unless committed with checksums
};

// Reported with Commit and Release so the daemon can export copy throughput.
struct CopyStats {
  uint64_t bytes = 0;
  double seconds = 0;
};

struct CommitInfo {
  uint64_t committed_bytes = 0;
  uint64_t returned_bytes = 0;
};

// A checkpoint region as ListRegions reports it.
struct RegionInfo {
  std::string name;
  uint32_t uid = 0;
  std::string job_id;
  std::string state;  // "writing" or "committed"
  uint64_t used_bytes = 0;
  uint64_t held_bytes = 0;
  double committed_unix = 0;
  double expires_in_seconds = 0;
  double ttl_seconds = 0;
  bool checksummed = false;
  uint32_t readers = 0;
};

class Client {
 public:
  static Result<std::unique_ptr<Client>> Attach(const AttachOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  Result<Reservation> Reserve(uint64_t group_id, uint64_t size_bytes,
                              const ReserveOptions& options = {});
  Result<CommitInfo> Commit(uint64_t group_id, uint64_t used_bytes, const CopyStats& copy = {});
  Result<Placement> Prefetch(uint64_t group_id);
  Status Release(uint64_t group_id, const CopyStats& copy = {});

  // Checkpoint regions (client_regions.cc): named byte ranges owned by this
  // session's (uid, job id), which must be explicit. CreateRegion's extents
  // are writable by this session until CommitRegion (the region vanishes if
  // the session ends first); CommitRegion makes it visible to every session
  // of the job, with the given per-extent CRC32Cs (ExtentChecksums; empty:
  // none) until DeleteRegion or its TTL (0: the daemon's regions.ttl).
  // OpenRegion's extents stay readable until CloseRegion (or the end of the
  // session), even if the region is deleted meanwhile; with checksums stored
  // it verifies them first (DATA_LOSS naming the region on a mismatch).
  // Regions do not survive a daemon restart.
  Result<Reservation> CreateRegion(const std::string& name, uint64_t size_bytes,
                                   double ttl_seconds = 0);
  // `rename_to` (non-empty): commit it under that name (ALREADY_EXISTS if the
  // job has one).
  Result<CommitInfo> CommitRegion(const std::string& name, uint64_t used_bytes,
                                  const std::vector<uint32_t>& extent_crc32c = {},
                                  const std::string& rename_to = "");
  Result<Placement> OpenRegion(const std::string& name, bool verify = true);
  Status CloseRegion(const std::string& name);
  // Bytes freed (0 while another session still has it open).
  Result<uint64_t> DeleteRegion(const std::string& name);
  // The job's committed regions whose name starts with prefix, by name.
  Result<std::vector<RegionInfo>> ListRegions(const std::string& prefix = "");
  // CRC32C of the first `used` bytes of each extent they touch, in order,
  // read from this process's mapping.
  Result<std::vector<uint32_t>> ExtentChecksums(const std::vector<Extent>& extents,
                                                uint64_t used) const;

  // Copies host bytes into / out of the byte stream formed by `extents` in
  // order, starting `offset` bytes into it. INVALID_ARGUMENT when the range
  // does not fit or an extent is not inside a mapped chunk.
  Status Write(const std::vector<Extent>& extents, uint64_t offset, const void* src,
               uint64_t length);
  Status Read(const std::vector<Extent>& extents, uint64_t offset, void* dst,
              uint64_t length) const;

  // Calls fn(address, done, n) over the pieces of [offset, offset + length)
  // of the byte stream formed by `extents`, in order: one piece per extent
  // the range touches, `address` its first byte in this process (its pages
  // mapped), `done` the bytes of the range before it. Stops at fn's first
  // error and returns it. INVALID_ARGUMENT when the range does not fit or an
  // extent is not inside a mapped chunk. Write and Read are this and a copy.
  using PieceFn = std::function<Status(uint8_t* address, uint64_t done, uint64_t n)>;
  Status ForEachPiece(const std::vector<Extent>& extents, uint64_t offset, uint64_t length,
                      const PieceFn& fn) const;

  // Address of an extent's first byte in this process, or nullptr when the
  // extent is not inside a mapped chunk. The extent's pages are mapped
  // (populated) before it returns, so writes through the pointer do not fault. Extents returned by
  // Reserve and Prefetch are always mapped.
  uint8_t* Address(const Extent& extent) const;

  // Maps the given chunks, asking the daemon for their fds if this process
  // has not got them yet. Chunks belong to one tenant at a time; the daemon
  // refuses another tenant's chunks with PERMISSION_DENIED. Reserve does this
  // itself; exposed for tests and tools.
  Status MapChunks(const std::vector<uint32_t>& chunks);

  uint64_t session_id() const;
  // The daemon instance this session is on (random per daemon start).
  uint64_t instance_id() const;

  // The job's keys for checkpoint replication between nodes, from the
  // daemon over the broker connection (for this process's uid, by
  // SO_PEERCRED, and the session's job id; never over gRPC): ids[0] and
  // keys[0] (32 bytes) are the key to connect with, every one is accepted.
  // NOT_FOUND when the daemon has no key file, FAILED_PRECONDITION when it
  // requires one it lacks or the session has no job id.
  struct LinkKeys {
    std::vector<std::string> ids;
    std::vector<std::string> keys;
  };
  Result<LinkKeys> ReplicationKeys();
  // How many times a daemon that took the node over (memoffloadd
  // --take-over) resumed this session: its calls wait through the take-over
  // and go on there, its groups and blocks where they were.
  uint64_t resumes() const;
  // True once the daemon ended this session (it restarted, or dropped the
  // broker connection) and no daemon that took the node over resumed it
  // (asked once per closed connection). Every call of a lost session that the daemon refuses
  // is UNAVAILABLE: attach a new Client. Release of a lost session's group is
  // OK (the daemon reclaimed it). Prefetch of a group committed in a lost
  // session is served from this process's own mapping when the daemon
  // instance that held it is gone (a restart: its memfds are then reachable
  // by no one else), with its checksums verified when it was committed with
  // them; the Placement's extents stay readable while this Client lives.
  bool session_lost() const;
  // True once the daemon asked this session to leave (a Notice on its broker
  // connection: it drains, and waits for the session's groups): the caller
  // moves what it keeps in the session's blocks elsewhere and destroys the
  // Client. Checks the connection without waiting; sticky.
  bool leave_requested() const;
  // Why, as the daemon said it ("" before a request).
  std::string leave_message() const;
  // Generation of the backing this process maps for `chunk`, 0 if unmapped.
  // A chunk that changes tenant gets a new backing (a new generation).
  uint64_t chunk_generation(uint32_t chunk) const;
  uint64_t page_bytes() const;
  uint64_t session_limit_bytes() const;
  uint32_t chunk_count() const;
  // Size of `chunk` as the attach reply gave it (the last chunk may be
  // smaller than the others); 0 for an unknown chunk.
  uint64_t chunk_size_bytes(uint32_t chunk) const;
  const std::string& runtime_dir() const;

 private:
  class Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_CLIENT_H_
