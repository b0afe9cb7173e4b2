// memoffload::client::Client: one training process's session with memoffloadd.
//
// Attach() connects to the daemon's broker socket, receives the chunk fds and
// maps them, and opens the gRPC channel. The broker connection stays open for
// the Client's lifetime: destroying the Client (or the process dying) ends
// the session, and the daemon reclaims every group it still holds.
//
// Group ids are chosen by the caller and scoped to this session. Extents
// returned by Reserve are writable until Commit; extents returned by Prefetch
// are readable until Release. Thread-safe: RPC methods may be called from
// several threads at once.
#ifndef MEMOFFLOAD_CLIENT_CLIENT_H_
#define MEMOFFLOAD_CLIENT_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memoffload/shared_mem/extent.h"
#include "memoffload/shared_mem/status.h"

namespace memoffload::client {

struct AttachOptions {
  // Runtime dir of the daemon; "" means $MEMOFFLOAD_RUNTIME_DIR or the default.
  std::string runtime_dir;
  std::string job_id;  // printable ASCII, <= 128 bytes
  int32_t rank = -1;
  int32_t local_rank = -1;
  uint64_t max_bytes = 0;      // ask for a lower session limit; 0: daemon default
  uint64_t job_max_bytes = 0;  // ask for a lower limit for the whole job; 0: default
  // Fill page tables of every chunk at attach (slower attach, faster first
  // write); otherwise pages are mapped on first touch.
  bool populate = false;
  int rpc_timeout_ms = 30000;
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

  // Copies host bytes into / out of the byte stream formed by `extents` in
  // order, starting `offset` bytes into it. INVALID_ARGUMENT when the range
  // does not fit or an extent is not inside a mapped chunk.
  Status Write(const std::vector<Extent>& extents, uint64_t offset, const void* src,
               uint64_t length);
  Status Read(const std::vector<Extent>& extents, uint64_t offset, void* dst,
              uint64_t length) const;

  // Address of an extent's first byte in this process, or nullptr when the
  // extent is not inside a mapped chunk.
  uint8_t* Address(const Extent& extent) const;

  uint64_t session_id() const;
  uint64_t page_bytes() const;
  uint64_t session_limit_bytes() const;
  uint32_t chunk_count() const;
  const std::string& runtime_dir() const;

 private:
  class Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_CLIENT_H_
