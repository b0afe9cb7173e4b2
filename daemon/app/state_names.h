// The names a daemon gives what it keeps in its state store (state_store.h):
// an older or newer daemon finds its own by them.
#ifndef MEMOFFLOAD_DAEMON_STATE_NAMES_H_
#define MEMOFFLOAD_DAEMON_STATE_NAMES_H_

namespace memoffload::daemon {

inline constexpr char kChunkPrefix[] = "mo-chunk-";        // + the chunk's index
inline constexpr char kJournalPrefix[] = "mo-journal@";    // + its first record
inline constexpr char kSnapshotPrefix[] = "mo-snapshot@";  // + its last record
// The suffix of a snapshot that carries sessions (written at SIGTERM).
inline constexpr char kWithSessions[] = "+sessions";
// Put by a daemon that handed the node on and waits (after_handover = wait).
inline constexpr char kHandedOverName[] = "mo-handed-over";

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_STATE_NAMES_H_
