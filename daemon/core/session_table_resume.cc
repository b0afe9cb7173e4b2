// SessionTable's sessions across a take-over: the records the serving
// daemon hands on, and the new daemon's side, which places them back and
// binds each to its process again (docs/restarts.md, "Sessions resume").
#include <algorithm>
#include <set>

#include "base/log.h"
#include "core/session_table.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {

std::vector<SessionRecord> SessionTable::SessionRecords() const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionRecord> out;
  for (const auto& [id, s] : sessions_) {
    SessionRecord r;
    r.id = id;
    r.token = s.grant.token;
    r.uid = s.peer.uid;
    r.gid = s.peer.gid;
    r.pid = s.peer.pid;
    r.job_id = s.hello.job_id;
    r.rank = s.hello.rank;
    r.local_rank = s.hello.local_rank;
    r.max_bytes = s.hello.max_bytes;
    r.job_max_bytes = s.hello.job_max_bytes;
    r.kind = static_cast<uint16_t>(s.hello.kind);
    r.limit_bytes = s.grant.limit_bytes;
    for (const auto& [gid, g] : s.groups) {
      r.groups.push_back(GroupRecord{gid, static_cast<uint16_t>(g.state), g.used_bytes, g.extents,
                                     g.extent_crc32c});
    }
    if (auto job = regions_.find(s.job_key); job != regions_.end()) {
      for (const auto& [name, region] : job->second.by_name) {
        if (region.state == RegionState::kWriting && region.writer == id) {
          r.writing.push_back(RecordOf(region));  // its TTL too
        }
        for (uint64_t reader : region.readers) {
          if (reader != id) continue;
          if (region.deleted) {
            r.deleted_open.push_back(RecordOf(region));
          } else {
            r.opened.push_back(name);
          }
        }
      }
    }
    out.push_back(std::move(r));
  }
  return out;
}

namespace {

// Why a handed session cannot be taken as it is, or "".
std::string MalformedSession(const SessionRecord& r, uint32_t chunk_count) {
  if (r.id == 0 || r.id >= (uint64_t{1} << 62) || r.token.empty()) {
    return "it has no valid id or token";
  }
  if (r.pid <= 0) return "its process is not known (no pid to bind its resume to)";
  if (r.kind >= kSessionKindCount) return "its kind is unknown";
  if (r.job_id.size() > kMaxJobIdBytes) return "its job id is too long";
  std::set<uint64_t> groups;
  for (const GroupRecord& g : r.groups) {
    if (!groups.insert(g.id).second) return "it names group " + std::to_string(g.id) + " twice";
    if (g.state > static_cast<uint16_t>(GroupState::kRead)) return "a group's state is unknown";
    uint64_t held = 0;
    for (const Extent& e : g.extents) {
      if (e.chunk >= chunk_count) return "an extent lies past the arena";
      held += e.length;
    }
    if (g.extents.empty() || g.used_bytes > held) return "a group's bytes pass its extents";
  }
  std::vector<const RegionRecord*> regions;
  for (const RegionRecord& w : r.writing) regions.push_back(&w);
  for (const RegionRecord& d : r.deleted_open) regions.push_back(&d);
  for (const RegionRecord* w : regions) {
    if (!CheckRegionName(w->name).ok() || w->job_id != r.job_id || w->uid != r.uid) {
      return "a region it writes or reads is not of its job";
    }
    if (w->used_bytes > w->held_bytes()) return "a region's bytes pass its extents";
  }
  for (const RegionRecord& w : r.writing) {
    for (const Extent& e : w.extents) {
      if (e.chunk >= chunk_count) return "an extent lies past the arena";
    }
  }
  return "";
}

}  // namespace

SessionTable::Adopted SessionTable::AdoptSessions(const std::vector<SessionRecord>& records,
                                                  std::chrono::milliseconds resume_within,
                                                  std::vector<std::string>* dropped) {
  absl::MutexLock lock(&mu_);
  Adopted out;
  const Clock::time_point now = Clock::now();
  for (const SessionRecord& r : records) {
    const std::string what = "session " + std::to_string(r.id) + " (pid " + std::to_string(r.pid) +
                             ", uid " + std::to_string(r.uid) + ", job '" + r.job_id + "')";
    const std::string tenant = TenantFor(r.uid, r.job_id);
    std::string why = MalformedSession(r, arena_->chunk_count());
    if (why.empty() && sessions_.count(r.id) != 0) why = "its id is taken";
    JobRegions* job = why.empty() ? &regions_[JobKey(r.uid, r.job_id)] : nullptr;
    std::vector<const std::vector<Extent>*> all;
    for (const GroupRecord& g : r.groups) all.push_back(&g.extents);
    for (const RegionRecord& w : r.writing) all.push_back(&w.extents);
    // A deleted region several sessions had open comes once, with the first.
    std::vector<const RegionRecord*> hidden_new;
    for (const RegionRecord& d : r.deleted_open) {
      if (!why.empty()) break;
      auto it = job->by_name.find(d.name);
      if (it == job->by_name.end()) {
        if (std::none_of(hidden_new.begin(), hidden_new.end(),
                         [&](const RegionRecord* h) { return h->name == d.name; })) {
          hidden_new.push_back(&d);
          all.push_back(&d.extents);
        }
      } else if (!it->second.deleted) {
        why = "region " + d.name + " it read is both deleted and not";
      }
    }
    if (why.empty() && tenant_chunks_.mode() != TenantMode::kNone) {
      for (const auto* extents : all) {
        for (const Extent& e : *extents) {
          const std::string& owner = tenant_chunks_.OwnerOf(e.chunk);
          if (owner != tenant) why = "chunk " + std::to_string(e.chunk) + " is not its tenant's";
        }
      }
    }
    for (const RegionRecord& w : r.writing) {
      if (why.empty() && job->by_name.count(w.name) != 0) why = "region " + w.name + " is twice";
    }
    std::vector<Extent> taken;
    for (const auto* extents : all) {
      if (why.empty()) why = TakeExactAll(*extents, &taken);
    }
    if (!why.empty()) {
      FreeExtents(taken);
      dropped->push_back(what + ": " + why);
      ++handed_dropped_;
      if (job != nullptr && job->by_name.empty()) regions_.erase(JobKey(r.uid, r.job_id));
      continue;
    }
    Session s;
    s.grant.session_id = r.id;
    s.grant.token = r.token;
    s.grant.limit_bytes = r.limit_bytes;
    s.hello.job_id = r.job_id;
    s.hello.rank = r.rank;
    s.hello.local_rank = r.local_rank;
    s.hello.max_bytes = r.max_bytes;
    s.hello.job_max_bytes = r.job_max_bytes;
    s.hello.kind = static_cast<SessionKind>(r.kind);
    s.tenant = tenant;
    s.job_key = JobKey(r.uid, r.job_id);
    s.peer.pid = r.pid;
    s.peer.uid = r.uid;
    s.peer.gid = r.gid;
    s.opened_at = now;
    s.account = ledger_.Open(s.job_key, r.uid, s.hello.kind);
    Ledger::Job& ledger_job = *s.account.job;
    if (r.job_max_bytes != 0 &&
        (ledger_job.requested_limit == 0 || r.job_max_bytes < ledger_job.requested_limit)) {
      ledger_job.requested_limit = r.job_max_bytes;
    }
    s.owned = tenant_chunks_.Join(tenant, r.uid);
    // It maps its tenant's chunks: held from now on, so that none changes
    // tenant (and backing) before its process resumes it.
    tenant_chunks_.Attach(r.id, tenant, r.pid);
    for (const GroupRecord& gr : r.groups) {
      Group g;
      g.state = static_cast<GroupState>(gr.state);
      g.extents = gr.extents;
      for (const Extent& e : g.extents) g.held_bytes += e.length;
      g.used_bytes = gr.used_bytes;
      g.extent_crc32c = gr.extent_crc32c;
      g.committed_at = now;
      ledger_.Reserved(&s.account, g.held_bytes);
      if (g.state != GroupState::kReserved)
        ledger_.Committed(&s.account, g.held_bytes, g.held_bytes);
      if (g.state == GroupState::kRead) ledger_.Read(g.held_bytes);
      out.bytes += g.held_bytes;
      ++out.groups;
      s.groups.emplace(gr.id, std::move(g));
    }
    for (const RegionRecord& w : r.writing) {
      CountRegionChunks(r.uid, w.extents, +1);
      Region region;
      region.name = w.name;
      region.uid = r.uid;
      region.job_id = r.job_id;
      region.tenant = tenant;
      region.writer = r.id;
      region.extents = w.extents;
      region.held_bytes = w.held_bytes();
      region.ttl = std::chrono::milliseconds(w.ttl_ms);
      job->held_bytes += region.held_bytes;
      CountUidRegions(r.uid, static_cast<int64_t>(region.held_bytes), +1);
      region_bytes_ += region.held_bytes;
      ++region_count_;
      out.bytes += region.held_bytes;
      job->by_name.emplace(w.name, std::move(region));
    }
    for (const RegionRecord* d : hidden_new) {
      CountRegionChunks(r.uid, d->extents, +1);
      Region region;
      region.name = d->name;
      region.uid = r.uid;
      region.job_id = r.job_id;
      region.tenant = tenant;
      region.state = RegionState::kCommitted;
      region.deleted = true;
      region.extents = d->extents;
      region.held_bytes = d->held_bytes();
      region.used_bytes = d->used_bytes;
      region.extent_crc32c = d->extent_crc32c;
      job->held_bytes += region.held_bytes;
      CountUidRegions(r.uid, static_cast<int64_t>(region.held_bytes), +1);
      region_bytes_ += region.held_bytes;
      ++region_count_;
      job->by_name.emplace(d->name, std::move(region));
    }
    for (const RegionRecord& d : r.deleted_open) {
      auto it = job->by_name.find(d.name);
      if (it != job->by_name.end() && it->second.deleted) it->second.readers.push_back(r.id);
    }
    for (const std::string& name : r.opened) {
      auto it = job->by_name.find(name);
      if (it != job->by_name.end() && it->second.state == RegionState::kCommitted) {
        it->second.readers.push_back(r.id);
      }
    }
    if (job->by_name.empty()) regions_.erase(s.job_key);
    s.detached = true;
    s.handed_at = now;
    s.resume_by = now + resume_within;
    next_session_id_ = std::max(next_session_id_, r.id + 1);
    sessions_.emplace(r.id, std::move(s));
    ++out.sessions;
    ++handed_waiting_;
  }
  return out;
}

Result<SessionGrant> SessionTable::Resume(uint64_t session_id, const std::string& token,
                                          const PeerCredentials& peer, Hello* hello,
                                          std::chrono::milliseconds* waited) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  // Past its time it is being closed (CloseUnresumed).
  if (it == sessions_.end() || !it->second.detached || Clock::now() >= it->second.resume_by) {
    return NotFound("session " + std::to_string(session_id) +
                    " does not wait for a resume here (the daemon restarted, or the session "
                    "ended or is attached): attach again");
  }
  Session& s = it->second;
  // The process, not the token alone: another process of the uid that
  // learned the token (or a child) cannot take the session over. The
  // refusal says nothing of whose it is.
  if (peer.uid != s.peer.uid || peer.pid != s.peer.pid || peer.pid <= 0) {
    return PermissionDenied("session " + std::to_string(session_id) +
                            " may be resumed only by the process that attached it (this is pid " +
                            std::to_string(peer.pid) + ")");
  }
  if (!ConstantTimeEquals(s.grant.token, token)) {
    return Unauthenticated("session token does not match session " + std::to_string(session_id));
  }
  s.detached = false;
  s.peer = peer;
  *hello = s.hello;
  *waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - s.handed_at);
  --handed_waiting_;
  ++handed_resumed_;
  longest_resume_wait_ = std::max(longest_resume_wait_, *waited);
  return s.grant;
}

void SessionTable::StartResumeClock(std::chrono::milliseconds resume_within) {
  absl::MutexLock lock(&mu_);
  const Clock::time_point by = Clock::now() + resume_within;
  for (auto& [id, s] : sessions_) {
    if (s.detached) s.resume_by = by;
  }
}

void SessionTable::SetSeries(uint64_t session_id, std::shared_ptr<RankSeries> series) {
  absl::MutexLock lock(&mu_);
  if (auto it = sessions_.find(session_id); it != sessions_.end()) {
    std::swap(it->second.series, series);
  }
  // The one replaced (none, for a resumed session) is dropped with the
  // parameter, after the lock.
}

std::vector<std::string> SessionTable::CloseUnresumed(std::chrono::steady_clock::time_point now) {
  std::vector<std::pair<uint64_t, std::string>> due;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : sessions_) {
      if (s.detached && now >= s.resume_by) {
        due.emplace_back(id, "session " + std::to_string(id) + " (pid " +
                                 std::to_string(s.peer.pid) + ", job '" + s.hello.job_id +
                                 "') was not resumed in time (its process ended during the "
                                 "take-over or the restart?)");
      }
    }
  }
  std::vector<std::string> out;
  for (auto& [id, line] : due) {
    Result<Closed> closed = Close(id, CloseReason::kLifelineClosed);
    if (!closed.ok()) continue;
    out.push_back(line + ": closed, reclaiming " + FormatSize(closed->group_bytes));
    absl::MutexLock lock(&mu_);
    --handed_waiting_;
    ++handed_not_resumed_;
  }
  return out;
}

}  // namespace memoffload::daemon
