// Ledger: what the session table's groups hold. Bytes by group state
// (reserved, committed, read) and the group count for the node; bytes by
// holder (each session's Account, its job, its uid); sessions, bytes and
// groups by session kind (a state session's groups are its placed blocks);
// what each job's state-kind sessions hold (quotas.state_share); and how
// many sessions each job and uid has. A model part like QuotaPolicy, TenantChunks and
// ReserveQueue: no lock, no thread, no clock. SessionTable calls it under
// its one mutex, and QuotaPolicy decides on what it counts (UsageOf).
// Regions count apart (session_table_regions.cc): they outlive sessions.
#ifndef MEMOFFLOAD_DAEMON_LEDGER_H_
#define MEMOFFLOAD_DAEMON_LEDGER_H_

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "core/session_types.h"
#include "memoffload/common/status.h"
#include "memoffload/shared_mem/attach_wire.h"

namespace memoffload::daemon {

class Ledger {
 public:
  // A job is the hello's job id within one uid: another user naming the
  // same job id is another job (its own quota, its own requested limit).
  struct Job {
    uint64_t held_bytes = 0;
    uint64_t state_held_bytes = 0;  // of held_bytes, by its state-kind sessions
    uint32_t sessions = 0;
    uint64_t requested_limit = 0;  // smallest job_max_bytes a hello asked for
  };
  // What all sessions of one uid hold (quotas.uid_max_bytes), whatever job
  // ids they name.
  struct UidTotals {
    uint64_t held_bytes = 0;
    uint32_t sessions = 0;
  };
  // What the sessions of one kind hold, node-wide.
  struct KindTotals {
    uint32_t sessions = 0;
    uint64_t held_bytes = 0;
    uint64_t groups = 0;
  };
  using ByKind = std::array<KindTotals, kSessionKindCount>;
  // What one session's groups are counted against. `job` and `uid` point
  // into the ledger, which keeps them while any session counts in them.
  struct Account {
    uint64_t held_bytes = 0;
    SessionKind kind = SessionKind::kOther;
    Job* job = nullptr;
    UidTotals* uid = nullptr;
  };
  struct Totals {
    uint64_t reserved_bytes = 0;
    uint64_t committed_bytes = 0;
    uint64_t read_bytes = 0;
    uint64_t groups = 0;
  };

  // A session of `kind` (a valid SessionKind) of `uid` in job `job_key`
  // opens: its job, its uid and its kind count it.
  Account Open(const std::string& job_key, uid_t uid, SessionKind kind);
  // It closed, its groups already Released: its job, uid and kind forget
  // it; the job and uid are dropped with their last session.
  void Close(const std::string& job_key, uid_t uid, SessionKind kind);

  // A group of `bytes` was reserved, committed keeping `kept` of its
  // `reserved` bytes, read (prefetched, once), or released in `state`.
  void Reserved(Account* account, uint64_t bytes);
  void Committed(Account* account, uint64_t reserved, uint64_t kept);
  void Read(uint64_t bytes);
  void Released(Account* account, GroupState state, uint64_t bytes);

  const Totals& totals() const { return totals_; }
  const ByKind& kinds() const { return kinds_; }
  const KindTotals& kind(SessionKind kind) const { return kinds_[static_cast<size_t>(kind)]; }
  const std::unordered_map<std::string, Job>& jobs() const { return jobs_; }
  const std::unordered_map<uid_t, UidTotals>& uids() const { return uids_; }

  // The ledger against a recount from the records: `by_state` and `groups`
  // summed over every group, `job_held` and `uid_held` (bytes and sessions;
  // a job's state bytes too) and `by_kind` over every session. INTERNAL
  // names the first counter that disagrees.
  Status Check(const uint64_t by_state[3], uint64_t groups,
               const std::unordered_map<std::string, Job>& job_held,
               const std::unordered_map<uid_t, UidTotals>& uid_held, const ByKind& by_kind) const;

 private:
  uint64_t* StateBytes(GroupState state);
  // `bytes` more (Add) or fewer (Take) for the account's session, job (and
  // the job's state bytes, for a state session), uid and kind.
  void Add(Account* account, uint64_t bytes);
  void Take(Account* account, uint64_t bytes);
  KindTotals& KindOf(const Account& account) { return kinds_[static_cast<size_t>(account.kind)]; }

  Totals totals_;
  ByKind kinds_{};
  std::unordered_map<std::string, Job> jobs_;  // by "<uid>:<job_id>"
  std::unordered_map<uid_t, UidTotals> uids_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_LEDGER_H_
