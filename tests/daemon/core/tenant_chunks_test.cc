// TenantChunks (daemon/core/tenant_chunks.cc): who owns which chunk and who
// was handed it, asked directly: no arena, no table, no thread.
#include "core/tenant_chunks.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace memoffload::daemon {
namespace {

const auto kAllEmpty = [](uint32_t) { return true; };

TEST(TenantChunksTest, NeverUsedChunksAreClaimedFirstThenTheLowestEmptyOne) {
  TenantChunks t(4, TenantMode::kUid);
  EXPECT_EQ(t.Claimable("a", kAllEmpty), 0);
  t.Assign(0, "a", 0);
  EXPECT_EQ(t.Claimable("a", kAllEmpty), 1);  // its own chunk is not claimable
  EXPECT_EQ(t.Claimable("b", kAllEmpty), 1);  // never used beats a's empty chunk 0
  t.Assign(1, "b", 0);
  t.Assign(2, "b", 0);
  t.Assign(3, "a", 0);
  // Everything used: the lowest empty chunk of another tenant.
  EXPECT_EQ(t.Claimable("b", kAllEmpty), 0);
  EXPECT_EQ(t.Claimable("b", [](uint32_t c) { return c == 3; }), 3);
  EXPECT_EQ(t.Claimable("b", [](uint32_t) { return false; }), -1);
  EXPECT_EQ(t.owned_chunks(), 4u);
  EXPECT_EQ(t.OwnerOf(2), "b");
}

TEST(TenantChunksTest, EachTenantHasItsOwnPoolNumberReusedAfterItGoes) {
  TenantChunks t(4, TenantMode::kUid);
  const uint32_t a = t.Join("a", 0)->pool;
  const uint32_t b = t.Join("b", 0)->pool;
  EXPECT_NE(a, TenantChunks::kNoTenantPool);
  EXPECT_NE(b, TenantChunks::kNoTenantPool);
  EXPECT_NE(a, b);
  t.Assign(0, "a", 0);
  EXPECT_EQ(t.Find("a")->pool, a);  // the same entry, the same pool
  // b goes (no session, no chunk): its number goes to the next new tenant.
  t.Leave("b");
  EXPECT_EQ(t.Find("b"), nullptr);
  EXPECT_EQ(t.Join("c", 0)->pool, b);
  // a keeps its entry, and pool, while it owns a chunk without a session.
  t.Leave("a");
  ASSERT_NE(t.Find("a"), nullptr);
  EXPECT_EQ(t.Find("a")->pool, a);
  // Assign makes an entry for a tenant without one, with a fresh pool.
  t.Assign(1, "d", 0);
  const uint32_t d = t.Find("d")->pool;
  EXPECT_TRUE(d != a && d != b && d != TenantChunks::kNoTenantPool) << d;
  EXPECT_TRUE(t.CheckInvariants({{"c", 1}}).ok()) << t.CheckInvariants({{"c", 1}}).ToString();
}

TEST(TenantChunksTest, AChunkAnOpenSessionOfAnotherTenantHoldsIsNotClaimable) {
  TenantChunks t(2, TenantMode::kUid);
  t.Join("a", 0);
  t.Assign(0, "a", 0);
  t.Assign(1, "a", 0);
  EXPECT_EQ(t.Attach(7, "a", 100), (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(t.Claimable("b", kAllEmpty), -1);  // session 7 maps both
  t.Forget(7);
  t.Leave("a");
  EXPECT_EQ(t.Claimable("b", kAllEmpty), 0);
  // A tenant never claims its own chunk, held or not.
  TenantChunks u(1, TenantMode::kUid);
  u.Join("a", 0);
  u.Assign(0, "a", 0);
  u.Attach(1, "a", 100);
  EXPECT_EQ(u.Claimable("a", kAllEmpty), -1);  // already its own
}

TEST(TenantChunksTest, ChangingTenantHandsTheOldRecipientsBackAndForgetsThem) {
  TenantChunks t(2, TenantMode::kUid);
  t.Join("a", 0);
  t.Assign(0, "a", 0);
  EXPECT_FALSE(t.ChangesTenant(0, "a"));
  EXPECT_FALSE(t.ChangesTenant(1, "b"));  // never used: no new backing
  t.Attach(1, "a", 100);
  ASSERT_TRUE(t.Grant(2, "a", 200, {0}).ok());
  ASSERT_TRUE(t.Grant(2, "a", 200, {0}).ok());  // asked twice: recorded once
  t.Attach(3, "a", 0);                          // no pid known: no recipient
  EXPECT_EQ(t.recipients(0), (std::vector<pid_t>{100, 200}));
  EXPECT_TRUE(t.ChangesTenant(0, "b"));
  for (uint64_t session : {1, 2, 3}) t.Forget(session);
  t.Assign(0, "b", 0);
  EXPECT_TRUE(t.recipients(0).empty());
  EXPECT_EQ(t.OwnerOf(0), "b");
  ASSERT_NE(t.Find("a"), nullptr);  // a still has its session
  EXPECT_TRUE(t.Find("a")->chunks.empty());
  t.Leave("a");
  EXPECT_EQ(t.Find("a"), nullptr);  // no session and no chunk: gone
}

TEST(TenantChunksTest, SessionsAreHandedOnlyTheirTenantsChunks) {
  TenantChunks t(3, TenantMode::kJob);
  t.Assign(0, "job:1:x", 0);
  t.Assign(2, "job:1:x", 0);
  t.Assign(1, "job:1:y", 0);
  EXPECT_EQ(t.Attach(1, "job:1:x", 10), (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(t.Grant(1, "job:1:x", 10, {0, 1}).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(t.Grant(1, "job:1:x", 10, {3}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.recipients(1), std::vector<pid_t>{});  // the refused grant recorded nothing
  TenantChunks none(3, TenantMode::kNone);
  EXPECT_EQ(none.Join("uid:1", 0), nullptr);
  EXPECT_EQ(none.Attach(1, "", 10), (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_TRUE(none.Grant(1, "", 10, {1, 2}).ok());
  EXPECT_EQ(none.owned_chunks(), 0u);
}

TEST(TenantChunksTest, ChunksAreCountedPerUidOverItsTenantsAndMoveBetweenThem) {
  TenantChunks t(4, TenantMode::kJob);
  auto all_empty = [](uint32_t) { return true; };
  t.Join("job:7:x", 7);
  t.Assign(0, "job:7:x", 7);
  t.Assign(1, "job:7:y", 7);  // an entry made by the claim, before any session
  t.Assign(2, "job:8:x", 8);
  EXPECT_EQ(t.UidChunks(7), 2u);
  EXPECT_EQ(t.UidChunks(8), 1u);
  EXPECT_EQ(t.UidChunks(9), 0u);
  EXPECT_TRUE(t.CheckInvariants({{"job:7:x", 1}}).ok());
  // Only chunks of another tenant of the same uid: job:7:y's, not uid 8's,
  // nor the one nobody owns.
  const uid_t seven = 7;
  EXPECT_EQ(t.Claimable("job:7:x", all_empty, &seven), 1);
  EXPECT_EQ(t.Claimable("job:7:x", all_empty), 3);  // never used first
  // Moving between tenants of one uid keeps its count; to another uid, not.
  t.Assign(1, "job:7:x", 7);
  EXPECT_EQ(t.UidChunks(7), 2u);
  EXPECT_EQ(t.Claimable("job:7:x", all_empty, &seven), -1);
  t.Assign(2, "job:7:x", 7);
  EXPECT_EQ(t.UidChunks(7), 3u);
  EXPECT_EQ(t.UidChunks(8), 0u);
  EXPECT_TRUE(t.CheckInvariants({{"job:7:x", 1}}).ok());
}

// Issue 29: a chunk's recipients (the processes handed its backing's fd)
// were only ever added to, and a take-over hands them all to
// FreshBacking::Retire, which opens a pidfd for each under the table lock
// (+0.65 us per pid ever recorded, about 2.7 s at pid_max 4,194,304). A uid
// that attaches from many short-lived processes now leaves a list bounded
// by the processes that live: those that exited are dropped.
TEST(TenantChunksTest, RecipientsThatExitedAreDroppedSoTheListStaysBounded) {
  constexpr size_t kBound = TenantChunks::kRecipientSweep;
  TenantChunks t(1, TenantMode::kUid);
  t.Join("a", 0);
  t.Assign(0, "a", 0);
  t.Attach(1, "a", getpid());  // a recipient that lives
  constexpr int kExited = 500;
  for (int i = 0; i < kExited; ++i) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) _exit(0);
    ASSERT_EQ(waitpid(child, nullptr, 0), child);
    t.Attach(2 + i, "a", child);
    t.Forget(2 + i);
  }
  const std::vector<pid_t>& recipients = t.recipients(0);
  EXPECT_LE(recipients.size(), kBound) << "recipients after " << kExited << " exited processes";
  EXPECT_NE(std::find(recipients.begin(), recipients.end(), getpid()), recipients.end())
      << "the live recipient was dropped";
}

// Processes attach, attach again and exit at random, in phases where their
// number grows and shrinks, against a model: every recipient that lives is
// still listed (FreshBacking counts it as keeping the backing), none twice,
// and the list stays under max(kRecipientSweep, 2 x the most that lived).
TEST(TenantChunksTest, RandomRecipientsKeepEveryLiveOneAndStayBounded) {
  std::set<pid_t> alive;
  TenantChunks t(2, TenantMode::kUid, [&](pid_t pid) { return alive.count(pid) != 0; });
  t.Join("a", 0);
  t.Assign(0, "a", 0);
  t.Assign(1, "a", 0);
  std::vector<std::set<pid_t>> handed(2);  // the model: who was handed each chunk
  std::mt19937_64 rng(29);
  pid_t next_pid = 100;
  uint64_t next_session = 1;
  size_t most_alive = 0;
  auto random_alive = [&] {
    return *std::next(alive.begin(), static_cast<std::ptrdiff_t>(rng() % alive.size()));
  };
  for (int step = 0; step < 16000; ++step) {
    const bool growing = (step / 1000) % 2 == 0;
    const uint64_t roll = rng() % 4;
    if (roll < (growing ? 2u : 1u)) {  // a new process attaches: both chunks
      const pid_t pid = next_pid++;
      alive.insert(pid);
      const uint64_t session = next_session++;
      t.Attach(session, "a", pid);
      t.Forget(session);
      handed[0].insert(pid);
      handed[1].insert(pid);
    } else if (roll == 2 && !alive.empty()) {  // a live one asks for chunk 1 again
      const pid_t pid = random_alive();
      const uint64_t session = next_session++;
      ASSERT_TRUE(t.Grant(session, "a", pid, {1}).ok());
      t.Forget(session);
    } else if (!alive.empty()) {  // one exits
      alive.erase(random_alive());
    }
    most_alive = std::max(most_alive, alive.size());
    for (uint32_t c = 0; c < 2; ++c) {
      const std::vector<pid_t>& listed = t.recipients(c);
      const std::set<pid_t> unique(listed.begin(), listed.end());
      ASSERT_EQ(unique.size(), listed.size()) << "step " << step << ": a recipient twice";
      ASSERT_LT(listed.size(), std::max(TenantChunks::kRecipientSweep, 2 * most_alive))
          << "step " << step;
      for (pid_t pid : alive) {
        if (handed[c].count(pid) != 0) {
          ASSERT_EQ(unique.count(pid), 1u) << "step " << step << ": live pid " << pid << " dropped";
        }
      }
    }
  }
  EXPECT_GT(most_alive, TenantChunks::kRecipientSweep);  // the phases reached past the first sweep
}

// Random opens, closes, grants and claims against a model of the rules:
// Claimable picks what the rules pick, every chunk is in its owner's list
// only, lists stay ascending, and Join's entry stays put.
TEST(TenantChunksTest, RandomTurnoverFollowsTheRules) {
  constexpr uint32_t kChunks = 16;
  std::mt19937_64 rng(14);
  TenantChunks t(kChunks, TenantMode::kUid);
  const std::vector<std::string> tenants = {"uid:1", "uid:2", "uid:3", "uid:4"};
  std::unordered_map<std::string, uint32_t> sessions;
  std::unordered_map<std::string, const TenantChunks::Owned*> entries;
  std::map<uint64_t, std::string> open;                           // session -> tenant
  std::vector<std::map<uint64_t, std::string>> holders(kChunks);  // the model's
  std::vector<std::string> owner(kChunks);
  std::set<uint32_t> busy;  // chunks that hold an extent
  uint64_t next_session = 1;
  auto hand = [&](uint32_t c, uint64_t id) { holders[c][id] = open.at(id); };
  for (int step = 0; step < 20000; ++step) {
    const std::string& tenant = tenants[rng() % tenants.size()];
    switch (rng() % 5) {
      case 0: {  // open
        const TenantChunks::Owned* entry = t.Join(tenant, 0);
        if (sessions[tenant]++ > 0) {
          ASSERT_EQ(entry, entries[tenant]);
        }
        entries[tenant] = entry;
        const uint64_t id = next_session++;
        open[id] = tenant;
        std::vector<uint32_t> want;
        for (uint32_t c = 0; c < kChunks; ++c) {
          if (owner[c] == tenant) want.push_back(c);
        }
        ASSERT_EQ(t.Attach(id, tenant, 1000), want);
        for (uint32_t c : want) hand(c, id);
        break;
      }
      case 1:  // close
        if (!open.empty()) {
          auto it = std::next(open.begin(), static_cast<std::ptrdiff_t>(rng() % open.size()));
          t.Forget(it->first);
          t.Leave(it->second);
          for (auto& h : holders) h.erase(it->first);
          if (--sessions[it->second] == 0) sessions.erase(it->second);
          open.erase(it);
        }
        break;
      case 2: {  // claim an empty chunk
        int64_t want = -1;
        for (uint32_t c = 0; c < kChunks && !(want >= 0 && owner[want].empty()); ++c) {
          if (owner[c] == tenant || busy.count(c) != 0) continue;
          bool foreign = false;
          for (const auto& [id, who] : holders[c]) foreign |= who != tenant;
          if (foreign) continue;
          if (owner[c].empty() || want < 0) want = c;
        }
        const int64_t c = t.Claimable(tenant, [&](uint32_t k) { return busy.count(k) == 0; });
        ASSERT_EQ(c, want) << "step " << step;
        if (c < 0) break;
        ASSERT_EQ(t.ChangesTenant(static_cast<uint32_t>(c), tenant), !owner[c].empty());
        if (!owner[c].empty()) holders[c].clear();
        owner[c] = tenant;
        t.Assign(static_cast<uint32_t>(c), tenant, 0);
        break;
      }
      case 3: {  // fill or empty a chunk
        const uint32_t c = static_cast<uint32_t>(rng() % kChunks);
        if (!busy.insert(c).second) busy.erase(c);
        break;
      }
      case 4:  // a session asks for a chunk
        if (!open.empty()) {
          auto it = std::next(open.begin(), static_cast<std::ptrdiff_t>(rng() % open.size()));
          const uint32_t c = static_cast<uint32_t>(rng() % kChunks);
          const Status st = t.Grant(it->first, it->second, 1000, {c});
          ASSERT_EQ(st.ok(), owner[c] == it->second) << st.ToString();
          if (st.ok()) hand(c, it->first);
        }
        break;
    }
    const Status invariants = t.CheckInvariants(sessions);
    ASSERT_TRUE(invariants.ok()) << "step " << step << ": " << invariants.ToString();
  }
}

}  // namespace
}  // namespace memoffload::daemon
