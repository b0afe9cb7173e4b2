#include "core/ledger.h"

#include <type_traits>

namespace memoffload::daemon {

Ledger::Account Ledger::Open(const std::string& job_key, uid_t uid, SessionKind kind) {
  Account account;
  account.kind = kind;
  ++KindOf(account).sessions;
  account.job = &jobs_[job_key];
  ++account.job->sessions;
  account.uid = &uids_[uid];
  ++account.uid->sessions;
  return account;
}

void Ledger::Close(const std::string& job_key, uid_t uid, SessionKind kind) {
  --kinds_[static_cast<size_t>(kind)].sessions;
  if (auto job = jobs_.find(job_key); job != jobs_.end() && --job->second.sessions == 0) {
    jobs_.erase(job);
  }
  if (auto totals = uids_.find(uid); totals != uids_.end() && --totals->second.sessions == 0) {
    uids_.erase(totals);
  }
}

uint64_t* Ledger::StateBytes(GroupState state) {
  return state == GroupState::kReserved    ? &totals_.reserved_bytes
         : state == GroupState::kCommitted ? &totals_.committed_bytes
                                           : &totals_.read_bytes;
}

void Ledger::Add(Account* account, uint64_t bytes) {
  account->held_bytes += bytes;
  account->job->held_bytes += bytes;
  if (account->kind == SessionKind::kState) account->job->state_held_bytes += bytes;
  account->uid->held_bytes += bytes;
  KindOf(*account).held_bytes += bytes;
}

void Ledger::Take(Account* account, uint64_t bytes) {
  account->held_bytes -= bytes;
  account->job->held_bytes -= bytes;
  if (account->kind == SessionKind::kState) account->job->state_held_bytes -= bytes;
  account->uid->held_bytes -= bytes;
  KindOf(*account).held_bytes -= bytes;
}

void Ledger::Reserved(Account* account, uint64_t bytes) {
  Add(account, bytes);
  totals_.reserved_bytes += bytes;
  ++totals_.groups;
  ++KindOf(*account).groups;
}

void Ledger::Committed(Account* account, uint64_t reserved, uint64_t kept) {
  Take(account, reserved - kept);
  totals_.reserved_bytes -= reserved;
  totals_.committed_bytes += kept;
}

void Ledger::Read(uint64_t bytes) {
  totals_.committed_bytes -= bytes;
  totals_.read_bytes += bytes;
}

void Ledger::Released(Account* account, GroupState state, uint64_t bytes) {
  Take(account, bytes);
  *StateBytes(state) -= bytes;
  --totals_.groups;
  --KindOf(*account).groups;
}

namespace {

// Whether `ledger` and `recount` agree on every key's bytes and sessions
// (a key missing from one side counts as zero there).
template <typename Map>
bool SameHolders(const Map& ledger, const Map& recount, std::string* first) {
  for (const Map* side : {&ledger, &recount}) {
    for (const auto& [key, unused] : *side) {
      auto l = ledger.find(key);
      auto r = recount.find(key);
      const uint64_t lb = l == ledger.end() ? 0 : l->second.held_bytes;
      const uint64_t rb = r == recount.end() ? 0 : r->second.held_bytes;
      const uint32_t ls = l == ledger.end() ? 0 : l->second.sessions;
      const uint32_t rs = r == recount.end() ? 0 : r->second.sessions;
      if (lb != rb || ls != rs) {
        *first = std::to_string(rb) + " bytes in " + std::to_string(rs) +
                 " sessions, the ledger says " + std::to_string(lb) + " in " + std::to_string(ls);
        if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
          *first = "job " + key + " holds " + *first;
        } else {
          *first = "uid " + std::to_string(key) + " holds " + *first;
        }
        return false;
      }
      if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
        const uint64_t ls_bytes = l == ledger.end() ? 0 : l->second.state_held_bytes;
        const uint64_t rs_bytes = r == recount.end() ? 0 : r->second.state_held_bytes;
        if (ls_bytes != rs_bytes) {
          *first = "job " + key + "'s state sessions hold " + std::to_string(rs_bytes) +
                   " bytes, the ledger says " + std::to_string(ls_bytes);
          return false;
        }
      }
    }
  }
  return true;
}

}  // namespace

Status Ledger::Check(const uint64_t by_state[3], uint64_t groups,
                     const std::unordered_map<std::string, Job>& job_held,
                     const std::unordered_map<uid_t, UidTotals>& uid_held,
                     const ByKind& by_kind) const {
  if (groups != totals_.groups || by_state[0] != totals_.reserved_bytes ||
      by_state[1] != totals_.committed_bytes || by_state[2] != totals_.read_bytes) {
    return Internal(
        "state counters disagree with the groups: " + std::to_string(groups) + " groups, " +
        std::to_string(by_state[0]) + "/" + std::to_string(by_state[1]) + "/" +
        std::to_string(by_state[2]) + " bytes reserved/committed/read; the ledger says " +
        std::to_string(totals_.groups) + ", " + std::to_string(totals_.reserved_bytes) + "/" +
        std::to_string(totals_.committed_bytes) + "/" + std::to_string(totals_.read_bytes));
  }
  std::string first;
  if (!SameHolders(jobs_, job_held, &first) || !SameHolders(uids_, uid_held, &first)) {
    return Internal(first);
  }
  for (size_t k = 0; k < kinds_.size(); ++k) {
    const KindTotals& l = kinds_[k];
    const KindTotals& r = by_kind[k];
    if (l.sessions != r.sessions || l.held_bytes != r.held_bytes || l.groups != r.groups) {
      return Internal(std::string(SessionKindName(static_cast<SessionKind>(k))) +
                      " sessions: " + std::to_string(r.sessions) + " holding " +
                      std::to_string(r.held_bytes) + " bytes in " + std::to_string(r.groups) +
                      " groups, the ledger says " + std::to_string(l.sessions) + ", " +
                      std::to_string(l.held_bytes) + ", " + std::to_string(l.groups));
    }
  }
  return Status::Ok();
}

}  // namespace memoffload::daemon
