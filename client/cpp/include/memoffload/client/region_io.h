// RegionStore, RegionWriter and RegionReader: checkpoint regions as byte
// streams over one session of memoffloadd (Client's CreateRegion ...
// ListRegions), for memoffload._C's classes of the same names.
//
// A RegionWriter appends bytes to a new region, computing each extent's
// CRC32C as it copies (on the bytes just written, while they are in cache),
// and commits it; a RegionReader copies bytes out of a committed region,
// checking its checksums at open or as it reads (VerifiedRead). Bytes that
// have no host address (a device tensor's) come through a DeviceCopy, which
// copies them straight into the region's mapping, extent by extent.
//
// Each writer and reader keeps the session (the shared Client) it was made
// in: RegionStore::Close lets go of it, and the session ends once no writer
// or reader of it is alive either. Not thread-safe; calls may block on RPCs.
#ifndef MEMOFFLOAD_CLIENT_REGION_IO_H_
#define MEMOFFLOAD_CLIENT_REGION_IO_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "memoffload/client/client.h"
#include "memoffload/client/verified_read.h"
#include "memoffload/common/status.h"

namespace memoffload::client {

struct RegionStoreOptions {
  std::string runtime_dir;  // "" means $MEMOFFLOAD_RUNTIME_DIR or the default
  // Required: the same for every rank and for the job that restarts from the
  // checkpoint (regions belong to the session's uid and job id).
  std::string job_id;
  int32_t rank = -1;
  bool checksums = true;  // writers store a CRC32C per extent
  int rpc_timeout_ms = 30000;
};

// Copies bytes [from, from + n) of a source with no host address (a device
// tensor) to dst, a host address inside the region's mapping, and returns
// once they are there.
using DeviceCopy = std::function<Status(uint64_t from, uint8_t* dst, uint64_t n)>;

class RegionWriter {
 public:
  // `reservation` as CreateRegion(name, ...) returned it on `client`.
  RegionWriter(std::shared_ptr<Client> client, std::string name, Reservation reservation,
               bool checksums);
  // A writer dropped uncommitted aborts, so the space comes back now rather
  // than when the session ends; a failure is logged.
  ~RegionWriter();
  RegionWriter(const RegionWriter&) = delete;
  RegionWriter& operator=(const RegionWriter&) = delete;

  // Copies `size_bytes` bytes at `data` to the end of the region; returns
  // the offset they start at. OUT_OF_RANGE when they pass the region's size;
  // FAILED_PRECONDITION once committed or aborted.
  Result<uint64_t> Append(const void* data, uint64_t size_bytes);
  // The same for `size_bytes` bytes that `copy` brings in.
  Result<uint64_t> Append(uint64_t size_bytes, const DeviceCopy& copy);
  // Room for `size_bytes` bytes (> 0) filled in place by the caller: the
  // next offset aligned to `align` (a power of two) where they fit in one
  // extent (contiguous), skipping what is left of the current extent if they
  // do not. Sets *address to their first byte in this process's mapping and
  // returns their offset; the skipped bytes count as written. OUT_OF_RANGE
  // when no extent left has room; FAILED_PRECONDITION once committed or
  // aborted. A writer that placed anything computes its checksums at Commit,
  // from the mapping.
  Result<uint64_t> Place(uint64_t size_bytes, uint64_t align, uint8_t** address);
  // Zero-copy filling, for a socket to read straight into the region: the
  // mapped spans of the next `size_bytes` bytes (one per extent they touch),
  // to be filled by the caller, then Filled(size_bytes): checksums them in
  // one pass, extends the extents' checksums, counts them written, and
  // returns their CRC32C as one stream. OUT_OF_RANGE past the region's size.
  Status Expose(uint64_t size_bytes, std::vector<ArenaSpan>* spans);
  Result<uint32_t> Filled(uint64_t size_bytes);
  // Makes the region visible to the job (with the extents' checksums),
  // under `rename_to` when that is not empty; returns the bytes written.
  // FAILED_PRECONDITION once committed or aborted.
  Result<uint64_t> Commit(const std::string& rename_to = "");
  // Deletes the uncommitted region; nothing once committed or aborted.
  Status Abort();

  const std::string& name() const { return name_; }
  const std::shared_ptr<Client>& client() const { return client_; }
  uint64_t size_bytes() const { return reservation_.reserved_bytes; }
  uint64_t written() const { return written_; }

 private:
  enum class State { kOpen, kCommitted, kAborted };
  Status CheckOpen() const;
  Result<uint64_t> AppendFrom(const uint8_t* src, uint64_t size_bytes, const DeviceCopy* copy);
  Status Copy(const uint8_t* src, uint64_t length, const DeviceCopy* copy);
  Status CopyIntoExtent(size_t extent, uint64_t in_extent, uint64_t n, const uint8_t* src,
                        uint64_t from, const DeviceCopy* copy);
  Status NotMapped(uint32_t chunk) const;
  Status CheckRoom(uint64_t size_bytes) const;

  std::shared_ptr<Client> client_;
  const std::string name_;
  const Reservation reservation_;
  const bool checksums_;
  uint64_t written_ = 0;
  std::vector<uint32_t> crc_;  // running CRC32C per extent
  bool placed_ = false;        // Place was used: checksums come from the mapping
  State state_ = State::kOpen;
};

class RegionReader {
 public:
  // `placement` as OpenRegion(name, ...) returned it on `client`.
  // verify_as_read: the region's checksums (if any) were not checked at
  // open; reads check them as they copy, and VerifyRest checks what no
  // in-order read covered.
  RegionReader(std::shared_ptr<Client> client, std::string name, Placement placement,
               bool verify_as_read);
  // Closes the region unless Close did; a failure is logged.
  ~RegionReader();
  RegionReader(const RegionReader&) = delete;
  RegionReader& operator=(const RegionReader&) = delete;

  // Copies [offset, offset + length) of the region to dst. OUT_OF_RANGE past
  // the region's bytes, FAILED_PRECONDITION once closed, DATA_LOSS on a
  // checksum mismatch (verify_as_read).
  Status Read(uint64_t offset, void* dst, uint64_t length);
  // The same into a new string (allocated once the range is checked).
  Result<std::string> Read(uint64_t offset, uint64_t length);
  // The same range where it lies in the arena, without a copy (VerifiedRead's
  // View): checked as Read checks it, `crc` the range's CRC32C. The spans
  // stay valid until Close.
  Status View(uint64_t offset, uint64_t length, std::vector<ArenaSpan>* spans, uint32_t* crc);
  // With verify_as_read: checks what no in-order read checksummed.
  Status VerifyRest();
  // Closes the region (its space may go once deleted); nothing if closed.
  Status Close();

  const std::string& name() const { return name_; }
  uint64_t size_bytes() const { return read_.placement().used_bytes; }

 private:
  Status CheckRange(uint64_t offset, uint64_t length) const;

  std::shared_ptr<Client> client_;
  const std::string name_;
  VerifiedRead read_;
  bool closed_ = false;
};

class RegionStore {
 public:
  // Attaches a session. INVALID_ARGUMENT without a job id.
  static Result<std::unique_ptr<RegionStore>> Attach(const RegionStoreOptions& options);

  // A new region of size_bytes (ttl_seconds 0: the daemon's regions.ttl).
  Result<std::unique_ptr<RegionWriter>> Create(const std::string& name, uint64_t size_bytes,
                                               double ttl_seconds = 0);
  // A committed region. verify: check its checksums before returning (one
  // pass over it); verify_as_read: check them as reads copy the bytes out
  // instead (RegionReader::VerifyRest for the rest).
  Result<std::unique_ptr<RegionReader>> Open(const std::string& name, bool verify = true,
                                             bool verify_as_read = false);
  // Bytes freed (0 while another session still has it open).
  Result<uint64_t> Delete(const std::string& name);
  // The job's committed regions whose name starts with prefix, by name.
  Result<std::vector<RegionInfo>> List(const std::string& prefix = "");

  // Lets go of the session (see the top of this file). Every call but
  // closed() is then FAILED_PRECONDITION.
  void Close() { client_.reset(); }
  bool closed() const { return client_ == nullptr; }
  Result<uint64_t> session_id() const;
  // The daemon instance the session is on (random per daemon start): which
  // node's daemon this is, for checkpoints that span nodes.
  Result<uint64_t> instance_id() const;
  // The session's job's replication keys (Client::ReplicationKeys).
  Result<Client::LinkKeys> ReplicationKeys();
  // The session itself, for what streams regions (link.h).
  const std::shared_ptr<Client>& client() const { return client_; }

 private:
  RegionStore(std::shared_ptr<Client> client, bool checksums)
      : checksums_(checksums), client_(std::move(client)) {}
  Status CheckLive() const;

  const bool checksums_;
  std::shared_ptr<Client> client_;
};

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_REGION_IO_H_
