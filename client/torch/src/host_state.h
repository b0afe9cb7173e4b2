// HostStateStore: CPU tensors in the node arena for a rank's long-lived
// host state (FSDP2's CPU-offloaded parameter shards, a CPU optimizer's
// states), over one session of memoffloadd of its own. Each tensor is one
// HostBlocks block: exact size (page-rounded only), counted by the daemon per
// session, job and uid, freed when the rank dies. A tensor's storage gives
// its block back when it dies, from whatever thread drops it last.
//
// With a CUDA engine, each chunk a block lands in is registered with the
// driver once (page-locked, so FSDP2's non_blocking copies stay
// asynchronous and tensor.is_pinned() is true), and unregistered before the
// session's mapping goes, after the store and its last tensor.
//
// Thread-safe.
#ifndef MEMOFFLOAD_TORCH_SRC_HOST_STATE_H_
#define MEMOFFLOAD_TORCH_SRC_HOST_STATE_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

#include "memoffload/client/client.h"
#include "memoffload/client/host_blocks.h"
#include "memoffload/common/status.h"
#include "memoffload/torch/copy_engine.h"

namespace memoffload::torch {

class HostStateStore {
 public:
  // Attaches a session; `use_cuda`: register the chunks with CUDA when a
  // driver and a device are there (no error without them).
  static Result<std::shared_ptr<HostStateStore>> Attach(const client::AttachOptions& options,
                                                        bool use_cuda);

  // A 1-D uint8 CPU tensor of `nbytes` (> 0) in the arena, its bytes
  // undefined. The daemon's refusals come through with their code.
  Result<at::Tensor> Empty(uint64_t nbytes);

  client::HostBlockStats stats() const { return blocks_->stats(); }
  // Whether `address` is in one of this store's live tensors' blocks.
  bool Holds(const void* address) const { return blocks_->Holds(address); }
  // Bytes of chunks holding blocks that CUDA did not register (0 without
  // CUDA: nothing was asked).
  uint64_t unpinned_bytes() const;
  bool cuda() const { return engine_ != nullptr; }
  uint64_t session_id() const { return blocks_->client()->session_id(); }
  // Why this store's tensors must move out of its arena, or "" while they
  // may stay: the daemon asked its session to leave (it drains), or ended
  // it (it restarted, stopped or dropped the connection; the process still
  // maps the old chunks, which nobody else can reach once that daemon is
  // gone). Checks the broker connection without waiting.
  std::string MoveReason() const;
  bool SessionLost() const { return blocks_->client()->session_lost(); }

 private:
  HostStateStore(std::shared_ptr<client::HostBlocks> blocks, std::shared_ptr<CopyEngine> engine);

  const std::shared_ptr<client::HostBlocks> blocks_;
  const std::shared_ptr<CopyEngine> engine_;  // null: no CUDA
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_HOST_STATE_H_
