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
  Ledger::Account a = ledger.Open("1000:train", 1000);
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
  Ledger::Account a = ledger.Open("1000:train", 1000);
  Ledger::Account b = ledger.Open("1000:train", 1000);
  Ledger::Account c = ledger.Open("1000:eval", 1000);
  Ledger::Account d = ledger.Open("1001:train", 1001);  // the same job id, another user
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
  ledger.Close("1000:train", 1000);
  ASSERT_EQ(ledger.jobs().count("1000:train"), 1u);  // b is still open
  EXPECT_EQ(ledger.jobs().at("1000:train").sessions, 1u);
  ledger.Close("1000:train", 1000);
  EXPECT_EQ(ledger.jobs().count("1000:train"), 0u);
  EXPECT_EQ(ledger.uids().at(1000).sessions, 1u);
  ledger.Released(&c, GroupState::kReserved, 2 * kMiB);
  ledger.Close("1000:eval", 1000);
  EXPECT_EQ(ledger.uids().count(1000), 0u);
  EXPECT_EQ(ledger.uids().at(1001).held_bytes, 8 * kMiB);
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
    Ledger::Account account;
    bool open;
  };
  Ledger ledger;
  std::vector<S> sessions;
  std::vector<G> groups;
  std::mt19937_64 rng(7);
  auto recount = [&](uint64_t by_state[3], uint64_t* count,
                     std::unordered_map<std::string, Ledger::Job>* jobs,
                     std::unordered_map<uid_t, Ledger::UidTotals>* uids) {
    for (const S& s : sessions) {
      if (!s.open) continue;
      ++(*jobs)[s.job_key].sessions;
      ++(*uids)[s.uid].sessions;
    }
    for (const G& g : groups) {
      by_state[static_cast<int>(g.state)] += g.bytes;
      ++*count;
      (*jobs)[sessions[g.session].job_key].held_bytes += g.bytes;
      (*uids)[sessions[g.session].uid].held_bytes += g.bytes;
    }
  };
  for (int step = 0; step < 2000; ++step) {
    const int op = static_cast<int>(rng() % 6);
    if (op == 0 || sessions.empty()) {
      const uid_t uid = 1000 + static_cast<uid_t>(rng() % 3);
      const std::string job = std::to_string(uid) + ":job" + std::to_string(rng() % 2);
      sessions.push_back(S{job, uid, ledger.Open(job, uid), true});
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
      ledger.Close(sessions[s].job_key, sessions[s].uid);
      sessions[s].open = false;
    }
    uint64_t by_state[3] = {0, 0, 0}, count = 0;
    std::unordered_map<std::string, Ledger::Job> jobs;
    std::unordered_map<uid_t, Ledger::UidTotals> uids;
    recount(by_state, &count, &jobs, &uids);
    ASSERT_TRUE(ledger.Check(by_state, count, jobs, uids).ok()) << "step " << step;
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
    const Status st = ledger.Check(by_state, count, jobs, uids);
    ASSERT_EQ(st.code(), StatusCode::kInternal);
    EXPECT_NE(st.message().find("job " + job + " holds"), std::string::npos) << st.message();
    --jobs[job].held_bytes;
    ++by_state[static_cast<int>(groups[0].state)];
    EXPECT_EQ(ledger.Check(by_state, count, jobs, uids).code(), StatusCode::kInternal);
  }
}

}  // namespace
}  // namespace memoffload::daemon
