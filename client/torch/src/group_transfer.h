// GroupTransfer: the worker thread's half of a group's life, one task per
// step: Reserve, CopyOut (each storage), Close (copy the rest and Commit),
// Prefetch (read back) and Release. The Worker's FIFO order is what keeps the
// steps of one group in sequence; none of these runs on a training thread.
//
// A group whose reservation, copy or Commit fails keeps its source storages
// (counted as skipped); a Prefetch that finds the daemon gone reads the data
// back from this process's mapping of the chunks.
#ifndef MEMOFFLOAD_TORCH_SRC_GROUP_TRANSFER_H_
#define MEMOFFLOAD_TORCH_SRC_GROUP_TRANSFER_H_

#include <c10/core/Storage.h>

#include <cstdint>
#include <mutex>

#include "daemon_link.h"
#include "group.h"
#include "memoffload/common/status.h"
#include "memoffload/torch/copy_engine.h"
#include "stats_book.h"

namespace memoffload::torch {

// Copies an offloaded storage back from the arena (g.read_extents) into fresh
// memory on its device; *copied receives the engine's token for the copy
// (see StoredStorage::restored_ready). Also used on a training thread for a
// second backward, once the group's prefetch is complete.
Result<c10::Storage> RestoreStorage(const Group& g, const StoredStorage& s, ReadyToken* copied);

// The storage `s` of `g` for a backward round: on CPU, when the group allows
// it and `s` lies in one extent, a storage over the arena bytes themselves
// (no copy; it holds `g`, and with it the group's space, until it dies);
// otherwise a copy (RestoreStorage). Needs g.read_extents.
Result<c10::Storage> RestoreOrView(const std::shared_ptr<Group>& g, const StoredStorage& s,
                                   ReadyToken* copied);

// Training thread, while `g` is open: copies the CPU storage `s` into the
// group's reservation when the reservation is in place and holds it.
// Returns whether it did (else the worker copies it later).
bool CopyOutInline(Group& g, StoredStorage& s);

class GroupTransfer {
 public:
  // `cuda_engine` (may be null) pins the chunks of each reservation;
  // `training_mu` is the offloader's mutex, held while reading a group's
  // training-side fields. Every pointer must outlive the transfer.
  GroupTransfer(DaemonLink* link, StatsBook* stats, CopyEngine* cuda_engine,
                std::mutex* training_mu);

  // Reserves `bytes` for the group (the reservation is kept in g.client and
  // g.write_extents; a failure in g.reserve_status).
  void Reserve(Group& g, uint64_t bytes);
  // Copies one storage into the reservation when it fits (else Close does).
  void CopyOut(Group& g, StoredStorage& s);
  // Copies what is left, commits and drops the sources that made it.
  void Close(Group& g);
  // Restores the offloaded storages (on a device: those a live entry still
  // views) and fulfils g->prefetch_promise.
  void Prefetch(const std::shared_ptr<Group>& g);
  // Returns the group's space and drops unconsumed ready tokens.
  void Release(Group& g);

 private:
  // Gives back a reservation Close will not commit and drops g.client. A
  // transport error is the daemon gone (it reclaims the group with the
  // session); any other failure is noted (rpc_errors, logged once per code).
  void DropReservation(Group& g);
  // The group holds no arena bytes any more (StatsBook's arena_held_bytes).
  void LetGoOfHeld(Group& g);

  DaemonLink* const link_;
  StatsBook* const stats_;
  CopyEngine* const cuda_engine_;
  std::mutex* const training_mu_;
  bool warned_unsized_chunk_ = false;  // worker only
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_GROUP_TRANSFER_H_
