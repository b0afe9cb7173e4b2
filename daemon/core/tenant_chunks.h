// TenantChunks: which chunks each tenant owns, and who was handed their fds.
//
// Bookkeeping only: no lock, no thread, no clock, no memory of its own; the
// one thing it asks the system, whether a recipient's process still lives,
// tests may answer instead.
// SessionTable owns one (ABSL_GUARDED_BY its mutex); it says when a chunk is
// empty (the allocator knows) and gives a chunk that changes tenant its new
// backing (FreshBacking). So each rule is testable without an arena.
//
// Rules:
// - A chunk belongs to at most one tenant ("" until first claimed). With
//   TenantMode::kNone there is one tenant: nobody claims, and every session
//   is handed every chunk.
// - A session is handed the fds of its tenant's chunks only: Attach hands it
//   all of them, Grant the ones it asks for (PERMISSION_DENIED for a chunk of
//   another tenant, nothing granted). Either records the session as a holder
//   of the chunk and its process as a recipient of the chunk's backing.
// - A chunk's recipients are bounded by the processes that live: when their
//   number reaches max(kRecipientSweep, twice the live ones at the last
//   sweep), those that exited are dropped (an exited process keeps nothing),
//   a few liveness checks per recipient recorded, amortised. So a uid that
//   attaches from ever new processes does not make a take-over (which hands
//   every recipient to FreshBacking) cost more with every pid it used.
// - A tenant may take over a chunk (Claimable) that is empty and that no open
//   session of another tenant holds: a never-used one first, else the lowest
//   numbered.
// - A chunk that changes tenant (Assign from another tenant) forgets its
//   holders and recipients: its caller has given it a new backing and
//   retired the old one to those recipients.
// - A tenant's chunk list is ascending and kept while the tenant has a
//   session or a chunk (the allocator searches the tenant's pool, not the
//   list).
// - Each tenant entry has a pool number, the allocator's pool its chunks are
//   in (SessionTable moves a chunk there when the tenant takes it over):
//   distinct among the entries, never 0 (kNoTenantPool, the chunks nobody
//   claimed yet), and reused after its entry is dropped.
// - Each tenant is of one uid (its sessions'); the chunks the tenants of a
//   uid own are counted per uid (UidChunks), for quotas.uid_max_chunks.
#ifndef MEMOFFLOAD_DAEMON_TENANT_CHUNKS_H_
#define MEMOFFLOAD_DAEMON_TENANT_CHUNKS_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload::daemon {

// Who may share a chunk. Chunks belong to one tenant at a time; a session is
// handed the fds of its tenant's chunks only, and a chunk changes tenant only
// when it is empty and no live session of its old tenant has it mapped. A
// chunk that changes tenant gets a new memfd (fresh backing, FreshBacking):
// whatever a process of the old tenant kept (a mapping, an fd passed on)
// reaches the old pages only, never the new tenant's.
enum class TenantMode {
  kUid,   // tenant = the peer's uid (default)
  kJob,   // tenant = the peer's uid and the hello's job id ("job:<uid>:<job_id>")
  kNone,  // one tenant: every session gets every chunk (trusted nodes)
};
Result<TenantMode> ParseTenantMode(const std::string& text);

class TenantChunks {
 public:
  // A tenant's chunks, ascending, and how many of its sessions are open.
  struct Owned {
    std::vector<uint32_t> chunks;
    uint32_t sessions = 0;
    uint32_t pool = 0;  // the allocator's pool of these chunks
    uid_t uid = 0;      // of its sessions
  };
  static constexpr uint32_t kNoTenantPool = 0;

  // Whether a process lives; a recipient for which it says no is dropped.
  using ProcessLives = std::function<bool(pid_t)>;
  // The recipients of a chunk are first swept when they reach this many.
  static constexpr size_t kRecipientSweep = 64;

  // `lives` null: kill(pid, 0) (EPERM counts as alive: another uid's).
  TenantChunks(uint32_t chunk_count, TenantMode mode, ProcessLives lives = nullptr);

  TenantMode mode() const { return mode_; }
  uint32_t chunk_count() const { return static_cast<uint32_t>(chunks_.size()); }
  // The chunk's tenant; "" while never claimed (always with kNone).
  const std::string& OwnerOf(uint32_t chunk) const { return chunks_[chunk].tenant; }
  // Chunks that have a tenant.
  uint32_t owned_chunks() const;
  // The tenant's entry, or nullptr.
  const Owned* Find(const std::string& tenant) const;

  // A session of `tenant` opens: returns its tenant's entry, which stays
  // valid (and at the same address) while the session is open; nullptr with
  // kNone. Leave, when it closes, drops an entry with no session and no chunk.
  const Owned* Join(const std::string& tenant, uid_t uid);
  void Leave(const std::string& tenant);

  // The chunks a new session is handed: its tenant's, every chunk with kNone.
  std::vector<uint32_t> Attach(uint64_t session_id, const std::string& tenant, pid_t pid);
  // The session asks for `chunks`: INVALID_ARGUMENT for one out of range,
  // PERMISSION_DENIED for one of another tenant; nothing is recorded then.
  Status Grant(uint64_t session_id, const std::string& tenant, pid_t pid,
               const std::vector<uint32_t>& chunks);
  // The session closed: it holds nothing any more.
  void Forget(uint64_t session_id);

  // A chunk `tenant` may take over now, or -1. `empty(c)`: chunk c holds no
  // extent. With `only_of_uid`, only a chunk another tenant of that uid owns
  // (taking it over leaves the uid's count as it is).
  int64_t Claimable(const std::string& tenant, const std::function<bool(uint32_t)>& empty,
                    const uid_t* only_of_uid = nullptr) const;
  // The chunks Claimable could offer now, one after the other, ascending.
  std::vector<uint32_t> ClaimableChunks(const std::string& tenant,
                                        const std::function<bool(uint32_t)>& empty,
                                        const uid_t* only_of_uid = nullptr) const;
  // How many chunks Claimable could offer now, one after the other.
  uint32_t CountClaimable(const std::string& tenant, const std::function<bool(uint32_t)>& empty,
                          const uid_t* only_of_uid = nullptr) const;
  // The chunks the tenants of `uid` own.
  const std::unordered_map<uid_t, uint32_t>& chunks_by_uid() const { return uid_chunks_; }
  uint32_t UidChunks(uid_t uid) const {
    auto it = uid_chunks_.find(uid);
    return it == uid_chunks_.end() ? 0 : it->second;
  }
  // Whether assigning the chunk to `tenant` takes it from another tenant
  // (then it needs a new backing, and its old one goes to recipients()).
  bool ChangesTenant(uint32_t chunk, const std::string& tenant) const;
  // The processes handed the chunk's current backing, but those a sweep
  // found exited: at most max(kRecipientSweep, 2 x the live ones at the last
  // sweep).
  const std::vector<pid_t>& recipients(uint32_t chunk) const { return chunks_[chunk].recipients; }
  // Makes the chunk the tenant's (a tenant of `uid`), moving it between the
  // tenants' lists.
  void Assign(uint32_t chunk, const std::string& tenant, uid_t uid);

  // The lists agree with the chunks' tenants, are ascending, and count the
  // sessions in `sessions_by_tenant`; INTERNAL naming the first violation.
  Status CheckInvariants(const std::unordered_map<std::string, uint32_t>& sessions_by_tenant) const;

 private:
  struct Holder {
    uint64_t session_id = 0;
    std::string tenant;
  };
  struct ChunkOwner {
    std::string tenant;                 // "" while never claimed
    std::vector<Holder> holders;        // open sessions that were handed the fd
    std::vector<pid_t> recipients;      // their processes, since the current backing
    size_t sweep_at = kRecipientSweep;  // sweep the recipients when they reach it
  };
  // The tenant's entry, made (with a pool) if it has none; dropping one
  // frees its pool number.
  Owned& Entry(const std::string& tenant, uid_t uid);
  // Whether `tenant` may take over chunk c now (Claimable's rule).
  bool MayClaim(uint32_t c, const std::string& tenant, const std::function<bool(uint32_t)>& empty,
                const uid_t* only_of_uid) const;
  void Drop(std::unordered_map<std::string, Owned>::iterator entry);
  // Records the session and its process as holding the chunk.
  void Hand(uint32_t chunk, uint64_t session_id, const std::string& tenant, pid_t pid);
  // Drops the recipients that exited; the next sweep waits for twice those left.
  void SweepRecipients(ChunkOwner* c) const;

  const TenantMode mode_;
  const ProcessLives lives_;
  std::vector<ChunkOwner> chunks_;  // by chunk index
  // By tenant; the inverse of chunks_[c].tenant. Entries are stable
  // (sessions point at theirs).
  std::unordered_map<std::string, Owned> owned_;
  std::vector<uint32_t> free_pools_;                // pool numbers of dropped entries
  std::unordered_map<uid_t, uint32_t> uid_chunks_;  // chunks owned, by uid; no 0 entry
  uint32_t next_pool_ = kNoTenantPool + 1;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_TENANT_CHUNKS_H_
