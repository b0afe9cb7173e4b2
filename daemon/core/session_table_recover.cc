// SessionTable's side of the state kept across a restart: the recorder's
// records, and placing what a restart kept (app/state_store.h).
#include <algorithm>
#include <set>

#include "base/log.h"
#include "core/session_table.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

double UnixNowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

void SessionTable::SetRecorder(StateRecorder* recorder) {
  absl::MutexLock lock(&mu_);
  recorder_ = recorder;
}

RegionRecord SessionTable::RecordOf(const Region& r) {
  RegionRecord out;
  out.uid = r.uid;
  out.job_id = r.job_id;
  out.tenant = r.tenant;
  out.name = r.name;
  out.used_bytes = r.used_bytes;
  out.ttl_ms = static_cast<uint64_t>(r.ttl.count());
  out.committed_unix = r.committed_unix;
  out.extents = r.extents;
  out.extent_crc32c = r.extent_crc32c;
  return out;
}

std::string SessionTable::TakeExactAll(const std::vector<Extent>& extents,
                                       std::vector<Extent>* taken) {
  for (const Extent& e : extents) {
    if (Status st = arena_->allocator().TakeExact(e); !st.ok()) return st.message();
    taken->push_back(e);
  }
  return "";
}

std::vector<RegionRecord> SessionTable::CommittedRegions() const {
  absl::MutexLock lock(&mu_);
  std::vector<RegionRecord> out;
  for (const auto& [key, job] : regions_) {
    for (const auto& [name, r] : job.by_name) {
      if (!r.deleted && r.state == RegionState::kCommitted) out.push_back(RecordOf(r));
    }
  }
  return out;
}

SessionTable::Recovered SessionTable::Recover(const std::vector<RegionRecord>& regions,
                                              std::vector<std::string>* dropped) {
  absl::MutexLock lock(&mu_);
  Recovered out;
  const double now_unix = UnixNowSeconds();
  const Clock::time_point now = Clock::now();
  std::set<std::string> joined;
  for (const RegionRecord& rec : regions) {
    const std::string what =
        "region " + rec.name + " of job " + rec.job_id + " (uid " + std::to_string(rec.uid) + ")";
    const std::string tenant = TenantFor(rec.uid, rec.job_id);
    // Its chunks are its tenant's, or nobody's yet.
    std::string why;
    if (CheckRegionName(rec.name).ok() == false || rec.job_id.empty()) why = "its name is invalid";
    for (const Extent& e : rec.extents) {
      if (!why.empty()) break;
      if (e.chunk >= arena_->chunk_count()) {
        why = "an extent lies past the arena (chunk " + std::to_string(e.chunk) + ")";
      } else if (tenant_chunks_.mode() != TenantMode::kNone &&
                 !tenant_chunks_.OwnerOf(e.chunk).empty() &&
                 tenant_chunks_.OwnerOf(e.chunk) != tenant) {
        why = "chunk " + std::to_string(e.chunk) + " holds another tenant's region";
      }
    }
    if (why.empty() && rec.used_bytes > rec.held_bytes()) why = "its used bytes pass its extents";
    if (why.empty() && regions_[JobKey(rec.uid, rec.job_id)].by_name.count(rec.name) != 0) {
      why = "it is named twice";
    }
    std::vector<Extent> taken;
    if (why.empty()) why = TakeExactAll(rec.extents, &taken);
    if (!why.empty()) {
      FreeExtents(taken);
      dropped->push_back(what + ": " + why);
      continue;
    }
    if (tenant_chunks_.mode() != TenantMode::kNone) {
      if (joined.insert(tenant).second) tenant_chunks_.Join(tenant, rec.uid);
      for (const Extent& e : rec.extents) {
        if (tenant_chunks_.OwnerOf(e.chunk).empty()) {
          // Nobody's yet: no new backing (Claim gives one only on a change).
          if (Status st = Claim(e.chunk, tenant, rec.uid); !st.ok()) {
            MO_LOG_ERROR("internal error: recovered chunk %u not given to %s: %s", e.chunk,
                         tenant.c_str(), st.ToString().c_str());
          }
        }
      }
    }
    CountRegionChunks(rec.uid, rec.extents, +1);
    Region r;
    r.name = rec.name;
    r.uid = rec.uid;
    r.job_id = rec.job_id;
    r.tenant = tenant;
    r.state = RegionState::kCommitted;
    r.extents = rec.extents;
    r.held_bytes = rec.held_bytes();
    r.used_bytes = rec.used_bytes;
    r.extent_crc32c = rec.extent_crc32c;
    r.ttl = std::chrono::milliseconds(rec.ttl_ms);
    r.committed_unix = rec.committed_unix;
    r.recovered = true;
    // The TTL runs from the commit, across the restart.
    const double age = std::max(0.0, now_unix - rec.committed_unix);
    r.expires_at = now + r.ttl -
                   std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                       std::min(age, static_cast<double>(rec.ttl_ms) / 1000)));
    JobRegions& job = regions_[JobKey(rec.uid, rec.job_id)];
    job.held_bytes += r.held_bytes;
    CountUidRegions(rec.uid, static_cast<int64_t>(r.held_bytes), +1);
    region_bytes_ += r.held_bytes;
    committed_region_bytes_ += r.held_bytes;
    ++region_count_;
    ++committed_region_count_;
    out.bytes += r.held_bytes;
    ++out.regions;
    job.by_name.emplace(rec.name, std::move(r));
  }
  for (auto it = regions_.begin(); it != regions_.end();) {
    it = it->second.by_name.empty() ? regions_.erase(it) : std::next(it);
  }
  // A tenant with no session keeps its entry while it has chunks.
  for (const std::string& tenant : joined) tenant_chunks_.Leave(tenant);
  return out;
}

std::vector<SessionTable::ChunkOwner> SessionTable::ChunkOwners() const {
  absl::MutexLock lock(&mu_);
  std::vector<ChunkOwner> out;
  if (tenant_chunks_.mode() == TenantMode::kNone) return out;
  for (uint32_t c = 0; c < tenant_chunks_.chunk_count(); ++c) {
    const std::string& tenant = tenant_chunks_.OwnerOf(c);
    if (tenant.empty()) continue;
    const TenantChunks::Owned* owned = tenant_chunks_.Find(tenant);
    out.push_back(ChunkOwner{c, tenant, owned != nullptr ? owned->uid : 0});
  }
  return out;
}

bool SessionTable::TenantOfUid(const std::string& tenant, uid_t uid) const {
  // A tenant names its uid first: "uid:<uid>" or "job:<uid>:<job id>".
  return tenant_chunks_.mode() == TenantMode::kUid ? tenant == TenantFor(uid, "")
                                                   : tenant.rfind(TenantFor(uid, ""), 0) == 0;
}

void SessionTable::AdoptChunkOwners(const std::vector<ChunkOwner>& owners) {
  absl::MutexLock lock(&mu_);
  if (tenant_chunks_.mode() == TenantMode::kNone) return;
  for (const ChunkOwner& o : owners) {
    if (o.chunk >= tenant_chunks_.chunk_count() || o.tenant.empty() ||
        !tenant_chunks_.OwnerOf(o.chunk).empty() || !TenantOfUid(o.tenant, o.uid)) {
      continue;
    }
    tenant_chunks_.Join(o.tenant, o.uid);
    if (Status st = Claim(o.chunk, o.tenant, o.uid); !st.ok()) {
      MO_LOG_ERROR("internal error: chunk %u not given to %s: %s", o.chunk, o.tenant.c_str(),
                   st.ToString().c_str());
    }
    tenant_chunks_.Leave(o.tenant);
  }
}

}  // namespace memoffload::daemon
