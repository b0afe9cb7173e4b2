// MapKept: fills this process's page tables for the chunks a restart or a
// take-over kept, after the daemon serves.
//
// A kept chunk's pages exist (the memfd held them while no daemon ran); the
// new daemon only lacks their page-table entries, which on 4 KiB pages cost
// about as much as a pre-fault per GiB. Filled before `ready`, that cost
// grew every restart's pause with the arena; filled after, the daemon
// touches a kept page lazily (a minor fault) until this pass has been by.
// The pass only reads (MADV_POPULATE_READ, else a read per page): the
// chunks' processes write them meanwhile. Pages are locked as they are
// mapped where the chunk is locked on fault (MLOCK_ONFAULT), so the arena
// ends locked as a fresh one does.
#ifndef MEMOFFLOAD_DAEMON_KEPT_MAPPING_H_
#define MEMOFFLOAD_DAEMON_KEPT_MAPPING_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "memoffload/shared_mem/chunk.h"

namespace memoffload::daemon {

struct KeptMapping {
  uint32_t chunks = 0;  // asked for
  uint64_t bytes = 0;   // mapped
  double seconds = 0;
  uint64_t thp_bytes = 0;  // of those, on 2 MiB shared-memory THP mappings
  bool stopped = false;    // `stop` came first
};

// Maps `chunks` on `threads` threads in 64 MiB pieces (one huge page per
// call); skips those gone meanwhile (a chunk that changed tenant: its old
// backing is its old holders' alone); returns early once `stop` is set.
KeptMapping MapKept(const std::vector<std::weak_ptr<const Chunk>>& chunks, int threads,
                    const std::atomic<bool>& stop);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_KEPT_MAPPING_H_
