// Ledger (daemon/core/ledger.cc): what groups hold, by state and by holder,
// asked directly: no table, no thread, no clock.
#include "core/ledger.h"

#include <gtest/gtest.h>

#include <random>
#include <unordered_map>
#include <vector>

#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

TEST(Ledger, AGroupMovesThroughItsStatesAndHoldersAgree) {
  Ledger ledger;
  Ledger::Account a = ledger.Open("1000:train", 1000, SessionKind::kActivations);
  ledger.Reserved(&a, 4 * kMiB);
  EXPECT_EQ(a.held_bytes, 4 * kMiB);
  EXPECT_EQ(a.job->held_bytes, 4 * kMiB);
  EXPECT_EQ(a.uid->held_bytes, 4 * kMiB);
  EXPECT_EQ(ledger.totals().reserved_bytes, 4 * kMiB);
  EXPECT_EQ(ledger.totals().groups, 1u);

  ledger.Committed(&a, 4 * kMiB, 3 * kMiB);  // 1 MiB trimmed back to the arena
  EXPECT_EQ(a.held_bytes, 3 * kMiB);
  EXPECT_EQ(a.job->held_bytes, 3 * kMiB);
  EXPECT_EQ(a.uid->held_bytes, 3 * kMiB);
  EXPECT_EQ(ledger.totals().reserved_bytes, 0u);
  EXPECT_EQ(ledger.totals().committed_bytes, 3 * kMiB);

  ledger.Read(3 * kMiB);
  EXPECT_EQ(ledger.totals().committed_bytes, 0u);
  EXPECT_EQ(ledger.totals().read_bytes, 3 * kMiB);

  ledger.Released(&a, GroupState::kRead, 3 * kMiB);
  EXPECT_EQ(a.held_bytes, 0u);
  EXPECT_EQ(a.job->held_bytes, 0u);
  EXPECT_EQ(ledger.totals().read_bytes, 0u);
  EXPECT_EQ(ledger.totals().groups, 0u);
}

TEST(Ledger, JobsAndUidsCountTheirSessionsAndGoWithTheLast) {
  Ledger ledger;
  Ledger::Account a = ledger.Open("1000:train", 1000, SessionKind::kOther);
  Ledger::Account b = ledger.Open("1000:train", 1000, SessionKind::kOther);
  Ledger::Account c = ledger.Open("1000:eval", 1000, SessionKind::kOther);
  Ledger::Account d =
      ledger.Open("1001:train", 1001, SessionKind::kOther);  // the same job id, another user
  EXPECT_EQ(a.job, b.job);
  EXPECT_NE(a.job, c.job);
  EXPECT_NE(a.job, d.job);
  EXPECT_EQ(a.uid, c.uid);
  EXPECT_EQ(a.job->sessions, 2u);
  EXPECT_EQ(a.uid->sessions, 3u);
  ledger.Reserved(&a, kMiB);
  ledger.Reserved(&c, 2 * kMiB);
  ledger.Reserved(&d, 8 * kMiB);
  EXPECT_EQ(a.job->held_bytes, kMiB);
  EXPECT_EQ(a.uid->held_bytes, 3 * kMiB);  // both of uid 1000's jobs
  EXPECT_EQ(d.uid->held_bytes, 8 * kMiB);

  ledger.Released(&a, GroupState::kReserved, kMiB);
  ledger.Close("1000:train", 1000, SessionKind::kOther);
  ASSERT_EQ(ledger.jobs().count("1000:train"), 1u);  // b is still open
  EXPECT_EQ(ledger.jobs().at("1000:train").sessions, 1u);
  ledger.Close("1000:train", 1000, SessionKind::kOther);
  EXPECT_EQ(ledger.jobs().count("1000:train"), 0u);
  EXPECT_EQ(ledger.uids().at(1000).sessions, 1u);
  ledger.Released(&c, GroupState::kReserved, 2 * kMiB);
  ledger.Close("1000:eval", 1000, SessionKind::kOther);
  EXPECT_EQ(ledger.uids().count(1000), 0u);
  EXPECT_EQ(ledger.uids().at(1001).held_bytes, 8 * kMiB);
}

// Each kind counts its sessions, bytes and groups; a job's state bytes are
// what its state sessions hold, and nothing of its other kinds.
TEST(Ledger, KindsAndAJobsStateBytesCountOnlyTheirOwnSessions) {
  Ledger ledger;
  Ledger::Account act = ledger.Open("1000:train", 1000, SessionKind::kActivations);
  Ledger::Account state = ledger.Open("1000:train", 1000, SessionKind::kState);
  Ledger::Account other_job = ledger.Open("1000:eval", 1000, SessionKind::kState);
  ledger.Reserved(&act, 8 * kMiB);
  ledger.Reserved(&state, 4 * kMiB);
  ledger.Reserved(&state, 2 * kMiB);
  ledger.Committed(&state, 2 * kMiB, kMiB);
  ledger.Reserved(&other_job, kMiB);
  EXPECT_EQ(act.job->held_bytes, 8 * kMiB + 5 * kMiB);
  EXPECT_EQ(act.job->state_held_bytes, 5 * kMiB);
  EXPECT_EQ(other_job.job->state_held_bytes, kMiB);
  const Ledger::KindTotals& s = ledger.kind(SessionKind::kState);
  EXPECT_EQ(s.sessions, 2u);
  EXPECT_EQ(s.held_bytes, 6 * kMiB);
  EXPECT_EQ(s.groups, 3u);
  EXPECT_EQ(ledger.kind(SessionKind::kActivations).held_bytes, 8 * kMiB);
  EXPECT_EQ(ledger.kind(SessionKind::kActivations).groups, 1u);
  EXPECT_EQ(ledger.kind(SessionKind::kCheckpoints).sessions, 0u);
  EXPECT_EQ(ledger.totals().groups, 4u);
  ledger.Released(&state, GroupState::kCommitted, kMiB);
  ledger.Released(&state, GroupState::kReserved, 4 * kMiB);
  EXPECT_EQ(act.job->state_held_bytes, 0u);
  EXPECT_EQ(act.job->held_bytes, 8 * kMiB);
  ledger.Close("1000:train", 1000, SessionKind::kState);
  EXPECT_EQ(ledger.kind(SessionKind::kState).sessions, 1u);
  EXPECT_EQ(ledger.kind(SessionKind::kState).groups, 1u);
}

// A random walk of opens, reserves, commits, reads, releases and closes,
// recounted from its own records after each step: the ledger always agrees,
// and a recount off by one byte anywhere is named.
TEST(Ledger, CheckAgreesWithARecountAndNamesTheFirstThatDoesNot) {
  struct G {
    size_t session;
    GroupState state;
    uint64_t bytes;
  };
  struct S {
    std::string job_key;
    uid_t uid;
    SessionKind kind;
    Ledger::Account account;
    bool open;
  };
  Ledger ledger;
  std::vector<S> sessions;
  std::vector<G> groups;
  std::mt19937_64 rng(7);
  auto recount = [&](uint64_t by_state[3], uint64_t* count,
                     std::unordered_map<std::string, Ledger::Job>* jobs,
                     std::unordered_map<uid_t, Ledger::UidTotals>* uids, Ledger::ByKind* kinds) {
    for (const S& s : sessions) {
      if (!s.open) continue;
      ++(*jobs)[s.job_key].sessions;
      ++(*uids)[s.uid].sessions;
      ++(*kinds)[static_cast<size_t>(s.kind)].sessions;
    }
    for (const G& g : groups) {
      const S& s = sessions[g.session];
      by_state[static_cast<int>(g.state)] += g.bytes;
      ++*count;
      (*jobs)[s.job_key].held_bytes += g.bytes;
      if (s.kind == SessionKind::kState) (*jobs)[s.job_key].state_held_bytes += g.bytes;
      (*uids)[s.uid].held_bytes += g.bytes;
      (*kinds)[static_cast<size_t>(s.kind)].held_bytes += g.bytes;
      ++(*kinds)[static_cast<size_t>(s.kind)].groups;
    }
  };
  for (int step = 0; step < 2000; ++step) {
    const int op = static_cast<int>(rng() % 6);
    if (op == 0 || sessions.empty()) {
      const uid_t uid = 1000 + static_cast<uid_t>(rng() % 3);
      const std::string job = std::to_string(uid) + ":job" + std::to_string(rng() % 2);
      const auto kind = static_cast<SessionKind>(rng() % kSessionKindCount);
      sessions.push_back(S{job, uid, kind, ledger.Open(job, uid, kind), true});
    } else if (op == 1) {
      const size_t s = rng() % sessions.size();
      if (!sessions[s].open) continue;
      const uint64_t bytes = (1 + rng() % 64) * 4 * kKiB;
      ledger.Reserved(&sessions[s].account, bytes);
      groups.push_back(G{s, GroupState::kReserved, bytes});
    } else if (!groups.empty() && op <= 4) {
      const size_t k = rng() % groups.size();
      G& g = groups[k];
      if (op == 2 && g.state == GroupState::kReserved) {
        const uint64_t kept = g.bytes - (rng() % (g.bytes / (4 * kKiB))) * 4 * kKiB;
        ledger.Committed(&sessions[g.session].account, g.bytes, kept);
        g = G{g.session, GroupState::kCommitted, kept};
      } else if (op == 3 && g.state == GroupState::kCommitted) {
        ledger.Read(g.bytes);
        g.state = GroupState::kRead;
      } else if (op == 4) {
        ledger.Released(&sessions[g.session].account, g.state, g.bytes);
        groups[k] = groups.back();
        groups.pop_back();
      }
    } else if (op == 5) {
      const size_t s = rng() % sessions.size();
      if (!sessions[s].open) continue;
      for (size_t k = groups.size(); k-- > 0;) {
        if (groups[k].session != s) continue;
        ledger.Released(&sessions[s].account, groups[k].state, groups[k].bytes);
        groups[k] = groups.back();
        groups.pop_back();
      }
      ledger.Close(sessions[s].job_key, sessions[s].uid, sessions[s].kind);
      sessions[s].open = false;
    }
    uint64_t by_state[3] = {0, 0, 0}, count = 0;
    std::unordered_map<std::string, Ledger::Job> jobs;
    std::unordered_map<uid_t, Ledger::UidTotals> uids;
    Ledger::ByKind kinds{};
    recount(by_state, &count, &jobs, &uids, &kinds);
    ASSERT_TRUE(ledger.Check(by_state, count, jobs, uids, kinds).ok()) << "step " << step;
    // Every open session's account points at the ledger's own job and uid.
    for (const S& s : sessions) {
      if (!s.open) continue;
      ASSERT_EQ(&ledger.jobs().at(s.job_key), s.account.job);
      ASSERT_EQ(&ledger.uids().at(s.uid), s.account.uid);
    }
    if (step % 100 != 99 || groups.empty()) continue;
    // One byte too many in a group's job: the check names that job.
    const std::string job = sessions[groups[0].session].job_key;
    ++jobs[job].held_bytes;
    const Status st = ledger.Check(by_state, count, jobs, uids, kinds);
    ASSERT_EQ(st.code(), StatusCode::kInternal);
    EXPECT_NE(st.message().find("job " + job + " holds"), std::string::npos) << st.message();
    --jobs[job].held_bytes;
    ++jobs[job].state_held_bytes;
    const Status state = ledger.Check(by_state, count, jobs, uids, kinds);
    ASSERT_EQ(state.code(), StatusCode::kInternal);
    EXPECT_NE(state.message().find("job " + job + "'s state sessions hold"), std::string::npos)
        << state.message();
    --jobs[job].state_held_bytes;
    const SessionKind kind = sessions[groups[0].session].kind;
    ++kinds[static_cast<size_t>(kind)].groups;
    const Status by_kind = ledger.Check(by_state, count, jobs, uids, kinds);
    ASSERT_EQ(by_kind.code(), StatusCode::kInternal);
    EXPECT_EQ(by_kind.message().rfind(std::string(SessionKindName(kind)) + " sessions:", 0), 0u)
        << by_kind.message();
    --kinds[static_cast<size_t>(kind)].groups;
    ++by_state[static_cast<int>(groups[0].state)];
    EXPECT_EQ(ledger.Check(by_state, count, jobs, uids, kinds).code(), StatusCode::kInternal);
  }
}

}  // namespace
}  // namespace memoffload::daemon
