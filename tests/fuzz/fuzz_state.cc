// Fuzzes the kept state's decoders (daemon/core/state_format.h): what a
// restart reads back from memfds that outlived the daemon. The input is
// read as a snapshot and as a journal; then the replayed regions are placed
// in a table (SessionTable::Recover), as a start does. Checks:
//   - a decoded snapshot re-encodes to bytes that decode to the same state;
//   - a journal's readable prefix ends inside the input, its records in
//     sequence, and re-encoding them gives records of the same length that
//     decode whole;
//   - whatever Recover places or drops, the table's invariants hold and every
//     kept region reads back with its own extents;
//   - a take-over's sessions (v2) are placed back or dropped, each counted
//     once, the invariants hold, and closing them frees all they held.
#include <chrono>
#include <cstdint>
#include <string>

#include "core/session_table.h"
#include "core/state_format.h"
#include "fuzz_common.h"

namespace memoffload::fuzz {
namespace {

void PlaceAndCheck(const std::map<daemon::RegionKey, daemon::RegionRecord>& regions,
                   const std::vector<daemon::SessionRecord>& sessions = {},
                   const std::vector<daemon::ChunkOwnerRecord>& kept_owners = {}) {
  daemon::Arena* arena = SharedArena();
  std::vector<daemon::RegionRecord> list;
  for (const auto& [key, r] : regions) list.push_back(r);
  daemon::Policy policy;
  daemon::SessionTable table(arena, policy, daemon::TenantMode::kUid);
  std::vector<std::string> dropped;
  daemon::SessionTable::Recovered got = table.Recover(list, &dropped);
  Check(got.regions + dropped.size() == list.size(), "Recover lost count of a region");
  CheckOk(table.CheckInvariants(), "table invariants after Recover");
  if (!sessions.empty()) {
    // The owners the snapshot names (as a restart's start gives them), then
    // those a take-over would name: each session's chunks its uid's.
    std::vector<daemon::SessionTable::ChunkOwner> owners = kept_owners;
    for (const daemon::SessionRecord& s : sessions) {
      for (const daemon::GroupRecord& g : s.groups) {
        for (const Extent& e : g.extents) {
          owners.push_back({e.chunk, "uid:" + std::to_string(s.uid), s.uid});
        }
      }
    }
    table.AdoptChunkOwners(owners);
    std::vector<std::string> gone;
    daemon::SessionTable::Adopted adopted =
        table.AdoptSessions(sessions, std::chrono::seconds(1), &gone);
    Check(adopted.sessions + gone.size() == sessions.size(), "AdoptSessions lost a session");
    CheckOk(table.CheckInvariants(), "table invariants after AdoptSessions");
    for (const daemon::SessionSnapshot& s : table.ListSessions()) {
      CheckOk(table.Close(s.session_id, daemon::CloseReason::kLifelineClosed).status(),
              "closing an adopted session");
    }
    CheckOk(table.CheckInvariants(), "table invariants after closing the sessions");
  }
  for (const daemon::RegionRecord& r : table.CommittedRegions()) {
    Check(regions.count(daemon::KeyOf(r)) == 1, "Recover placed a region it was not given");
    // The arena is shared by every iteration: give the region back.
    Result<uint64_t> freed = table.DeleteRegionOf(r.uid, r.job_id, r.name);
    CheckOk(freed.status(), "deleting a recovered region");
    Check(*freed == r.held_bytes(), "a recovered region freed other than its extents");
  }
  Check(arena->allocator().used_bytes() == 0, "Recover left bytes allocated");
}

}  // namespace
}  // namespace memoffload::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memoffload;
  using namespace memoffload::daemon;
  using memoffload::fuzz::Check;
  Result<SnapshotContents> s = DecodeSnapshot(data, size);
  if (s.ok()) {
    const std::string again = EncodeSnapshot(*s);
    Result<SnapshotContents> back = DecodeSnapshot(again.data(), again.size());
    Check(back.ok() && back->regions.size() == s->regions.size() && back->last_seq == s->last_seq &&
              back->instance_id == s->instance_id,
          "a decoded snapshot does not survive re-encoding");
    Check(back.ok() && back->sessions.size() == s->sessions.size(),
          "a decoded snapshot's sessions do not survive re-encoding");
    Check(back.ok() && (s->sessions.empty() || back->owners.size() == s->owners.size()),
          "a decoded snapshot's chunk owners do not survive re-encoding");
    memoffload::fuzz::PlaceAndCheck(s->regions, s->sessions, s->owners);
  } else {
    Check(!s.status().message().empty(), "snapshot refused without a message");
  }
  Result<JournalContents> j = DecodeJournal(data, size);
  if (j.ok()) {
    Check(j->end_offset <= size, "journal prefix ends past the input");
    std::string again(reinterpret_cast<const char*>(data), kJournalHeaderBytes);
    for (size_t i = 0; i < j->entries.size(); ++i) {
      const JournalEntry& e = j->entries[i];
      Check(e.seq == j->first_seq + i, "journal records out of sequence");
      again += e.type == JournalRecordType::kRegionCommitted
                   ? EncodeRegionCommitted(e.seq, e.region)
                   : EncodeRegionDeleted(e.seq, KeyOf(e.region));
    }
    Check(again.size() == j->end_offset, "journal records re-encode to another length");
    Result<JournalContents> back = DecodeJournal(again.data(), again.size());
    Check(back.ok() && back->entries.size() == j->entries.size() && back->stopped.empty(),
          "re-encoded journal records do not decode whole");
    ReplayedState state = Replay(nullptr, {*j});
    memoffload::fuzz::PlaceAndCheck(state.regions);
  }
  return 0;
}
