// PersistRegion: a committed checkpoint region written to a file, straight
// from this process's mapping of the arena (no staging copy), for the
// durable tier of checkpoints (memoffload.torch.checkpoint's persist).
//
// The file is the region's bytes at the same offsets, so an item's place in
// the region is its place in the file. The bytes are checked against the
// region's CRC32Cs as they are written (a damaged region is never
// persisted: DATA_LOSS, and the file is removed); large sequential writes,
// O_DIRECT where the file system takes it (the few unaligned bytes at the
// end go through the page cache), then fsync. A duty cycle throttles it: it
// sleeps so that its busy time is at most `share` of the time it takes, so
// a training step that shares the core and the disk is not slowed much.
//
// Runs on the calling thread (callers run it on one of their own, without
// Python's GIL); blocking; thread-safe as far as RegionStore::Open is.
#ifndef MEMOFFLOAD_CLIENT_REGION_PERSIST_H_
#define MEMOFFLOAD_CLIENT_REGION_PERSIST_H_

#include <cstdint>
#include <string>

#include "memoffload/client/region_io.h"
#include "memoffload/common/status.h"

namespace memoffload::client {

struct PersistOptions {
  // Of one core's and the disk's time, in (0, 1]; 1 is unthrottled.
  double share = 1.0;
  uint64_t piece_bytes = 16ull << 20;  // per write
  bool direct = true;                  // try O_DIRECT
};

struct PersistStats {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;  // of the whole file
  bool direct = false;  // O_DIRECT was used for the aligned bytes
  double busy_seconds = 0;
  double seconds = 0;
};

// Writes committed region `name` of `store` to a new file `file_name` (one
// path component, created 0600 with O_EXCL, never through a symlink) in the
// directory open as `dir_fd`, and fsyncs it (not the directory).
Result<PersistStats> PersistRegion(RegionStore& store, const std::string& name, int dir_fd,
                                   const std::string& file_name, const PersistOptions& options);
// The same from a region already open: opened with verify_as_read, before
// the persist's turn, so that deleting the region meanwhile (retention)
// keeps its bytes until the reader closes. The reader is left open.
Result<PersistStats> PersistRegion(RegionReader& reader, int dir_fd, const std::string& file_name,
                                   const PersistOptions& options);

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_REGION_PERSIST_H_
