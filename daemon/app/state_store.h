// StateStore: the node's state kept across a restart of the daemon
// (docs/deploy.md, "Restarts keep the node").
//
// Every arena chunk's memfd, a journal memfd and a snapshot memfd live in an
// FdStore (systemd's, or the keeper's). Each committed or deleted region is
// appended to the journal (core/state_format.h) under the table's lock,
// before the commit is answered: a memcpy into a shared mapping, which the
// kernel keeps when the process dies, so a SIGKILL loses nothing that was
// answered. A snapshot (the regions, written whole and sealed) is taken at
// SIGTERM and when the journal fills; a new journal follows it.
//
// At start (LoadState): the stored fds are taken and checked (each a memfd
// of the expected size and seals, else closed and named in the log), the
// newest readable snapshot and the journals after it are replayed, and the
// chunks that hold the kept regions are adopted by the new arena, with
// those no process was ever handed (handed_chunks.h). Every region's bytes
// are then checked against its CRC32Cs (VerifyRegions): one that fails is
// dropped and named; one saved without checksums is kept and called
// unverified. Chunks handed out that hold none get new memfds, so what a
// dead daemon's sessions may still map is never handed to anyone.
//
// Thread-safe (one mutex; the recorder calls come under the table's lock).
#ifndef MEMOFFLOAD_DAEMON_STATE_STORE_H_
#define MEMOFFLOAD_DAEMON_STATE_STORE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "app/fd_store.h"
#include "app/handed_chunks.h"
#include "core/state_format.h"
#include "core/state_recorder.h"
#include "memory/arena.h"

namespace memoffload::daemon {

// The journal's size: compacted into a snapshot when full (some 80,000
// region records).
inline constexpr uint64_t kJournalBytes = 16ull << 20;

struct StateLoad {
  std::unique_ptr<FdStore> store;  // null: state is not kept ("none")
  ReplayedState state;
  std::vector<int> chunk_fds;          // by chunk index, -1: none kept (owned)
  std::vector<bool> adopted;           // by chunk index: its kept memfd went to the arena
  std::vector<std::string> old_names;  // every name found, to remove once replaced
  std::vector<std::string> problems;   // fds refused, formats refused
  // By chunk index, whether a process was ever handed it (handed_chunks.h);
  // empty when not known: every one may have been.
  std::vector<bool> handed;
  bool refused = false;  // a snapshot or journal of a newer version: the start must not go on
  // Where the state came from when not `store`: another pod's keeper, whose
  // daemon no longer serves (LoadState's from_another_keeper).
  std::string source_path;
};
// Puts the hand-over mark into `store`.
Status MarkStoreHandedOver(FdStore* store, const std::string& why);
// Whether the keeper the daemon keeps state in holds the mark a daemon
// leaves there when it hands the node on and waits (lifecycle.after_handover
// = "wait"): what the store holds is then the node as it was at the
// hand-over, stale since; a start must not serve from it (a pod's container
// started again after its daemon handed over). False for systemd's store.
Result<bool> HoldsHandOverMark(const std::string& mode, const std::string& keeper_socket);
// `mode`: "auto" (systemd's store under systemd, else the keeper when its
// socket `keeper_socket` exists, else none), "systemd", "keeper", "none".
// With `from_another_keeper` (lifecycle.take_over = "auto", the keeper's
// socket in the runtime dir, which no daemon holds: pods share it), a keeper
// that holds no state yet takes it from another pod's keeper beside it
// (its daemon died as this pod started): an unmarked one first, the newest
// first; that keeper gets the hand-over mark at once.
Result<StateLoad> LoadState(const std::string& mode, const std::string& keeper_socket,
                            bool from_another_keeper = false);
void CloseChunkFds(StateLoad* load);
// Why `fd` is not a memfd of `size` bytes (0: any) with the seals `seals`
// (a hugetlbfs memfd has none), "" if it is.
std::string MemfdProblem(int fd, uint64_t size, int seals);
// The snapshot in memfd `fd` (DecodeSnapshot's errors).
Result<SnapshotContents> DecodeSnapshotFd(int fd);
// A memfd holding `bytes`, sealed against any change (a snapshot).
Result<int> SealedMemfd(const std::string& name, const std::string& bytes);

// Checks the kept regions' bytes in `arena` against their CRC32Cs, with up
// to `threads` threads. Drops (from *regions, into *dropped with why) those
// that fail; names those without checksums in *unverified.
void VerifyRegions(const Arena& arena, int threads, std::vector<RegionRecord>* regions,
                   std::vector<std::string>* dropped, std::vector<std::string>* unverified);

struct StateStoreStats {
  uint64_t records = 0;        // journal records written by this process
  uint64_t journal_bytes = 0;  // used of kJournalBytes
  uint64_t snapshots = 0;      // written by this process
  uint64_t errors = 0;         // records or fds that could not be kept
};

class StateStore : public StateRecorder {
 public:
  StateStore(std::unique_ptr<FdStore> store, ArenaLayout layout, uint64_t instance_id);
  ~StateStore() override;
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  std::string Describe() const { return store_->Describe(); }
  // What Begin puts in the store, known once the recovered regions are
  // placed: a snapshot of `regions` at `last_seq`, a new journal, every
  // chunk of `arena` not `adopted`, a new record of the chunks handed out
  // (those `handed`, and from now on those ChunksHanded names); then the
  // `old_names` not reused are removed. Begin runs before a start serves,
  // and only once the node is this daemon's after a take-over (a take-over
  // that fails before leaves the store to the daemon that serves on).
  void Prepare(const Arena* arena, uint64_t last_seq, std::vector<RegionRecord> regions,
               std::vector<bool> adopted, std::vector<bool> handed,
               std::vector<std::string> old_names) ABSL_LOCKS_EXCLUDED(mu_);
  Status Begin() ABSL_LOCKS_EXCLUDED(mu_);
  // After a Begin that failed once a take-over made the node this daemon's:
  // the state names are removed (as far as the store still takes a
  // removal), so that a later start finds nothing kept rather than the
  // node as it was at the take-over.
  void Abandon() ABSL_LOCKS_EXCLUDED(mu_);
  // A serving daemon hands its chunks to a new one: a start never believes
  // this store's record again (the new daemon hands the chunks on, and
  // records that in its own).
  void DisownHandedRecord() ABSL_LOCKS_EXCLUDED(mu_);
  // A snapshot of every region now, and a new journal after it (SIGTERM;
  // with the `sessions` to resume and the chunks' `owners` when it keeps
  // them for the next start).
  Status Compact(const std::vector<SessionRecord>& sessions = {},
                 const std::vector<ChunkOwnerRecord>& owners = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // The hand-over mark (HoldsHandOverMark), put by a daemon that hands the
  // node on and waits; cleared by the daemon that took it, in case the two
  // share a keeper.
  Status MarkHandedOver(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  void ClearHandOverMark() ABSL_LOCKS_EXCLUDED(mu_);

  void RegionCommitted(const RegionRecord& region) override ABSL_LOCKS_EXCLUDED(mu_);
  void RegionDeleted(const RegionKey& key) override ABSL_LOCKS_EXCLUDED(mu_);
  void BackingReplaced(uint32_t index, const std::shared_ptr<const Chunk>& backing) override
      ABSL_LOCKS_EXCLUDED(mu_);
  void ChunksHanded(const std::vector<uint32_t>& chunks) override ABSL_LOCKS_EXCLUDED(mu_);

  StateStoreStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // The last record's sequence number (a take-over continues from it).
  uint64_t last_seq() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Status CompactLocked(const std::vector<SessionRecord>& sessions = {},
                       const std::vector<ChunkOwnerRecord>& owners = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Append(const std::string& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveName(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Failed(const std::string& what, const Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::unique_ptr<FdStore> store_;
  const ArenaLayout layout_;
  const uint64_t instance_id_;
  // In its journals' headers and its record of handed chunks.
  const uint64_t generation_;
  mutable absl::Mutex mu_;
  std::map<RegionKey, RegionRecord> regions_ ABSL_GUARDED_BY(mu_);  // the mirror
  uint64_t seq_ ABSL_GUARDED_BY(mu_) = 0;                           // the last record's
  std::unique_ptr<Chunk> journal_ ABSL_GUARDED_BY(mu_);
  uint64_t journal_used_ ABSL_GUARDED_BY(mu_) = 0;
  std::string journal_name_ ABSL_GUARDED_BY(mu_);
  std::string snapshot_name_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<HandedChunks> handed_ ABSL_GUARDED_BY(mu_);  // null: not kept
  // handed_, for ChunksHanded without mu_ (which a compaction holds across
  // the store's socket): set once, in Begin, before the table records here.
  std::atomic<HandedChunks*> marking_{nullptr};
  struct Prepared {
    const Arena* arena = nullptr;
    uint64_t last_seq = 0;
    std::vector<RegionRecord> regions;
    std::vector<bool> adopted, handed;
    std::vector<std::string> old_names;
  };
  Prepared prepared_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> abandon_names_ ABSL_GUARDED_BY(mu_);  // Begin's old names
  StateStoreStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_STATE_STORE_H_
