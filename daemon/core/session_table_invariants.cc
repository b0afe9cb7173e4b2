// SessionTable::CheckInvariants: the table's accounting (sessions, groups,
// jobs, uids, regions and the chunks regions pin) recounted from the
// records and compared with its counters and the allocator.
#include "core/session_table.h"

namespace memoffload::daemon {

Status SessionTable::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  MEMOFFLOAD_RETURN_IF_ERROR(arena_->allocator().CheckInvariants());
  MEMOFFLOAD_RETURN_IF_ERROR(CheckTenantChunks());
  uint64_t held = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(CheckSessionRecords(&held));
  uint64_t region_held = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRegionRecords(&region_held));
  held += region_held;
  if (held != arena_->allocator().used_bytes()) {
    return Internal("sessions and regions hold " + std::to_string(held) +
                    " bytes, allocator says " + std::to_string(arena_->allocator().used_bytes()));
  }
  return Status::Ok();
}

Status SessionTable::CheckSessionRecords(uint64_t* held) const {
  uint64_t groups = 0, by_state[3] = {0, 0, 0};
  std::unordered_map<std::string, Ledger::Job> job_held;
  std::unordered_map<uid_t, Ledger::UidTotals> uid_held;
  Ledger::ByKind by_kind{};
  for (const auto& [id, s] : sessions_) {
    if (auto job = ledger_.jobs().find(s.job_key);
        job == ledger_.jobs().end() || &job->second != s.account.job) {
      return Internal("session " + std::to_string(id) + " does not point at its job " + s.job_key);
    }
    if (auto uid = ledger_.uids().find(s.peer.uid);
        uid == ledger_.uids().end() || &uid->second != s.account.uid) {
      return Internal("session " + std::to_string(id) + " does not point at its uid's totals");
    }
    uint64_t session_held = 0;
    for (const auto& [gid, g] : s.groups) {
      MEMOFFLOAD_RETURN_IF_ERROR(CheckGroupRecord(gid, g, s.tenant));
      session_held += g.held_bytes;
      by_state[static_cast<int>(g.state)] += g.held_bytes;
      ++groups;
    }
    if (session_held != s.account.held_bytes) {
      return Internal("session " + std::to_string(id) + " holds " + std::to_string(session_held) +
                      ", recorded " + std::to_string(s.account.held_bytes));
    }
    if (s.account.kind != s.hello.kind) {
      return Internal("session " + std::to_string(id) + " is counted as " +
                      SessionKindName(s.account.kind) + ", its hello says " +
                      SessionKindName(s.hello.kind));
    }
    Ledger::KindTotals& kind = by_kind[static_cast<size_t>(s.hello.kind)];
    ++kind.sessions;
    kind.held_bytes += session_held;
    kind.groups += s.groups.size();
    job_held[s.job_key].held_bytes += session_held;
    if (s.hello.kind == SessionKind::kState) job_held[s.job_key].state_held_bytes += session_held;
    ++job_held[s.job_key].sessions;
    uid_held[s.peer.uid].held_bytes += session_held;
    ++uid_held[s.peer.uid].sessions;
    *held += session_held;
  }
  return ledger_.Check(by_state, groups, job_held, uid_held, by_kind);
}

Status SessionTable::CheckGroupRecord(uint64_t gid, const Group& g,
                                      const std::string& tenant) const {
  uint64_t sum = 0;
  for (const Extent& e : g.extents) {
    sum += e.length;
    const std::string& owner = tenant_chunks_.OwnerOf(e.chunk);
    if (tenant_chunks_.mode() != TenantMode::kNone && owner != tenant) {
      return Internal("group " + std::to_string(gid) + " of tenant " + tenant +
                      " has an extent in chunk " + std::to_string(e.chunk) + " of tenant " + owner);
    }
  }

  if (sum != g.held_bytes) {
    return Internal("group " + std::to_string(gid) + " extents sum to " + std::to_string(sum) +
                    ", recorded " + std::to_string(g.held_bytes));
  }
  return Status::Ok();
}

Status SessionTable::CheckRegionRecords(uint64_t* region_held) const {
  uint32_t region_count = 0;
  std::unordered_map<uid_t, UidRegions> by_uid;
  for (const auto& [key, job] : regions_) {
    uint64_t job_held = 0;
    for (const auto& [name, r] : job.by_name) {
      uint64_t sum = 0;
      for (const Extent& e : r.extents) {
        sum += e.length;
        const std::string& owner = tenant_chunks_.OwnerOf(e.chunk);
        if (tenant_chunks_.mode() != TenantMode::kNone && owner != r.tenant) {
          return Internal("region " + name + " of tenant " + r.tenant + " has an extent in chunk " +
                          std::to_string(e.chunk) + " of tenant " + owner);
        }
      }
      if (sum != r.held_bytes) return Internal("region " + name + " extents disagree");
      by_uid[r.uid].held_bytes += sum;
      ++by_uid[r.uid].count;
      job_held += sum;
      ++region_count;
    }
    if (job_held != job.held_bytes) return Internal("job " + key + " region bytes disagree");
    *region_held += job_held;
  }
  if (tenant_chunks_.mode() != TenantMode::kNone) {
    MEMOFFLOAD_RETURN_IF_ERROR(CheckRegionChunks());
  }
  if (*region_held != region_bytes_ || region_count != region_count_) {
    return Internal("region counters disagree with the regions");
  }
  for (const auto& [uid, u] : by_uid) {
    const UidRegions counted = UidRegionsOf(uid);
    if (counted.held_bytes != u.held_bytes || counted.count != u.count) {
      return Internal("uid " + std::to_string(uid) + "'s region tally disagrees with its regions");
    }
  }
  if (by_uid.size() != uid_regions_.size()) {
    return Internal("a uid without regions keeps a region tally");
  }
  return Status::Ok();
}

Status SessionTable::CheckRegionChunks() const {
  std::vector<uint32_t> in_chunk(arena_->chunk_count(), 0);
  uint64_t chunk_bytes = 0;
  std::unordered_map<uid_t, uint64_t> uid_chunk_bytes;
  for (const auto& [key, job] : regions_) {
    for (const auto& [name, r] : job.by_name) {
      for (const Extent& e : r.extents) {
        if (in_chunk[e.chunk]++ == 0) {
          chunk_bytes += arena_->chunk(e.chunk).size_bytes();
          uid_chunk_bytes[r.uid] += arena_->chunk(e.chunk).size_bytes();
        }
      }
    }
  }
  if (chunk_bytes != region_chunk_bytes_ ||
      (!region_extents_in_chunk_.empty() && in_chunk != region_extents_in_chunk_)) {
    return Internal("the chunks regions pin disagree with the regions");
  }
  for (const auto& [uid, u] : uid_regions_) {
    auto it = uid_chunk_bytes.find(uid);
    if (u.chunk_bytes != (it == uid_chunk_bytes.end() ? 0 : it->second)) {
      return Internal("the chunks uid " + std::to_string(uid) +
                      "'s regions pin disagree with its regions");
    }
  }
  return Status::Ok();
}

}  // namespace memoffload::daemon
