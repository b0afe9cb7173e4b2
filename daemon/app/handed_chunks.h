// HandedChunks: which arena chunks this daemon (and the ones before it) ever
// handed to a process, kept in the state store beside the chunks.
//
// Why: a start that keeps the arena must give new memory to every kept
// chunk an old process may still map (its bytes are that process's, and a
// new tenant would share them), and to no other: renewing a chunk costs a
// pre-fault and, until the store lets the old memfd go, the chunk twice. A
// chunk never handed out was only ever the daemon's, so it is kept as it is.
//
// One memfd (sealed against resizing): a 24-byte header (magic
// "MOHANDED", version u32 = 1, chunk count u32, the daemon's generation
// u64), then one byte per chunk, 1 once handed out. The daemon sets a byte
// before the chunk's fd leaves it, in place (a store into a shared
// mapping, which a SIGKILL keeps); a byte is never cleared while the chunk
// keeps its memory. The generation ties it to the journal its daemon writes
// (state_format.h): a start trusts the record only when the newest journal
// carries the same one, so a record left by a daemon that another (say an
// older version, which knows nothing of it) followed is not believed.
// Anything it cannot trust counts every chunk as handed out.
#ifndef MEMOFFLOAD_DAEMON_HANDED_CHUNKS_H_
#define MEMOFFLOAD_DAEMON_HANDED_CHUNKS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memoffload/common/status.h"
#include "memoffload/shared_mem/chunk.h"

namespace memoffload::daemon {

inline constexpr char kHandedChunksName[] = "mo-handed-chunks";

class HandedChunks {
 public:
  // A new record of handed.size() chunks, those `handed` set.
  static Result<std::unique_ptr<HandedChunks>> Create(const std::vector<bool>& handed,
                                                      uint64_t generation);
  int fd() const { return memfd_.fd(); }
  uint32_t chunk_count() const { return count_; }
  // Chunk `index` is being handed out (out of range: ignored).
  void Mark(uint32_t index);

 private:
  HandedChunks(Chunk memfd, uint32_t count) : memfd_(std::move(memfd)), count_(count) {}
  Chunk memfd_;
  const uint32_t count_;
};

// Makes the record in memfd `fd` one no start believes (generation 0): its
// chunks went to another daemon, which records what it hands out in its own.
Status DisownHandedChunksFd(int fd);

// The record in memfd `fd`, for an arena of `chunk_count` chunks written by
// the daemon of `generation` (the newest journal's; 0 never matches): one
// entry per chunk, true if handed out. An error says why it is not trusted.
Result<std::vector<bool>> ReadHandedChunks(int fd, uint32_t chunk_count, uint64_t generation);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_HANDED_CHUNKS_H_
