// Taking the kept state back at start (app/state_store.h), in two steps
// around the arena's build, and the one log line an operator reads.
#ifndef MEMOFFLOAD_DAEMON_STATE_RECOVERY_H_
#define MEMOFFLOAD_DAEMON_STATE_RECOVERY_H_

#include <memory>

#include "app/state_store.h"
#include "config/config.h"
#include "core/session_table.h"
#include "memory/arena.h"
#include "observe/metrics.h"

namespace memoffload::daemon {

// The arena as it was kept (`whose`: "kept", "serving daemon's") goes into
// *options; a warning says so when the configuration asks for another.
void UseKeptLayout(const ArenaLayout& kept, const DaemonConfig& config, const char* whose,
                   ArenaOptions* options);

// Before the arena is built: takes the stored fds and replays the state.
// The kept layout wins over the configured one (a warning says so): the
// new size applies once the store is released. *options gets the layout
// and the chunks to adopt. FAILED_PRECONDITION when the state is of a
// newer format (nothing is released: the newer daemon can still take it).
Result<StateLoad> LoadKeptState(const DaemonConfig& config, ArenaOptions* options);

// After the table is made, before serving: checks and places the kept
// regions, gives the chunks their owners (`owners`: a take-over's), gives
// every adopted chunk that ends with no region and no owner a new memfd
// (processes of the dead daemon may still map the old one, and it holds
// their bytes), logs what came back, and starts keeping state again (null
// when the store is "none"). *info gets the figures for the metrics.
// `took_over`: the state is a serving daemon's, handed on (the log says so);
// `owners_complete`: `owners` names every chunk ever handed to a process
// (TakeoverClient::owners_complete), so the others keep their memory.
Result<std::unique_ptr<StateStore>> ResumeKeptState(
    StateLoad* load, Arena* arena, SessionTable* table, int threads, uint64_t instance_id,
    const std::vector<SessionTable::ChunkOwner>& owners, bool took_over, bool owners_complete,
    MetricsInfo* info);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_STATE_RECOVERY_H_
