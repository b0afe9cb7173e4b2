// Ledger: what the session table's groups hold. Bytes by group state
// (reserved, committed, read) and the group count for the node; bytes by
// holder (each session's Account, its job, its uid); and how many sessions
// each job and uid has. A model part like QuotaPolicy, TenantChunks and
// ReserveQueue: no lock, no thread, no clock. SessionTable calls it under
// its one mutex, and QuotaPolicy decides on what it counts (UsageOf).
// Regions count apart (session_table_regions.cc): they outlive sessions.
#ifndef MEMOFFLOAD_DAEMON_LEDGER_H_
#define MEMOFFLOAD_DAEMON_LEDGER_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <unordered_map>

#include "core/session_types.h"
#include "memoffload/common/status.h"

namespace memoffload::daemon {

class Ledger {
 public:
  // A job is the hello's job id within one uid: another user naming the
  // same job id is another job (its own quota, its own requested limit).
  struct Job {
    uint64_t held_bytes = 0;
    uint32_t sessions = 0;
    uint64_t requested_limit = 0;  // smallest job_max_bytes a hello asked for
  };
  // What all sessions of one uid hold (quotas.uid_max_bytes), whatever job
  // ids they name.
  struct UidTotals {
    uint64_t held_bytes = 0;
    uint32_t sessions = 0;
  };
  // What one session's groups are counted against. `job` and `uid` point
  // into the ledger, which keeps them while any session counts in them.
  struct Account {
    uint64_t held_bytes = 0;
    Job* job = nullptr;
    UidTotals* uid = nullptr;
  };
  struct Totals {
    uint64_t reserved_bytes = 0;
    uint64_t committed_bytes = 0;
    uint64_t read_bytes = 0;
    uint64_t groups = 0;
  };

  // A session of `uid` in job `job_key` opens: its job and its uid count it.
  Account Open(const std::string& job_key, uid_t uid);
  // It closed, its groups already Released: its job and uid forget it, and
  // are dropped with their last session.
  void Close(const std::string& job_key, uid_t uid);

  // A group of `bytes` was reserved, committed keeping `kept` of its
  // `reserved` bytes, read (prefetched, once), or released in `state`.
  void Reserved(Account* account, uint64_t bytes);
  void Committed(Account* account, uint64_t reserved, uint64_t kept);
  void Read(uint64_t bytes);
  void Released(Account* account, GroupState state, uint64_t bytes);

  const Totals& totals() const { return totals_; }
  const std::unordered_map<std::string, Job>& jobs() const { return jobs_; }
  const std::unordered_map<uid_t, UidTotals>& uids() const { return uids_; }

  // The ledger against a recount from the records: `by_state` and `groups`
  // summed over every group, `job_held` and `uid_held` (bytes and sessions)
  // over every session. INTERNAL names the first counter that disagrees.
  Status Check(const uint64_t by_state[3], uint64_t groups,
               const std::unordered_map<std::string, Job>& job_held,
               const std::unordered_map<uid_t, UidTotals>& uid_held) const;

 private:
  uint64_t* StateBytes(GroupState state);

  Totals totals_;
  std::unordered_map<std::string, Job> jobs_;  // by "<uid>:<job_id>"
  std::unordered_map<uid_t, UidTotals> uids_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_LEDGER_H_
