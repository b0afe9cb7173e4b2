// HostBlocks: long-lived blocks of arena memory for this process's own use
// (a rank's model parameters and optimizer state), over one session of
// memoffloadd. Each block is one group of the session, reserved as a single
// extent (contiguous, so at most one chunk) and committed at once: the
// daemon counts it against the session, job and uid like any group (quotas,
// `memoffloadctl sessions`, metrics) and frees it the moment the process
// dies. Sizes are rounded to the arena's page only, never to a power of two.
//
// Blocks stay readable and writable while this object lives, even if the
// daemon restarts meanwhile (the process keeps its mapping of the chunks;
// only the daemon's accounting is lost). Thread-safe.
#ifndef MEMOFFLOAD_CLIENT_HOST_BLOCKS_H_
#define MEMOFFLOAD_CLIENT_HOST_BLOCKS_H_

#include <cstdint>
#include <memory>

#include "memoffload/client/client.h"
#include "memoffload/common/status.h"

namespace memoffload::client {

struct HostBlock {
  uint64_t group_id = 0;
  uint8_t* address = nullptr;  // in this process's mapping of the chunk
  uint32_t chunk = 0;
  uint64_t size_bytes = 0;  // as asked
  uint64_t held_bytes = 0;  // page-rounded: what the daemon counts
};

struct HostBlockStats {
  uint64_t blocks = 0;
  uint64_t size_bytes = 0;  // as asked
  uint64_t held_bytes = 0;  // what the daemon counts
  uint64_t refused = 0;     // Allocate calls that failed
};

class HostBlocks {
 public:
  explicit HostBlocks(std::shared_ptr<Client> client);
  // Frees every block still allocated (a failure is logged).
  ~HostBlocks();
  HostBlocks(const HostBlocks&) = delete;
  HostBlocks& operator=(const HostBlocks&) = delete;

  // A block of `size_bytes` (> 0). The daemon's codes come through:
  // RESOURCE_EXHAUSTED when a quota or the arena refuses it (its message
  // names the limit), including a block larger than a chunk, which can
  // never be contiguous; UNAVAILABLE when the session is lost.
  Result<HostBlock> Allocate(uint64_t size_bytes);
  // Gives the block back. NOT_FOUND for a block this object did not hand out
  // (or freed already).
  Status Free(uint64_t group_id);

  // Whether `address` lies in a block this object handed out and has not
  // freed.
  bool Holds(const void* address) const;

  HostBlockStats stats() const;
  const std::shared_ptr<Client>& client() const { return client_; }

 private:
  // The blocks handed out and the counters, under their own lock (the .cc:
  // the public headers of the client need no abseil).
  class Book;
  const std::shared_ptr<Client> client_;
  const std::unique_ptr<Book> book_;
};

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_HOST_BLOCKS_H_
