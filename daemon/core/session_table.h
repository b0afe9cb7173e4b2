// SessionTable: sessions, their groups, and every byte they hold.
//
// The single authority on who holds which extents. All public methods are
// thread-safe (mu_ guards the members annotated with it, and the arena's
// allocator, which only the table changes) and validate their input
// completely: a bad request returns a status and changes nothing. Groups are scoped to their
// session, so a session can only ever name its own groups.
//
// Group states: kReserved (extents writable by the client) -> Commit ->
// kCommitted (the daemon owns the bytes) -> Prefetch -> kRead (extents
// readable) -> Release. Release is valid in every state.
#ifndef MEMOFFLOAD_DAEMON_SESSION_TABLE_H_
#define MEMOFFLOAD_DAEMON_SESSION_TABLE_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/node_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "config/config.h"
#include "core/ledger.h"
#include "core/quota_policy.h"
#include "core/reserve_queue.h"
#include "core/session_records.h"
#include "core/session_token.h"
#include "core/session_types.h"
#include "core/state_format.h"
#include "core/state_recorder.h"
#include "core/tenant_chunks.h"
#include "memoffload/common/status.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memory/arena.h"
#include "memory/fresh_backing.h"

namespace memoffload::daemon {

// A region name: 1-255 printable ASCII characters, no space
// (INVALID_ARGUMENT otherwise).
Status CheckRegionName(const std::string& name);

class SessionTable {
 public:
  // fresh_backing (not owned; may be null in tests: new backings are then
  // created unfaulted and old ones dropped inline) supplies new memfds for
  // chunks that change tenant.
  SessionTable(Arena* arena, const Policy& policy, TenantMode tenant_mode = TenantMode::kUid,
               FreshBacking* fresh_backing = nullptr);
  // Answers every waiting reserve (UNAVAILABLE) and stops the deadline thread.
  ~SessionTable();
  SessionTable(const SessionTable&) = delete;
  SessionTable& operator=(const SessionTable&) = delete;

  // Creates a session for an attached peer with a fresh random token.
  // `series` (Metrics::SeriesFor of the hello's job id and rank; may be null)
  // is kept with the session and handed back by Commit and Prefetch.
  Result<SessionGrant> Open(const Hello& hello, const PeerCredentials& peer,
                            std::shared_ptr<RankSeries> series = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  // Chunks whose fds a new session gets at attach: those its tenant owns
  // (every chunk with TenantMode::kNone). Records the session as a holder.
  Result<std::vector<ChunkGrant>> AttachChunks(uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);
  // A session asks for more chunk fds (its reservations landed there). Each
  // must belong to its tenant: PERMISSION_DENIED otherwise, nothing granted.
  // A backing handed to a live session is never replaced while it lives.
  Result<std::vector<ChunkGrant>> GrantChunks(uint64_t session_id,
                                              const std::vector<uint32_t>& chunks)
      ABSL_LOCKS_EXCLUDED(mu_);

  // What closing a session gave back to the free pool.
  struct Closed {
    uint64_t group_bytes = 0;  // its groups (activations)
    // Regions freed with it: the one it was writing (never committed), and
    // deleted ones it was the last to read.
    uint64_t region_bytes = 0;
    uint32_t regions = 0;
  };
  // Ends a session and returns everything it holds to the free pool.
  // NOT_FOUND if the session is already gone.
  Result<Closed> Close(uint64_t session_id, CloseReason reason) ABSL_LOCKS_EXCLUDED(mu_);

  // Each checks the session (NOT_FOUND), then the token in constant time
  // (UNAUTHENTICATED), then the group and its state.
  //
  // Reserve checks, in order: the usable arena (capacity - node reserve),
  // the session limit, the job limit, the session's group count (the quotas:
  // QuotaPolicy, asked once per try), free space (QuotaPolicy::Room, once
  // per placement) and the extent count (quotas.max_extents_per_reserve;
  // over it nothing is reserved). A request larger than the usable arena,
  // its session limit or its job limit can never fit and fails at once,
  // waiting or not.
  // Otherwise, without wait_until, a request that does not fit fails at once
  // with RESOURCE_EXHAUSTED naming the limit and the shortfall.
  //
  // With wait_until it waits, without holding a thread, until it fits or the
  // time passes; then it fails with RESOURCE_EXHAUSTED naming the last
  // shortfall. Waiters are served by ReserveQueue's rules: arrival order
  // within a tenant (no request of a tenant is placed while an earlier
  // waiter of the same tenant waits for capacity, so a stream of small
  // requests cannot starve its large one), round robin across tenants (a
  // request that fits is never refused because another tenant's waiter does
  // not), and aging (once a waiter has waited quotas.reserve_aging, other
  // tenants' requests must leave its bytes free). A waiter held back by its
  // own quota waits without blocking anyone. While draining, Reserve is
  // UNAVAILABLE and waiters fail.
  //
  // The answer: `done`, called exactly once and never under the table's
  // lock, on this thread when the answer is immediate, else on the thread
  // that places, refuses or expires the waiter. Returns the waiter's ticket
  // while it waits (for CancelReserve), 0 once answered. `cancelled`, when
  // set, is asked (under the table's lock) before a waiter is placed and
  // when the waiter bound is reached: once it returns true the waiter is
  // answered CANCELLED and nothing is reserved for it.
  using ReserveDone = std::function<void(Result<ReserveResult>&&, RejectReason)>;
  uint64_t ReserveAsync(uint64_t session_id, const std::string& token, uint64_t group_id,
                        uint64_t size_bytes, bool single_extent,
                        std::optional<std::chrono::steady_clock::time_point> wait_until,
                        ReserveDone done, std::function<bool()> cancelled = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The waiter's caller went away: it is answered CANCELLED and nothing is
  // reserved for it. Does nothing once the waiter was answered.
  void CancelReserve(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // ReserveAsync, waiting on the calling thread for the answer. *reject (if
  // non-null) is set to why a request was refused.
  Result<ReserveResult> Reserve(
      uint64_t session_id, const std::string& token, uint64_t group_id, uint64_t size_bytes,
      bool single_extent,
      std::optional<std::chrono::steady_clock::time_point> wait_until = std::nullopt,
      RejectReason* reject = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  // extent_crc32c, when non-empty, must hold one checksum per kept extent; it
  // is stored and handed back by Prefetch (the daemon never reads the data).
  Result<CommitResult> Commit(uint64_t session_id, const std::string& token, uint64_t group_id,
                              uint64_t used_bytes, std::vector<uint32_t> extent_crc32c = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  Result<PrefetchResult> Prefetch(uint64_t session_id, const std::string& token, uint64_t group_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  Result<ReleaseResult> Release(uint64_t session_id, const std::string& token, uint64_t group_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Checkpoint regions (session_table_regions.cc). Every call authenticates
  // the session like the group calls; a region is named within the session's
  // (uid, job id), so no session can reach another job's regions. The job id
  // must be explicit (non-empty): FAILED_PRECONDITION otherwise.
  //
  // CreateRegion checks the name (1-255 printable ASCII characters, no
  // space), that the job holds no region of that name (ALREADY_EXISTS), the
  // job's and the uid's region counts (regions.max_per_job,
  // regions.max_per_uid), the job's, the uid's and the node's region bytes
  // (regions.job_max_bytes, regions.uid_max_bytes, regions.max_bytes) and then free
  // space, placing in the session's tenant's chunks as Reserve does. Never
  // waits. A region being written is its creator's: it is freed when that
  // session ends before CommitRegion, so a crash never leaves a region that
  // reads as complete. `ttl` 0 means regions.ttl; longer is capped to it.
  Result<ReserveResult> CreateRegion(uint64_t session_id, const std::string& token,
                                     const std::string& name, uint64_t size_bytes,
                                     std::chrono::milliseconds ttl) ABSL_LOCKS_EXCLUDED(mu_);
  // By its writer: returns the unused tail (as Commit does) and makes the
  // region visible to the job. Its TTL runs from now. A non-empty
  // `rename_to` commits it under that name (ALREADY_EXISTS when the job has
  // a region of that name, changing nothing).
  Result<CommitResult> CommitRegion(uint64_t session_id, const std::string& token,
                                    const std::string& name, uint64_t used_bytes,
                                    std::vector<uint32_t> extent_crc32c,
                                    const std::string& rename_to = "") ABSL_LOCKS_EXCLUDED(mu_);
  // A committed region of the job, for reading: its extents stay the
  // region's (not freed, even when deleted) until CloseRegion or the end of
  // the reading session.
  Result<PrefetchResult> OpenRegion(uint64_t session_id, const std::string& token,
                                    const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  Status CloseRegion(uint64_t session_id, const std::string& token, const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Deletes a region of the session's job: a committed one, or one this
  // session is writing (an abort). Returns the bytes freed, 0 while readers
  // have it open (it is hidden now and freed when the last one closes).
  Result<uint64_t> DeleteRegion(uint64_t session_id, const std::string& token,
                                const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // The operator's delete (admin token checked by the caller): any region.
  Result<uint64_t> DeleteRegionOf(uid_t uid, const std::string& job_id, const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The session's job's committed regions whose name starts with prefix,
  // by name.
  Result<std::vector<RegionSnapshot>> ListRegions(uint64_t session_id, const std::string& token,
                                                  const std::string& prefix)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every region of the node (writing ones too), for operators.
  std::vector<RegionSnapshot> ListAllRegions(const std::string& prefix) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Deletes the committed regions whose TTL has passed at `now`; returns how
  // many. The daemon calls it every second.
  uint64_t ExpireRegions(std::chrono::steady_clock::time_point now) ABSL_LOCKS_EXCLUDED(mu_);

  // Replaces the quotas (SIGHUP). Sessions keep what they hold; the new
  // limits apply to every later reservation, existing sessions included, and
  // to the waiting ones (tried again now). Queued waiters stay queued when the
  // waiter bounds shrink below their count.
  void SetPolicy(const Policy& policy) ABSL_LOCKS_EXCLUDED(mu_);
  // Drain: new Reserves are UNAVAILABLE (waiting ones fail), existing groups
  // may still be committed, prefetched and released. Undrain is
  // FAILED_PRECONDITION once BeginShutdown was called.
  Status SetDraining(bool draining) ABSL_LOCKS_EXCLUDED(mu_);
  // A take-over froze the table (app/takeover.h): until it is unfrozen (the
  // take-over did not happen) every session's call and every new session is
  // answered UNAVAILABLE starting with kTakeoverPause (the client waits and
  // sends it again, to this daemon or the new one), waiting reserves too,
  // and undrain is refused. Nothing the table holds changes meanwhile.
  void SetFrozen(bool frozen) ABSL_LOCKS_EXCLUDED(mu_);
  // Drain for exit (SIGTERM): like SetDraining(true), for good; refusals say
  // the daemon is shutting down.
  void BeginShutdown() ABSL_LOCKS_EXCLUDED(mu_);
  bool draining() const ABSL_LOCKS_EXCLUDED(mu_);
  // Called each time a drain starts (SetDraining(true) while not draining,
  // BeginShutdown), after the table's lock is released, on the caller's
  // thread, with why. Set once, before the table serves.
  void OnDrainStart(std::function<void(const std::string& why)> listener) {
    drain_listener_ = std::move(listener);
  }

  ArenaSnapshot Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  // The chunks the tenants of `uid` own (0 with TenantMode::kNone).
  uint32_t UidChunks(uid_t uid) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every uid with a session, a chunk or a region, by uid.
  std::vector<UidSnapshot> ListUids() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<SessionSnapshot> ListSessions() const ABSL_LOCKS_EXCLUDED(mu_);
  // The session's snapshot, nullopt once it is gone.
  std::optional<SessionSnapshot> FindSession(uint64_t session_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // Tells `recorder` (not owned; null: nothing is recorded) each region
  // committed or deleted and each chunk given a new memfd, under the table's
  // lock, before the change is answered. Set before serving.
  void SetRecorder(StateRecorder* recorder) ABSL_LOCKS_EXCLUDED(mu_);
  // Before serving, on an empty table: places the regions a restart kept
  // (their bytes already in their chunks, session_table_recover.cc). Each
  // region's chunks go to its tenant; a region whose extents are out of the
  // arena, overlap another's or lie in another tenant's chunk is not placed
  // and its name, with why, goes to *dropped. `unverified`: the regions
  // saved without checksums (shown so in ListAllRegions).
  struct Recovered {
    uint32_t regions = 0;
    uint64_t bytes = 0;
  };
  Recovered Recover(const std::vector<RegionRecord>& regions, std::vector<std::string>* dropped)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every committed region as the state store keeps it (a snapshot).
  std::vector<RegionRecord> CommittedRegions() const ABSL_LOCKS_EXCLUDED(mu_);
  // Which tenant owns each owned chunk (a take-over hands them on, so that a
  // chunk old processes still map changes tenant only with a new memfd).
  using ChunkOwner = ChunkOwnerRecord;  // state_format.h
  std::vector<ChunkOwner> ChunkOwners() const ABSL_LOCKS_EXCLUDED(mu_);
  TenantMode tenant_mode() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return tenant_chunks_.mode(); }
  // Before serving, after Recover: gives each chunk nobody owns yet to its
  // owner in `owners` (out-of-range chunks and a mode without tenants are
  // ignored).
  void AdoptChunkOwners(const std::vector<ChunkOwner>& owners) ABSL_LOCKS_EXCLUDED(mu_);

  // Sessions across a take-over (session_table_resume.cc). Every live
  // session as a take-over hands it on: its peer, hello, token and limit,
  // its groups (placed blocks too), the regions it is writing and those it
  // has open. Call on a frozen table (nothing changes meanwhile).
  std::vector<SessionRecord> SessionRecords() const ABSL_LOCKS_EXCLUDED(mu_);
  // Before serving, after Recover and AdoptChunkOwners: takes the handed
  // sessions back with their groups at their offsets, each waiting for its
  // process to resume it (Resume) within `resume_within`. A session whose
  // record is malformed, whose extents lie outside the arena or another
  // tenant's chunk, or overlap what is placed already, is not taken and goes
  // to *dropped with why (its bytes stay free).
  struct Adopted {
    uint32_t sessions = 0;
    uint64_t groups = 0;
    uint64_t bytes = 0;  // its groups and the regions being written
  };
  Adopted AdoptSessions(const std::vector<SessionRecord>& sessions,
                        std::chrono::milliseconds resume_within, std::vector<std::string>* dropped)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The session's process resumes it over a new broker connection: `peer`
  // (SO_PEERCRED of that connection) must be its uid and pid
  // (PERMISSION_DENIED), the token its own (UNAUTHENTICATED); NOT_FOUND
  // when no session of that id awaits a resume here. *hello gets its hello,
  // *waited how long it waited since it was taken over.
  Result<SessionGrant> Resume(uint64_t session_id, const std::string& token,
                              const PeerCredentials& peer, Hello* hello,
                              std::chrono::milliseconds* waited) ABSL_LOCKS_EXCLUDED(mu_);
  // The handed sessions' time to resume runs from now (the daemon serves:
  // the old one exits and their processes see their lifelines close).
  void StartResumeClock(std::chrono::milliseconds resume_within) ABSL_LOCKS_EXCLUDED(mu_);
  // The resumed session's metrics series (Metrics::SeriesFor of its hello).
  void SetSeries(uint64_t session_id, std::shared_ptr<RankSeries> series) ABSL_LOCKS_EXCLUDED(mu_);
  // Closes the handed sessions not resumed by their time (their process
  // died during the take-over); returns a line per session closed.
  std::vector<std::string> CloseUnresumed(std::chrono::steady_clock::time_point now)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Runs the allocator's invariant check plus the table's own accounting.
  Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The records (session_records.h), all guarded by mu_ where the table
  // holds them.
  using Clock = session_records::Clock;
  using Group = session_records::Group;
  using GroupMap = session_records::GroupMap;
  using Session = session_records::Session;
  using Region = session_records::Region;
  using JobRegions = session_records::JobRegions;
  using UidRegions = session_records::UidRegions;
  using GroupNode = GroupMap::node_type;
  // Released groups' map nodes, kept with their vectors' capacity for the
  // next Reserve (no allocation on the request path): at most this many.
  static constexpr size_t kSpareGroupNodes = 1024;
  // A node keyed `group_id` holding an empty Group.
  GroupNode NewGroupNode(uint64_t group_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps a node taken out of a session's map for reuse.
  void RecycleGroupNode(GroupNode node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The chunk tenant of a session or region of (uid, job id); "" with
  // TenantMode::kNone. tenant_chunks_'s mode never changes.
  std::string TenantFor(uid_t uid, const std::string& job_id) const ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Whether `tenant` is a tenant of `uid` in this table's mode.
  bool TenantOfUid(const std::string& tenant, uid_t uid) const ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // "<uid>:<job_id>": the key of jobs_ and regions_.
  static std::string JobKey(uid_t uid, const std::string& job_id);
  // The session's job's regions (created on demand). FAILED_PRECONDITION
  // without an explicit job id.
  Result<JobRegions*> RegionsOf(const Session& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's visible region `name` (not deleted).
  Result<Region*> FindRegion(JobRegions* job, const Session& session, const std::string& name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The caller's region `name`: the session authenticated, the name checked,
  // found (not deleted) among its job's regions.
  struct OwnRegion {
    Session* session = nullptr;
    JobRegions* job = nullptr;
    Region* region = nullptr;
  };
  Result<OwnRegion> FindOwnRegion(uint64_t session_id, const std::string& token,
                                  const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Deletes it now, or hides it until its last reader closes; returns the
  // bytes freed. Erases it from `job` when freed.
  uint64_t DropRegion(JobRegions* job, std::map<std::string, Region>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A closing session's regions: those it was writing are freed, its opens
  // closed. Adds what it freed to *closed.
  void ForgetRegionsOf(const Session& session, Closed* closed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  RegionSnapshot SnapshotOf(const Region& region, Clock::time_point now) const;
  SessionSnapshot SnapshotOf(uint64_t id, const Session& session, Clock::time_point now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts the extents (delta +1) or uncounts them (-1) in the chunks they
  // pin, for the node and for `uid` (their region's); with tenants only.
  void CountRegionChunks(uid_t uid, const std::vector<Extent>& extents, int delta)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The bytes of the chunks `extents` would newly pin.
  uint64_t NewRegionChunkBytes(const std::vector<Extent>& extents) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places `rounded` bytes into *out (empty; left empty on failure) in the
  // session's tenant's pool (claiming empty chunks), leaving keep_free_bytes
  // free; checks capacity (quota_.Room) and the extent count.
  Status Place(const Session& session, uint64_t rounded, bool single_extent,
               uint64_t keep_free_bytes, std::vector<Extent>* out, RejectReason* reject)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Finds the session and checks its token.
  Result<Session*> Authenticate(uint64_t session_id, const std::string& token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Result<Group*> FindGroup(Session* session, uint64_t group_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One attempt to place the group now, leaving keep_free_bytes of the
  // usable arena free (for an aged waiter of another tenant). The caller has
  // had the quotas checked (quota_.Check); this checks capacity, once
  // (quota_.Room). Places only in the tenant's chunks (its TenantChunks list:
  // no pass over every chunk), claiming empty ones when they are full.
  Result<ReserveResult> TryReserve(Session* session, uint64_t group_id, uint64_t rounded,
                                   bool single_extent, uint64_t keep_free_bytes,
                                   RejectReason* reject) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // size_bytes rounded up to the arena's page (a power of two): what a group
  // or a region of that size holds.
  uint64_t PageRounded(uint64_t size_bytes) const;
  // UNAVAILABLE while draining: "memoffloadd is draining: <refused> until
  // 'memoffloadctl undrain'", or that it is shutting down (SIGTERM).
  Status DrainingRefusal(const std::string& refused) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the session and its job hold, for quota_.
  QuotaUsage UsageOf(const Session& session) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED for a request queued behind capacity waiters of its
  // own tenant, naming the arena and the shortfall.
  Status QueuedBehind(const std::string& tenant, uint64_t rounded, uint64_t ahead_bytes,
                      size_t ahead_count) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The waiting-reserve machinery (session_table_reserve.cc). Answers run
  // after mu_ is released, as Completions.
  using Completions = std::vector<std::function<void()>>;
  struct PendingReserve {
    uint64_t session_id = 0;
    uint64_t group_id = 0;
    uint64_t rounded = 0;
    bool single_extent = false;
    Clock::time_point waited_from;
    Status last;  // the latest refusal, named in the answer at the deadline
    ReserveDone done;
    std::function<bool()> cancelled;  // may be empty
  };
  // A Reserve's arguments (ReserveAsync's, less the token and the answer).
  struct ReserveRequest {
    uint64_t session_id = 0;
    uint64_t group_id = 0;
    uint64_t size_bytes = 0;
    bool single_extent = false;
    std::optional<Clock::time_point> wait_until;
  };
  // ReserveAsync under mu_: places the request, queues it (returns its
  // ticket; *done and *cancelled move to the waiter), or sets *answer (and
  // *reject) and returns 0. Answers to other waiters go to *others.
  uint64_t AdmitReserve(const ReserveRequest& request, const std::string& token, ReserveDone* done,
                        std::function<bool()>* cancelled,
                        std::optional<Result<ReserveResult>>* answer, RejectReason* reject,
                        Completions* others) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The refusals no wait can change: the group exists, an empty request,
  // draining, larger than the usable arena or (single extent) a chunk.
  Status CheckReserveNeverFits(const Session& s, const ReserveRequest& request, uint64_t rounded,
                               RejectReason* reject) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Who shares a line of the reserve queue: the chunk tenant, or the uid
  // with TenantMode::kNone.
  std::string QueueTenant(const Session& session) const;
  // Whether the waiter's own quota holds it back now.
  bool QuotaHeld(const ReserveQueue::Waiter& waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A chunk the session's tenant may take over now, or -1. With its uid at
  // quotas.uid_max_chunks, only one another tenant of the uid owns; *capped
  // then says that the limit, not the arena, kept it from another chunk.
  int64_t ClaimableFor(const Session& s, bool* capped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether quotas.uid_max_chunks holds back `rounded` for `s`: its uid's
  // chunks have no room for it, and it needs more chunks than the limit lets
  // the uid take (UidChunksFor), or another could be taken but for it.
  bool UidChunksHold(const Session& s, uint64_t rounded, bool single_extent)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A second uid opened a session: warns once, per daemon, when the per-uid
  // limits that keep one uid from taking the arena are off.
  void WarnIfSharedWithoutUidLimits(uid_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool warned_shared_uids_ ABSL_GUARDED_BY(mu_) = false;
  // Before a placement takes over chunks: whether the uid's chunk limit
  // leaves enough of them for `rounded` beyond the free space of its pool
  // (a claim that still does not fit would keep its chunk).
  Status UidChunksFor(const Session& s, uint64_t rounded, bool single_extent, RejectReason* reject)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before a placement takes over chunks: whether the free space of its
  // pool and the chunks it may take over now (within quotas.uid_max_chunks)
  // hold `rounded` (with single_extent: one of those chunks). If not, it is
  // refused as arena full before it takes any, since the claims would still
  // fail and keep their chunks, empty, from other tenants.
  Status ClaimsCover(const Session& s, uint64_t rounded, bool single_extent, RejectReason* reject)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // quotas.uid_max_chunks's "never fits" (with tenants only).
  Status CheckFitsUidChunks(const Session& s, uint64_t rounded, RejectReason* reject) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Offers free space to the waiters.
  void DispatchWaiters(Completions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Release's work under mu_; what it unblocked goes to `done`.
  Result<ReleaseResult> ReleaseLocked(uint64_t session_id, const std::string& token,
                                      uint64_t group_id, Completions* done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the waiter from pending_ and queues its answer.
  void Answer(uint64_t ticket, Result<ReserveResult> result, RejectReason reason, Completions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers every waiter with `status` (drain, shutdown).
  void FailAllWaiters(const Status& status, RejectReason reason, Completions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers the waiters of a closing session.
  void FailSessionWaiters(uint64_t session_id, Completions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers the waiters whose caller went away.
  void DropCancelledWaiters(Completions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers the waiters that can never fit any more: a limit was lowered
  // (SIGHUP, or a smaller job limit asked by a new session of the job)
  // while they waited.
  void FailWaitersThatCanNeverFit(Completions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Status CANCELLED for a waiter queued at `waited_from`.
  static Status CancelledStatus(Clock::time_point waited_from);
  ReserveQueue::Limits QueueLimits() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers waiters at their deadline; runs on deadline_thread_.
  void ExpireWaitersLoop() ABSL_LOCKS_EXCLUDED(mu_);
  static void Run(Completions* completions);
  // capacity - node reserve, or 0 when the reserve covers the arena.
  uint64_t UsableBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns extents the table holds to the allocator; a refusal is a bug,
  // logged and counted in free_errors_.
  void FreeExtents(const std::vector<Extent>& extents) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Arena* const arena_;
  mutable absl::Mutex mu_;
  QuotaPolicy quota_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> drain_listener_;  // set before serving
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool frozen_ ABSL_GUARDED_BY(mu_) = false;
  ReserveQueue queue_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, PendingReserve> pending_ ABSL_GUARDED_BY(mu_);  // by ticket
  absl::CondVar deadline_changed_;  // a waiter was queued, or stopping_
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  Ledger ledger_ ABSL_GUARDED_BY(mu_);  // what groups hold, by state, session, job and uid
  std::vector<GroupNode> spare_groups_ ABSL_GUARDED_BY(mu_);

  // Marks `chunk` as the tenant's (tenant_chunks_.Assign), giving it a new
  // memfd when it belonged to another tenant (never faults pages: see
  // FreshBacking) and retiring the old one to its recipients. Fails,
  // changing nothing, only when no memfd can be created.
  Status Claim(uint32_t chunk, const std::string& tenant, uid_t uid)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // tenant_chunks_ agrees with the sessions.
  Status CheckTenantChunks() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CheckInvariants' parts (session_table_invariants.cc). The sessions'
  // groups recounted against their sessions and the ledger (by state, job
  // and uid); adds what they hold to *held.
  Status CheckSessionRecords(uint64_t* held) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A group's extents: in its tenant's chunks, summing to its held bytes.
  Status CheckGroupRecord(uint64_t gid, const Group& g, const std::string& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The regions against their jobs, uids and counters; sets *region_held.
  Status CheckRegionRecords(uint64_t* region_held) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The chunks regions pin (with tenants only) against the regions.
  Status CheckRegionChunks() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The record of a committed region, for the recorder.
  static RegionRecord RecordOf(const Region& region);
  // Takes `extents` from the allocator exactly (a restart's or a
  // take-over's), appending each to *taken; stops at the first it cannot
  // take and says why ("" when all were taken).
  std::string TakeExactAll(const std::vector<Extent>& extents, std::vector<Extent>* taken)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  StateRecorder* recorder_ ABSL_GUARDED_BY(mu_) = nullptr;
  TenantChunks tenant_chunks_ ABSL_GUARDED_BY(mu_);
  FreshBacking* const fresh_backing_;
  uint64_t replaced_backings_ ABSL_GUARDED_BY(mu_) = 0;
  // A take-over's sessions (ArenaSnapshot's handed_*).
  uint32_t handed_waiting_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t handed_resumed_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t handed_not_resumed_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t handed_dropped_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::milliseconds longest_resume_wait_ ABSL_GUARDED_BY(mu_){0};

  uint64_t next_session_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::node_hash_map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t free_errors_ ABSL_GUARDED_BY(mu_) = 0;
  std::unordered_map<std::string, JobRegions> regions_ ABSL_GUARDED_BY(mu_);  // by job key
  uint32_t region_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t committed_region_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t region_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t committed_region_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t regions_expired_ ABSL_GUARDED_BY(mu_) = 0;
  // What each uid's regions hold (regions.uid_max_bytes, max_per_uid).
  std::unordered_map<uid_t, UidRegions> uid_regions_ ABSL_GUARDED_BY(mu_);
  // Zeros for a uid without regions.
  UidRegions UidRegionsOf(uid_t uid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the session's job, its uid and the node hold in regions, for quota_.
  RegionUsage RegionUsageOf(const Session& session, const JobRegions& job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds the deltas to the uid's tally; forgets a uid left with no region
  // (its regions' chunks are uncounted first).
  void CountUidRegions(uid_t uid, int64_t bytes_delta, int count_delta)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Region extents in each chunk (sized on first use; with tenants only)
  // and the bytes of the chunks with any: what regions keep from other
  // tenants, which regions.max_bytes bounds (and, per uid,
  // UidRegions::chunk_bytes, which regions.uid_max_bytes bounds).
  std::vector<uint32_t> region_extents_in_chunk_ ABSL_GUARDED_BY(mu_);
  uint64_t region_chunk_bytes_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread deadline_thread_;  // one for all waiters; last member: starts after the rest
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SESSION_TABLE_H_
