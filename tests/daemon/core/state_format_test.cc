// The kept state's formats (core/state_format.h): round trips, a journal
// cut short or damaged anywhere keeps its readable prefix, newer versions
// are refused by name, and the checked-in v1 snapshot still decodes.
#include "core/state_format.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

namespace memoffload::daemon {
namespace {

RegionRecord Region(const std::string& name, uint32_t chunk, uint64_t offset) {
  RegionRecord r;
  r.uid = 1000;
  r.job_id = "job-a";
  r.tenant = "uid:1000";
  r.name = name;
  r.used_bytes = 4096 + 100;
  r.ttl_ms = 3600000;
  r.committed_unix = 1795000000.25;
  r.extents = {Extent{chunk, offset, 4096}, Extent{chunk, offset + 8192, 4096}};
  r.extent_crc32c = {0x11223344, 0x55667788};
  return r;
}

void ExpectSame(const RegionRecord& a, const RegionRecord& b) {
  EXPECT_EQ(KeyOf(a), KeyOf(b));
  EXPECT_EQ(a.tenant, b.tenant);
  EXPECT_EQ(a.used_bytes, b.used_bytes);
  EXPECT_EQ(a.ttl_ms, b.ttl_ms);
  EXPECT_EQ(a.committed_unix, b.committed_unix);
  ASSERT_EQ(a.extents.size(), b.extents.size());
  for (size_t i = 0; i < a.extents.size(); ++i) {
    EXPECT_EQ(a.extents[i].chunk, b.extents[i].chunk);
    EXPECT_EQ(a.extents[i].offset, b.extents[i].offset);
    EXPECT_EQ(a.extents[i].length, b.extents[i].length);
  }
  EXPECT_EQ(a.extent_crc32c, b.extent_crc32c);
}

const ArenaLayout kLayout{64ull << 20, 16ull << 20, 4096};

// A journal of kJournalBytes-like size holding header + records.
std::string Journal(uint64_t first_seq, const std::vector<std::string>& records,
                    size_t size = 1 << 16) {
  std::string j = EncodeJournalHeader(kLayout, 0xabcdef, first_seq);
  for (const std::string& r : records) j += r;
  j.resize(size, '\0');
  return j;
}

TEST(StateFormat, SnapshotRoundTrips) {
  SnapshotContents s;
  s.last_seq = 41;
  s.instance_id = 0x1234567890abcdefull;
  s.layout = kLayout;
  for (const RegionRecord& r : {Region("a", 0, 0), Region("b", 1, 4096)}) s.regions[KeyOf(r)] = r;
  const std::string bytes = EncodeSnapshot(s);
  Result<SnapshotContents> back = DecodeSnapshot(bytes.data(), bytes.size());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->last_seq, 41u);
  EXPECT_EQ(back->instance_id, s.instance_id);
  EXPECT_TRUE(back->layout == kLayout);
  ASSERT_EQ(back->regions.size(), 2u);
  for (const auto& [key, r] : s.regions) ExpectSame(r, back->regions.at(key));
}

SessionRecord Session(uint64_t id) {
  SessionRecord s;
  s.id = id;
  s.token = "t0ken-" + std::to_string(id);
  s.uid = 1000;
  s.gid = 100;
  s.pid = 4242;
  s.job_id = "job a";
  s.rank = 3;
  s.local_rank = 1;
  s.max_bytes = 1 << 20;
  s.kind = 2;
  s.limit_bytes = 8 << 20;
  s.groups = {GroupRecord{7, 1, 5000, {Extent{0, 0, 8192}}, {0xdeadbeef}},
              GroupRecord{9, 0, 0, {Extent{1, 4096, 4096}, Extent{2, 0, 4096}}, {}}};
  s.writing = {Region("half", 3, 0)};
  s.opened = {"a", "a"};
  return s;
}

// A take-over's snapshot carries the sessions (v2); one without sessions is
// still written as v1, which an older daemon reads.
TEST(StateFormat, SessionsRoundTripAsV2AndNoneIsV1) {
  SnapshotContents s;
  s.layout = kLayout;
  s.regions[KeyOf(Region("a", 0, 0))] = Region("a", 0, 0);
  std::string bytes = EncodeSnapshot(s);
  EXPECT_EQ(bytes[8], 1);
  s.sessions = {Session(5), Session(6)};
  bytes = EncodeSnapshot(s);
  EXPECT_EQ(bytes[8], 2);
  Result<SnapshotContents> back = DecodeSnapshot(bytes.data(), bytes.size());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->sessions.size(), 2u);
  const SessionRecord& a = s.sessions[0];
  const SessionRecord& b = back->sessions[0];
  EXPECT_EQ(b.id, 5u);
  EXPECT_EQ(b.token, a.token);
  EXPECT_EQ(b.uid, a.uid);
  EXPECT_EQ(b.gid, a.gid);
  EXPECT_EQ(b.pid, a.pid);
  EXPECT_EQ(b.job_id, a.job_id);
  EXPECT_EQ(b.rank, 3);
  EXPECT_EQ(b.local_rank, 1);
  EXPECT_EQ(b.max_bytes, a.max_bytes);
  EXPECT_EQ(b.kind, 2);
  EXPECT_EQ(b.limit_bytes, a.limit_bytes);
  ASSERT_EQ(b.groups.size(), 2u);
  EXPECT_EQ(b.groups[0].id, 7u);
  EXPECT_EQ(b.groups[0].state, 1);
  EXPECT_EQ(b.groups[0].used_bytes, 5000u);
  EXPECT_EQ(b.groups[0].extent_crc32c, std::vector<uint32_t>{0xdeadbeef});
  ASSERT_EQ(b.groups[1].extents.size(), 2u);
  EXPECT_EQ(b.groups[1].extents[1].chunk, 2u);
  ASSERT_EQ(b.writing.size(), 1u);
  ExpectSame(b.writing[0], a.writing[0]);
  EXPECT_EQ(b.opened, a.opened);
  EXPECT_TRUE(back->owners.empty());
  // The chunks' owners come with the sessions, and a replay keeps both.
  s.owners = {{3, "uid:1000", 1000}, {9, "job:7:a b", 7}};
  bytes = EncodeSnapshot(s);
  back = DecodeSnapshot(bytes.data(), bytes.size());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->owners.size(), 2u);
  EXPECT_EQ(back->owners[1].chunk, 9u);
  EXPECT_EQ(back->owners[1].tenant, "job:7:a b");
  EXPECT_EQ(back->owners[1].uid, 7u);
  const ReplayedState replayed = Replay(&*back, {});
  EXPECT_EQ(replayed.sessions.size(), 2u);
  EXPECT_EQ(replayed.owners.size(), 2u);
  // Two sessions of one id: refused.
  s.sessions[1].id = 5;
  bytes = EncodeSnapshot(s);
  EXPECT_EQ(DecodeSnapshot(bytes.data(), bytes.size()).status().code(), StatusCode::kDataLoss);
}

TEST(StateFormat, SnapshotWithAnyByteFlippedIsRefused) {
  SnapshotContents s;
  s.layout = kLayout;
  s.regions[KeyOf(Region("a", 0, 0))] = Region("a", 0, 0);
  s.sessions = {Session(1)};
  const std::string bytes = EncodeSnapshot(s);
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] ^= 0x01;
    Result<SnapshotContents> back = DecodeSnapshot(bad.data(), bad.size());
    EXPECT_FALSE(back.ok()) << "byte " << i;
  }
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(DecodeSnapshot(bytes.data(), n).ok()) << "cut at " << n;
  }
}

TEST(StateFormat, JournalReplaysInSequence) {
  const std::string j = Journal(
      5, {EncodeRegionCommitted(5, Region("a", 0, 0)), EncodeRegionCommitted(6, Region("b", 1, 0)),
          EncodeRegionDeleted(7, KeyOf(Region("a", 0, 0)))});
  Result<JournalContents> got = DecodeJournal(j.data(), j.size());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->stopped, "");
  ASSERT_EQ(got->entries.size(), 3u);
  ReplayedState state = Replay(nullptr, {*got});
  EXPECT_TRUE(state.found);
  EXPECT_EQ(state.instance_id, 0xabcdefu);
  EXPECT_EQ(state.last_seq, 7u);
  ASSERT_EQ(state.regions.size(), 1u);
  ExpectSame(state.regions.begin()->second, Region("b", 1, 0));
}

TEST(StateFormat, AJournalHeaderCarriesItsDaemonsGenerationWhereV1LeftZeros) {
  std::string j = EncodeJournalHeader(kLayout, 0xabcdef, 3, 0x1122334455667788ull);
  ASSERT_EQ(j.size(), kJournalHeaderBytes);
  Result<JournalContents> got = DecodeJournal(j.data(), j.size());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->generation, 0x1122334455667788ull);
  EXPECT_EQ(got->first_seq, 3u);
  // A header written before the generation (zeros there) reads as 0, and
  // the field sits in the bytes that header kept zero.
  const std::string old = EncodeJournalHeader(kLayout, 0xabcdef, 3);
  got = DecodeJournal(old.data(), old.size());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->generation, 0u);
  size_t differ = 0;
  for (size_t i = 0; i + 4 < kJournalHeaderBytes; ++i) differ += j[i] != old[i];
  EXPECT_EQ(differ, 8u);
  EXPECT_EQ(old.substr(48, 12), std::string(12, '\0'));
}

TEST(StateFormat, AJournalCutAnywhereKeepsItsWholeRecords) {
  const std::vector<std::string> records = {EncodeRegionCommitted(1, Region("a", 0, 0)),
                                            EncodeRegionCommitted(2, Region("b", 1, 0)),
                                            EncodeRegionCommitted(3, Region("c", 2, 0))};
  const std::string full = Journal(1, records, 0);
  size_t whole_end[4] = {kJournalHeaderBytes, 0, 0, 0};
  for (int i = 0; i < 3; ++i) whole_end[i + 1] = whole_end[i] + records[i].size();
  // A SIGKILL in the middle of a record: the bytes written so far, zeros after.
  for (size_t cut = kJournalHeaderBytes; cut <= full.size(); ++cut) {
    std::string j = full.substr(0, cut);
    j.resize(full.size() + 64, '\0');
    Result<JournalContents> got = DecodeJournal(j.data(), j.size());
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    size_t whole = 0;
    while (whole < 3 && whole_end[whole + 1] <= cut) ++whole;
    EXPECT_EQ(got->entries.size(), whole) << "cut at " << cut;
    EXPECT_EQ(got->end_offset, whole_end[whole]) << "cut at " << cut;
  }
}

TEST(StateFormat, ADamagedRecordEndsThePrefixAndSaysWhere) {
  const std::string r1 = EncodeRegionCommitted(1, Region("a", 0, 0));
  const std::string r2 = EncodeRegionCommitted(2, Region("b", 1, 0));
  std::string j = Journal(1, {r1, r2, EncodeRegionCommitted(3, Region("c", 2, 0))});
  j[kJournalHeaderBytes + r1.size() + 30] ^= 0x40;  // inside record 2's payload
  Result<JournalContents> got = DecodeJournal(j.data(), j.size());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->entries.size(), 1u);
  EXPECT_NE(got->stopped.find("fails its CRC32C"), std::string::npos) << got->stopped;
  EXPECT_NE(got->stopped.find(std::to_string(kJournalHeaderBytes + r1.size())), std::string::npos);
}

TEST(StateFormat, ASequenceGapEndsTheReplay) {
  const std::string j = Journal(1, {EncodeRegionCommitted(1, Region("a", 0, 0)),
                                    EncodeRegionCommitted(3, Region("b", 1, 0))});
  Result<JournalContents> got = DecodeJournal(j.data(), j.size());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->entries.size(), 1u);
  EXPECT_NE(got->stopped.find("expected 2"), std::string::npos) << got->stopped;
}

TEST(StateFormat, ReplayAppliesOnlyRecordsAfterTheSnapshot) {
  SnapshotContents s;
  s.last_seq = 10;
  s.instance_id = 0xabcdef;
  s.layout = kLayout;
  s.regions[KeyOf(Region("a", 0, 0))] = Region("a", 0, 0);
  // An old journal (records up to 10, already in the snapshot) and the new one.
  const std::string old_j = Journal(9, {EncodeRegionDeleted(9, KeyOf(Region("a", 0, 0))),
                                        EncodeRegionCommitted(10, Region("a", 0, 0))});
  const std::string new_j = Journal(11, {EncodeRegionCommitted(11, Region("b", 1, 0))});
  Result<JournalContents> a = DecodeJournal(old_j.data(), old_j.size());
  Result<JournalContents> b = DecodeJournal(new_j.data(), new_j.size());
  ASSERT_TRUE(a.ok() && b.ok());
  ReplayedState state = Replay(&s, {*b, *a});
  EXPECT_EQ(state.last_seq, 11u);
  EXPECT_EQ(state.journal_records, 1u);
  EXPECT_EQ(state.regions.size(), 2u);
}

TEST(StateFormat, ANewerVersionIsRefusedByName) {
  SnapshotContents s;
  s.layout = kLayout;
  std::string snap = EncodeSnapshot(s);
  snap[8] = 3;  // version 3, CRC left as it was: the version is read first
  Result<SnapshotContents> got = DecodeSnapshot(snap.data(), snap.size());
  EXPECT_EQ(got.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(got.status().message().find("v3"), std::string::npos) << got.status().message();
  std::string j = Journal(1, {});
  j[8] = 7;
  Result<JournalContents> jg = DecodeJournal(j.data(), j.size());
  EXPECT_EQ(jg.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(jg.status().message().find("reads up to v2"), std::string::npos);
}

// tests/daemon/core/data/state_v1.snapshot: written by the first version of
// this format (regions "dcp/step-100/__0_0.distcp" and "scratch"); every later
// daemon must read it (make it again only with a new version, beside it).
TEST(StateFormat, TheV1FixtureStillDecodes) {
  std::ifstream in(std::string(MEMOFFLOAD_TEST_DATA_DIR) + "/state_v1.snapshot", std::ios::binary);
  ASSERT_TRUE(in.good()) << "fixture missing";
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string bytes = buf.str();
  Result<SnapshotContents> got = DecodeSnapshot(bytes.data(), bytes.size());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->version, 1u);
  EXPECT_EQ(got->last_seq, 17u);
  EXPECT_EQ(got->instance_id, 0x5eed5eed5eed5eedull);
  EXPECT_EQ(got->layout.capacity_bytes, 64ull << 20);
  EXPECT_EQ(got->layout.chunk_bytes, 16ull << 20);
  ASSERT_EQ(got->regions.size(), 2u);
  const RegionRecord& r = got->regions.at(RegionKey{1000, "job-a", "dcp/step-100/__0_0.distcp"});
  EXPECT_EQ(r.used_bytes, 4196u);
  EXPECT_EQ(r.extents.size(), 2u);
  EXPECT_EQ(r.extent_crc32c.size(), 2u);
  const RegionRecord& u = got->regions.at(RegionKey{1001, "job-b", "scratch"});
  EXPECT_TRUE(u.extent_crc32c.empty());
}

}  // namespace
}  // namespace memoffload::daemon
