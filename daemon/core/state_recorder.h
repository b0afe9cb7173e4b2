// StateRecorder: what SessionTable tells the store that keeps the node's
// state across a restart (app/state_store.h), under the table's lock, before
// the change is answered: a region committed or deleted, a chunk given a new
// memfd, chunks about to be handed to a process. Implementations never call back into the table.
#ifndef MEMOFFLOAD_DAEMON_STATE_RECORDER_H_
#define MEMOFFLOAD_DAEMON_STATE_RECORDER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "core/state_format.h"
#include "memoffload/shared_mem/chunk.h"

namespace memoffload::daemon {

class StateRecorder {
 public:
  virtual ~StateRecorder() = default;
  virtual void RegionCommitted(const RegionRecord& region) = 0;
  virtual void RegionDeleted(const RegionKey& key) = 0;
  // Chunk `index` now has `backing` (the old one is retired).
  virtual void BackingReplaced(uint32_t index, const std::shared_ptr<const Chunk>& backing) = 0;
  // The fds of `chunks` are about to leave for a session's process (Attach,
  // Grant): a process may map their memory from now on.
  virtual void ChunksHanded(const std::vector<uint32_t>& chunks) = 0;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_STATE_RECORDER_H_
