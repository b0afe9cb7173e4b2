// The tenant-restricted Reserve path (SessionTable::TryReserve with the
// tenant's chunk list, TenantChunks, daemon/core/tenant_chunks.cc): a reservation lands
// only in chunks its tenant owns, and the list follows the chunks as they
// are claimed, emptied and taken over by another tenant.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <vector>

#include "core/session_table.h"
#include "memoffload/common/units.h"
#include "test_arena.h"

namespace memoffload::daemon {
namespace {

std::set<uint32_t> ChunksOf(const ExtentList& extents) {
  std::set<uint32_t> out;
  for (const Extent& e : extents) out.insert(e.chunk);
  return out;
}

// The chunks a tenant owns, as a new session of it is told at attach.
std::set<uint32_t> OwnedBy(SessionTable& table, uid_t uid) {
  SessionGrant probe = OpenAs(table, uid, "probe");
  auto chunks = table.AttachChunks(probe.session_id);
  EXPECT_TRUE(chunks.ok());
  std::set<uint32_t> out;
  for (const ChunkGrant& g : chunks.ok() ? *chunks : std::vector<ChunkGrant>{}) out.insert(g.index);
  EXPECT_TRUE(table.Close(probe.session_id, CloseReason::kLifelineClosed).ok());
  return out;
}

bool Within(const std::set<uint32_t>& part, const std::set<uint32_t>& whole) {
  for (uint32_t c : part) {
    if (whole.count(c) == 0) return false;
  }
  return true;
}

TEST(RestrictedReserve, FollowsChunksThatChangeTenant) {
  auto arena = MakeTestArena();  // four 1 MiB chunks
  ASSERT_NE(arena, nullptr);
  SessionTable table(arena.get(), Policy{}, TenantMode::kUid);
  SessionGrant a = OpenAs(table, 1000);
  SessionGrant b = OpenAs(table, 2000);

  // A claims two chunks, B one; A's next reserve fits in A's second chunk.
  auto a1 = table.Reserve(a.session_id, a.token, 1, kMiB + kMiB / 2, false);
  ASSERT_TRUE(a1.ok()) << a1.status().ToString();
  auto b1 = table.Reserve(b.session_id, b.token, 1, kMiB, false);
  ASSERT_TRUE(b1.ok()) << b1.status().ToString();
  const std::set<uint32_t> a_chunks = ChunksOf(a1->extents);
  ASSERT_EQ(a_chunks.size(), 2u);
  EXPECT_EQ(OwnedBy(table, 1000), a_chunks);
  EXPECT_EQ(OwnedBy(table, 2000), ChunksOf(b1->extents));
  auto a2 = table.Reserve(a.session_id, a.token, 2, kMiB / 2, false);
  ASSERT_TRUE(a2.ok()) << a2.status().ToString();
  EXPECT_TRUE(Within(ChunksOf(a2->extents), a_chunks));
  EXPECT_EQ(table.Snapshot().owned_chunks, 3u);

  // A empties its chunks; B, now full, takes the never-used chunk and then
  // one of A's (with a new backing).
  ASSERT_TRUE(table.Release(a.session_id, a.token, 1).ok());
  ASSERT_TRUE(table.Release(a.session_id, a.token, 2).ok());
  auto b2 = table.Reserve(b.session_id, b.token, 2, 2 * kMiB, false);
  ASSERT_TRUE(b2.ok()) << b2.status().ToString();
  const std::set<uint32_t> b_chunks = OwnedBy(table, 2000);
  EXPECT_EQ(b_chunks.size(), 3u);
  EXPECT_TRUE(Within(ChunksOf(b2->extents), b_chunks));
  EXPECT_EQ(table.Snapshot().replaced_backings, 1u);

  // B empties its chunks too, but they stay B's. A keeps only the chunk B
  // did not take, and its reserves land there, never in the (empty) chunk
  // it lost.
  ASSERT_TRUE(table.Release(b.session_id, b.token, 2).ok());
  const std::set<uint32_t> a_left = OwnedBy(table, 1000);
  ASSERT_EQ(a_left.size(), 1u);
  EXPECT_TRUE(Within(a_left, a_chunks));
  EXPECT_EQ(OwnedBy(table, 2000), b_chunks);
  for (uint64_t group = 3; group < 7; ++group) {
    auto r = table.Reserve(a.session_id, a.token, group, kMiB / 4, false);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(ChunksOf(r->extents), a_left) << "group " << group;
  }
  // A is full: it takes one of B's empty chunks over (another new backing)
  // and lands there; B no longer owns it.
  auto a7 = table.Reserve(a.session_id, a.token, 7, kMiB / 4, false);
  ASSERT_TRUE(a7.ok()) << a7.status().ToString();
  ASSERT_EQ(ChunksOf(a7->extents).size(), 1u);
  const uint32_t taken = *ChunksOf(a7->extents).begin();
  EXPECT_EQ(b_chunks.count(taken), 1u);
  EXPECT_EQ(OwnedBy(table, 1000).count(taken), 1u);
  EXPECT_EQ(OwnedBy(table, 2000).count(taken), 0u);
  EXPECT_EQ(table.Snapshot().replaced_backings, 2u);
  EXPECT_TRUE(table.CheckInvariants().ok()) << table.CheckInvariants().ToString();
}

// Random reserves, releases and session turnover of four tenants in eight
// 1 MiB chunks. Checked after every step: no chunk holds live extents of
// two tenants; every chunk a reservation lands in is its tenant's; a
// reserve of at most a chunk fails only when no chunk is wholly free (no
// session maps any chunk here, so an empty chunk can always be claimed);
// and the table's own invariants (tenant lists included).
TEST(RestrictedReserve, RandomTurnoverKeepsEachTenantInItsChunks) {
  auto arena = MakeTestArena(8 * kMiB, kMiB);
  ASSERT_NE(arena, nullptr);
  SessionTable table(arena.get(), Policy{}, TenantMode::kUid);
  constexpr int kTenants = 4;
  struct Held {
    int tenant;
    uint64_t group;
    ExtentList extents;
  };
  std::vector<SessionGrant> sessions;
  for (int t = 0; t < kTenants; ++t) sessions.push_back(OpenAs(table, 1000 + t));
  std::vector<Held> held;
  std::map<uint32_t, std::map<int, int>> live;  // chunk -> tenant -> live extents
  std::mt19937_64 rng(14);
  uint64_t next_group = 1;
  int placed = 0, refused = 0;
  for (int step = 0; step < 4000; ++step) {
    const int op = std::uniform_int_distribution<int>(0, 9)(rng);
    if (op < 5 || held.empty()) {
      const int t = std::uniform_int_distribution<int>(0, kTenants - 1)(rng);
      const uint64_t bytes = std::uniform_int_distribution<uint64_t>(1, kMiB)(rng);
      const uint64_t group = next_group++;
      auto r = table.Reserve(sessions[t].session_id, sessions[t].token, group, bytes, false);
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
        for (uint32_t c = 0; c < 8; ++c) {
          int extents = 0;
          for (const auto& [tenant, n] : live[c]) extents += n;
          ASSERT_NE(extents, 0) << "step " << step << ": tenant " << t << " refused " << bytes
                                << " bytes while chunk " << c
                                << " is empty: " << r.status().ToString();
        }
        ++refused;
      } else {
        const std::set<uint32_t> owned = OwnedBy(table, 1000 + t);
        for (const Extent& e : r->extents) {
          ASSERT_EQ(owned.count(e.chunk), 1u)
              << "step " << step << ": tenant " << t << " placed in chunk " << e.chunk;
          ++live[e.chunk][t];
        }
        held.push_back(Held{t, group, r->extents});
        ++placed;
      }
    } else if (op < 9) {
      const size_t k = std::uniform_int_distribution<size_t>(0, held.size() - 1)(rng);
      const Held h = held[k];
      held[k] = held.back();
      held.pop_back();
      ASSERT_TRUE(
          table.Release(sessions[h.tenant].session_id, sessions[h.tenant].token, h.group).ok());
      for (const Extent& e : h.extents) {
        if (--live[e.chunk][h.tenant] == 0) live[e.chunk].erase(h.tenant);
      }
    } else {
      // A tenant's session ends (dropping what it holds) and another opens.
      const int t = std::uniform_int_distribution<int>(0, kTenants - 1)(rng);
      ASSERT_TRUE(table.Close(sessions[t].session_id, CloseReason::kLifelineClosed).ok());
      for (size_t k = 0; k < held.size();) {
        if (held[k].tenant != t) {
          ++k;
          continue;
        }
        for (const Extent& e : held[k].extents) {
          if (--live[e.chunk][t] == 0) live[e.chunk].erase(t);
        }
        held[k] = held.back();
        held.pop_back();
      }
      sessions[t] = OpenAs(table, 1000 + t);
    }
    for (const auto& [chunk, tenants] : live) {
      ASSERT_LE(tenants.size(), 1u)
          << "step " << step << ": chunk " << chunk << " holds extents of two tenants";
    }
    const Status st = table.CheckInvariants();
    ASSERT_TRUE(st.ok()) << "step " << step << ": " << st.ToString();
  }
  // The workload both places and runs full, and chunks change tenant.
  EXPECT_GT(placed, 1000);
  EXPECT_GT(refused, 10);
  EXPECT_GT(table.Snapshot().replaced_backings, 10u);
}

}  // namespace
}  // namespace memoffload::daemon
