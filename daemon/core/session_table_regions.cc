// SessionTable's checkpoint regions: named byte ranges owned by (uid, job
// id), written once by one session, then read by any session of the job
// until deleted or expired. They share the arena, the allocator and the
// tenants' chunks with the groups, under limits of their own (regions.*).
#include <algorithm>

#include "core/session_table.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

constexpr size_t kMaxRegionName = 255;
constexpr long kMaxOpensPerSession = 64;

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

Status CheckRegionName(const std::string& name) {
  if (name.empty() || name.size() > kMaxRegionName) {
    return InvalidArgument("region name must be 1 to " + std::to_string(kMaxRegionName) +
                           " characters; got " + std::to_string(name.size()));
  }
  for (char c : name) {
    if (c < 0x21 || c > 0x7e) {
      return InvalidArgument(
          "region name must be printable ASCII without spaces (e.g. dcp/step-100/__0_0.distcp)");
    }
  }
  return Status::Ok();
}

void SessionTable::CountRegionChunks(uid_t uid, const std::vector<Extent>& extents, int delta) {
  if (tenant_chunks_.mode() == TenantMode::kNone) return;  // nothing is pinned
  if (region_extents_in_chunk_.empty()) region_extents_in_chunk_.assign(arena_->chunk_count(), 0);
  uint64_t& uid_bytes = uid_regions_[uid].chunk_bytes;
  for (const Extent& e : extents) {
    uint32_t& n = region_extents_in_chunk_[e.chunk];
    const uint64_t size = arena_->chunk(e.chunk).size_bytes();
    if (delta > 0 && n++ == 0) {
      region_chunk_bytes_ += size;
      uid_bytes += size;
    }
    if (delta < 0 && --n == 0) {
      region_chunk_bytes_ -= size;
      uid_bytes -= size;
    }
  }
}

uint64_t SessionTable::NewRegionChunkBytes(const std::vector<Extent>& extents) const {
  if (tenant_chunks_.mode() == TenantMode::kNone) return 0;
  std::vector<uint32_t> fresh;
  for (const Extent& e : extents) {
    const bool pinned = !region_extents_in_chunk_.empty() && region_extents_in_chunk_[e.chunk] != 0;
    if (!pinned && std::find(fresh.begin(), fresh.end(), e.chunk) == fresh.end()) {
      fresh.push_back(e.chunk);
    }
  }
  uint64_t bytes = 0;
  for (uint32_t c : fresh) bytes += arena_->chunk(c).size_bytes();
  return bytes;
}

const char* RegionStateName(RegionState state) {
  return state == RegionState::kWriting ? "writing" : "committed";
}

RegionUsage SessionTable::RegionUsageOf(const Session& s, const JobRegions& job) const {
  const UidRegions uid = UidRegionsOf(s.peer.uid);
  RegionUsage u;
  u.job_id = s.hello.job_id;
  u.uid = s.peer.uid;
  u.job_regions = job.by_name.size();
  u.job_held_bytes = job.held_bytes;
  u.uid_regions = uid.count;
  u.uid_held_bytes = uid.held_bytes;
  u.node_regions = region_count_;
  u.node_held_bytes = region_bytes_;
  return u;
}

SessionTable::UidRegions SessionTable::UidRegionsOf(uid_t uid) const {
  auto it = uid_regions_.find(uid);
  return it == uid_regions_.end() ? UidRegions{} : it->second;
}

void SessionTable::CountUidRegions(uid_t uid, int64_t bytes_delta, int count_delta) {
  UidRegions& u = uid_regions_[uid];
  u.held_bytes = static_cast<uint64_t>(static_cast<int64_t>(u.held_bytes) + bytes_delta);
  u.count = static_cast<uint64_t>(static_cast<int64_t>(u.count) + count_delta);
  if (u.count == 0 && u.chunk_bytes == 0) uid_regions_.erase(uid);
}

Result<SessionTable::JobRegions*> SessionTable::RegionsOf(const Session& session) {
  if (session.hello.job_id.empty()) {
    return FailedPrecondition(
        "checkpoint regions need an explicit job id: attach with one (MEMOFFLOAD_JOB_ID, the "
        "same for every rank and for the job that restarts from the checkpoint)");
  }
  return &regions_[session.job_key];
}

Result<SessionTable::OwnRegion> SessionTable::FindOwnRegion(uint64_t session_id,
                                                            const std::string& token,
                                                            const std::string& name) {
  Result<Session*> session = Authenticate(session_id, token);
  if (!session.ok()) return session.status();
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRegionName(name));
  Result<JobRegions*> job = RegionsOf(**session);
  if (!job.ok()) return job.status();
  Result<Region*> region = FindRegion(*job, **session, name);
  if (!region.ok()) return region.status();
  return OwnRegion{*session, *job, *region};
}

Result<SessionTable::Region*> SessionTable::FindRegion(JobRegions* job, const Session& session,
                                                       const std::string& name) {
  auto it = job->by_name.find(name);
  if (it == job->by_name.end() || it->second.deleted) {
    return NotFound("region " + name + " does not exist in job " + session.hello.job_id +
                    " of uid " + std::to_string(session.peer.uid) +
                    " (never committed, deleted, expired, or the daemon restarted)");
  }
  return &it->second;
}

RegionSnapshot SessionTable::SnapshotOf(const Region& r, Clock::time_point now) const {
  RegionSnapshot snap;
  snap.name = r.name;
  snap.uid = r.uid;
  snap.job_id = r.job_id;
  snap.state = r.state;
  snap.used_bytes = r.used_bytes;
  snap.held_bytes = r.held_bytes;
  snap.ttl_seconds = std::chrono::duration<double>(r.ttl).count();
  snap.checksummed = !r.extent_crc32c.empty();
  snap.readers = static_cast<uint32_t>(r.readers.size());
  snap.recovered = r.recovered;
  if (r.state == RegionState::kCommitted) {
    snap.committed_unix = r.committed_unix;
    snap.expires_in_seconds =
        std::max(0.0, std::chrono::duration<double>(r.expires_at - now).count());
  }
  return snap;
}

Result<ReserveResult> SessionTable::CreateRegion(uint64_t session_id, const std::string& token,
                                                 const std::string& name, uint64_t size_bytes,
                                                 std::chrono::milliseconds ttl) {
  absl::MutexLock lock(&mu_);
  Result<Session*> session = Authenticate(session_id, token);
  if (!session.ok()) return session.status();
  Session& s = **session;
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRegionName(name));
  Result<JobRegions*> job = RegionsOf(s);
  if (!job.ok()) return job.status();
  if (size_bytes == 0) return InvalidArgument("size_bytes must be positive");
  if (ttl.count() < 0) return InvalidArgument("ttl_seconds must not be negative");
  if (draining_) return DrainingRefusal("new regions are refused");
  MEMOFFLOAD_RETURN_IF_ERROR(quota_.CheckRegionsEnabled());
  if (auto it = (*job)->by_name.find(name); it != (*job)->by_name.end()) {
    return Status(StatusCode::kAlreadyExists,
                  "region " + name + " already exists in job " + s.hello.job_id + " (" +
                      (it->second.deleted ? "deleted, still open by a reader"
                                          : RegionStateName(it->second.state)) +
                      "); delete it first, or use a new name");
  }
  const RegionUsage usage = RegionUsageOf(s, **job);
  MEMOFFLOAD_RETURN_IF_ERROR(quota_.CheckRegionCount(usage));
  if (size_bytes > arena_->capacity_bytes()) {
    return ResourceExhausted("region of " + FormatSize(size_bytes) + " is larger than the " +
                             FormatSize(arena_->capacity_bytes()) + " arena");
  }
  const uint64_t rounded = PageRounded(size_bytes);
  MEMOFFLOAD_RETURN_IF_ERROR(quota_.CheckRegionBytes(usage, name, rounded));
  RejectReason reject = RejectReason::kNone;
  MEMOFFLOAD_RETURN_IF_ERROR(CheckFitsUidChunks(s, rounded, &reject));
  std::vector<Extent> extents;
  MEMOFFLOAD_RETURN_IF_ERROR(Place(s, rounded, /*single_extent=*/false, 0, &extents, &reject));
  // With tenants, a region keeps its whole chunk from every other tenant for
  // as long as it lives, so the node's and the uid's caps count the chunks
  // regions pin.
  const uint64_t chunk = arena_->chunk_size_bytes();
  const uint64_t first_region_chunk_bytes = ((rounded + chunk - 1) / chunk + 1) * chunk;
  if (Status pins = quota_.CheckRegionChunks(
          name, s.tenant, s.peer.uid, region_chunk_bytes_, UidRegionsOf(s.peer.uid).chunk_bytes,
          NewRegionChunkBytes(extents), first_region_chunk_bytes);
      !pins.ok()) {
    FreeExtents(extents);
    return pins;
  }
  CountRegionChunks(s.peer.uid, extents, +1);
  Region r;
  r.name = name;
  r.uid = s.peer.uid;
  r.job_id = s.hello.job_id;
  r.tenant = s.tenant;
  r.writer = session_id;
  r.extents = std::move(extents);
  r.held_bytes = rounded;
  const std::chrono::milliseconds cap(quota_.policy().region_ttl_ms);
  r.ttl = ttl.count() == 0 ? cap : std::min(ttl, cap);
  (*job)->held_bytes += rounded;
  CountUidRegions(s.peer.uid, static_cast<int64_t>(rounded), +1);
  region_bytes_ += rounded;
  ++region_count_;
  ReserveResult result{ExtentList(r.extents.begin(), r.extents.end()), rounded};
  (*job)->by_name.emplace(name, std::move(r));
  return result;
}

Result<CommitResult> SessionTable::CommitRegion(uint64_t session_id, const std::string& token,
                                                const std::string& name, uint64_t used_bytes,
                                                std::vector<uint32_t> extent_crc32c,
                                                const std::string& rename_to) {
  absl::ReleasableMutexLock lock(&mu_);
  Result<OwnRegion> own = FindOwnRegion(session_id, token, name);
  if (!own.ok()) return own.status();
  Region& r = *own->region;
  if (r.state != RegionState::kWriting || r.writer != session_id) {
    return FailedPrecondition("region " + name +
                              (r.state == RegionState::kWriting
                                   ? " is being written by another session"
                                   : " is committed already") +
                              "; only its writer commits it, once");
  }
  if (used_bytes > r.held_bytes) {
    return InvalidArgument("used_bytes " + std::to_string(used_bytes) +
                           " exceeds the region's reserved " + std::to_string(r.held_bytes) +
                           " bytes");
  }
  size_t touched = 0;
  for (uint64_t pos = 0; touched < r.extents.size() && pos < used_bytes; ++touched) {
    pos += r.extents[touched].length;
  }
  if (!extent_crc32c.empty() && extent_crc32c.size() != touched) {
    return InvalidArgument("extent_crc32c has " + std::to_string(extent_crc32c.size()) +
                           " checksums; the used bytes span " + std::to_string(touched) +
                           " extents");
  }
  if (!rename_to.empty() && rename_to != name) {
    MEMOFFLOAD_RETURN_IF_ERROR(CheckRegionName(rename_to));
    if (auto it = own->job->by_name.find(rename_to); it != own->job->by_name.end()) {
      return Status(StatusCode::kAlreadyExists,
                    "cannot commit region " + name + " as " + rename_to + ": job " +
                        own->session->hello.job_id + " has a region of that name (" +
                        (it->second.deleted ? "deleted, still open by a reader"
                                            : RegionStateName(it->second.state)) +
                        "); nothing was committed");
    }
  }
  Result<std::vector<Extent>> kept = arena_->allocator().Trim(r.extents, used_bytes);
  if (!kept.ok()) return Internal("trimming region: " + kept.status().message());
  uint64_t kept_bytes = 0;
  for (const Extent& e : *kept) kept_bytes += e.length;
  const uint64_t returned = r.held_bytes - kept_bytes;
  CountRegionChunks(r.uid, r.extents, -1);
  CountRegionChunks(r.uid, *kept, +1);
  own->job->held_bytes -= returned;
  CountUidRegions(r.uid, -static_cast<int64_t>(returned), 0);
  region_bytes_ -= returned;
  committed_region_bytes_ += kept_bytes;
  ++committed_region_count_;
  r.extents = std::move(kept).value();
  r.held_bytes = kept_bytes;
  r.used_bytes = used_bytes;
  r.extent_crc32c = std::move(extent_crc32c);
  r.state = RegionState::kCommitted;
  r.writer = 0;
  r.expires_at = Clock::now() + r.ttl;
  r.committed_unix = UnixNow();
  if (!rename_to.empty() && rename_to != name) {
    auto node = own->job->by_name.extract(name);
    node.key() = rename_to;
    node.mapped().name = rename_to;
    own->job->by_name.insert(std::move(node));
  }
  if (recorder_ != nullptr) {
    recorder_->RegionCommitted(
        RecordOf(own->job->by_name.at(rename_to.empty() ? name : rename_to)));
  }
  Completions done;
  if (returned != 0) DispatchWaiters(&done);
  lock.Release();
  Run(&done);
  return CommitResult{kept_bytes, returned, nullptr};
}

Result<PrefetchResult> SessionTable::OpenRegion(uint64_t session_id, const std::string& token,
                                                const std::string& name) {
  absl::MutexLock lock(&mu_);
  Result<OwnRegion> own = FindOwnRegion(session_id, token, name);
  if (!own.ok()) return own.status();
  Region& r = *own->region;
  if (r.state != RegionState::kCommitted) {
    return NotFound("region " + name + " is still being written (not committed)");
  }
  // A session may have a region open more than once (two readers in one
  // process), within a bound: each open is a record until it is closed.
  if (std::count(r.readers.begin(), r.readers.end(), session_id) >= kMaxOpensPerSession) {
    return ResourceExhausted("session " + std::to_string(session_id) + " has region " + name +
                             " open " + std::to_string(kMaxOpensPerSession) +
                             " times already; close it first");
  }
  r.readers.push_back(session_id);
  return PrefetchResult{r.extents, r.used_bytes, r.extent_crc32c, nullptr};
}

Status SessionTable::CloseRegion(uint64_t session_id, const std::string& token,
                                 const std::string& name) {
  absl::MutexLock lock(&mu_);
  Result<Session*> session = Authenticate(session_id, token);
  if (!session.ok()) return session.status();
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRegionName(name));
  Result<JobRegions*> job = RegionsOf(**session);
  if (!job.ok()) return job.status();
  auto it = (*job)->by_name.find(name);
  if (it != (*job)->by_name.end()) {
    std::vector<uint64_t>& readers = it->second.readers;
    auto reader = std::find(readers.begin(), readers.end(), session_id);
    if (reader != readers.end()) {
      readers.erase(reader);
      if (it->second.deleted && readers.empty()) DropRegion(*job, it);
      return Status::Ok();
    }
  }
  return FailedPrecondition("region " + name + " is not open in session " +
                            std::to_string(session_id));
}

uint64_t SessionTable::DropRegion(JobRegions* job, std::map<std::string, Region>::iterator it) {
  Region& r = it->second;
  if (!r.deleted && r.state == RegionState::kCommitted) {
    --committed_region_count_;
    committed_region_bytes_ -= r.held_bytes;
    if (recorder_ != nullptr) recorder_->RegionDeleted(RegionKey{r.uid, r.job_id, r.name});
  }
  r.deleted = true;
  if (!r.readers.empty()) return 0;
  const uint64_t freed = r.held_bytes;
  CountRegionChunks(r.uid, r.extents, -1);
  FreeExtents(r.extents);
  job->held_bytes -= freed;
  CountUidRegions(r.uid, -static_cast<int64_t>(freed), -1);
  region_bytes_ -= freed;
  --region_count_;
  job->by_name.erase(it);
  return freed;
}

Result<uint64_t> SessionTable::DeleteRegion(uint64_t session_id, const std::string& token,
                                            const std::string& name) {
  Completions done;
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    Result<OwnRegion> own = FindOwnRegion(session_id, token, name);
    if (!own.ok()) return own.status();
    if (own->region->state == RegionState::kWriting && own->region->writer != session_id) {
      return FailedPrecondition("region " + name +
                                " is being written by another session; only its writer may "
                                "abort it (it is freed if that session ends uncommitted)");
    }
    freed = DropRegion(own->job, own->job->by_name.find(name));
    if (freed != 0) DispatchWaiters(&done);
  }
  Run(&done);
  return freed;
}

Result<uint64_t> SessionTable::DeleteRegionOf(uid_t uid, const std::string& job_id,
                                              const std::string& name) {
  Completions done;
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    if (frozen_) {
      return Unavailable(
          "memoffloadd is handing the node to a new daemon (--take-over); delete the region "
          "on the new one");
    }
    MEMOFFLOAD_RETURN_IF_ERROR(CheckRegionName(name));
    auto job = regions_.find(JobKey(uid, job_id));
    auto it = job == regions_.end() ? std::map<std::string, Region>::iterator{}
                                    : job->second.by_name.find(name);
    if (job == regions_.end() || it == job->second.by_name.end() || it->second.deleted) {
      return NotFound("region " + name + " does not exist in job " + job_id + " of uid " +
                      std::to_string(uid));
    }
    if (it->second.state == RegionState::kWriting) {
      return FailedPrecondition("region " + name + " is being written by session " +
                                std::to_string(it->second.writer) +
                                "; it is freed if that session ends uncommitted");
    }
    freed = DropRegion(&job->second, it);
    if (job->second.by_name.empty()) regions_.erase(job);
    if (freed != 0) DispatchWaiters(&done);
  }
  Run(&done);
  return freed;
}

Result<std::vector<RegionSnapshot>> SessionTable::ListRegions(uint64_t session_id,
                                                              const std::string& token,
                                                              const std::string& prefix) {
  absl::MutexLock lock(&mu_);
  Result<Session*> session = Authenticate(session_id, token);
  if (!session.ok()) return session.status();
  Result<JobRegions*> job = RegionsOf(**session);
  if (!job.ok()) return job.status();
  std::vector<RegionSnapshot> out;
  const Clock::time_point now = Clock::now();
  for (auto it = (*job)->by_name.lower_bound(prefix);
       it != (*job)->by_name.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
    if (it->second.deleted || it->second.state != RegionState::kCommitted) continue;
    out.push_back(SnapshotOf(it->second, now));
  }
  return out;
}

std::vector<RegionSnapshot> SessionTable::ListAllRegions(const std::string& prefix) const {
  absl::MutexLock lock(&mu_);
  std::vector<RegionSnapshot> out;
  const Clock::time_point now = Clock::now();
  for (const auto& [key, job] : regions_) {
    for (const auto& [name, r] : job.by_name) {
      if (r.deleted || name.compare(0, prefix.size(), prefix) != 0) continue;
      out.push_back(SnapshotOf(r, now));
    }
  }
  std::sort(out.begin(), out.end(), [](const RegionSnapshot& a, const RegionSnapshot& b) {
    return std::tie(a.uid, a.job_id, a.name) < std::tie(b.uid, b.job_id, b.name);
  });
  return out;
}

uint64_t SessionTable::ExpireRegions(Clock::time_point now) {
  Completions done;
  uint64_t expired = 0;
  {
    absl::MutexLock lock(&mu_);
    bool freed = false;
    for (auto& [key, job] : regions_) {
      for (auto it = job.by_name.begin(); it != job.by_name.end();) {
        auto next = std::next(it);
        const Region& r = it->second;
        if (!r.deleted && r.state == RegionState::kCommitted && r.expires_at <= now) {
          freed |= DropRegion(&job, it) != 0;
          ++expired;
        }
        it = next;
      }
    }
    regions_expired_ += expired;
    for (auto it = regions_.begin(); it != regions_.end();) {
      it = it->second.by_name.empty() ? regions_.erase(it) : std::next(it);
    }
    if (freed) DispatchWaiters(&done);
  }
  Run(&done);
  return expired;
}

void SessionTable::ForgetRegionsOf(const Session& session, Closed* closed) {
  auto job = regions_.find(session.job_key);
  if (job == regions_.end()) return;
  const uint64_t id = session.grant.session_id;
  for (auto it = job->second.by_name.begin(); it != job->second.by_name.end();) {
    auto next = std::next(it);
    Region& r = it->second;
    r.readers.erase(std::remove(r.readers.begin(), r.readers.end(), id), r.readers.end());
    // Never committed (it never reads as complete), or deleted and no longer
    // read by anyone.
    if ((r.state == RegionState::kWriting && r.writer == id) || (r.deleted && r.readers.empty())) {
      // Dropped in both cases (a region being written has no readers), also
      // one committed with 0 bytes, which frees none.
      const bool dropped = r.readers.empty();
      closed->region_bytes += DropRegion(&job->second, it);
      closed->regions += dropped;
    }
    it = next;
  }
  if (job->second.by_name.empty()) regions_.erase(job);
}

}  // namespace memoffload::daemon
