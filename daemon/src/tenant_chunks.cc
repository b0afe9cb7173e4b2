// The tenant side of SessionTable: which chunks a tenant owns, handing their
// fds out, and taking over empty chunks of another tenant (with a new memfd:
// fresh backing).
#include <algorithm>

#include "memoffload/daemon/log.h"
#include "memoffload/daemon/session_table.h"

namespace memoffload::daemon {

Result<TenantMode> ParseTenantMode(const std::string& text) {
  if (text == "uid") return TenantMode::kUid;
  if (text == "job") return TenantMode::kJob;
  if (text == "none") return TenantMode::kNone;
  return InvalidArgument("'" + text + "' is not a tenant mode: uid, job or none");
}

int64_t SessionTable::Claimable(const std::string& tenant) const {
  int64_t reused = -1;
  for (uint32_t c = 0; c < chunk_owners_.size(); ++c) {
    const ChunkOwner& owner = chunk_owners_[c];
    if (owner.tenant == tenant) continue;
    if (arena_->allocator().chunk_free_bytes(c) != arena_->chunk(c).size_bytes()) continue;
    // No live session of another tenant may still have it mapped.
    bool foreign_holder = false;
    for (uint64_t id : owner.holders) {
      auto it = sessions_.find(id);
      if (it != sessions_.end() && it->second.tenant != tenant) foreign_holder = true;
    }
    if (foreign_holder) continue;
    if (owner.tenant.empty()) return c;  // never used: no new backing needed
    if (reused < 0) reused = c;
  }
  return reused;
}

Status SessionTable::Claim(uint32_t chunk, const std::string& tenant) {
  ChunkOwner& owner = chunk_owners_[chunk];
  if (!owner.tenant.empty() && owner.tenant != tenant) {
    // Fds and mappings cannot be revoked: zeroing pages an old holder still
    // maps would hand it the new tenant's bytes. A new memfd instead.
    const uint64_t size = arena_->chunk_bytes(chunk);
    Result<std::shared_ptr<Chunk>> fresh = Internal("no backing");
    if (fresh_backing_ != nullptr) {
      fresh = fresh_backing_->Take(size);
    } else {
      Result<Chunk> created = Chunk::Create("memoffload-backing", size, false);
      if (created.ok()) {
        fresh = std::make_shared<Chunk>(std::move(created).value());
      } else {
        fresh = created.status();
      }
    }
    if (!fresh.ok()) {
      MO_LOG_WARN("chunk %u cannot change tenant: no new memfd: %s", chunk,
                  fresh.status().ToString().c_str());
      return fresh.status();
    }
    std::shared_ptr<Chunk> old = arena_->ReplaceBacking(chunk, std::move(fresh).value());
    if (fresh_backing_ != nullptr) fresh_backing_->Retire(std::move(old), owner.recipients);
    ++replaced_backings_;
    owner.holders.clear();  // only dead sessions could be left
    owner.recipients.clear();
  }
  if (owner.tenant == tenant) return Status::Ok();
  if (!owner.tenant.empty()) {
    auto old = tenant_chunks_.find(owner.tenant);
    std::vector<uint32_t>& list = old->second.chunks;
    list.erase(std::lower_bound(list.begin(), list.end(), chunk));
    if (list.empty() && old->second.sessions == 0) tenant_chunks_.erase(old);
  }
  std::vector<uint32_t>& list = tenant_chunks_[tenant].chunks;
  list.insert(std::upper_bound(list.begin(), list.end(), chunk), chunk);
  owner.tenant = tenant;
  return Status::Ok();
}

void SessionTable::JoinTenant(Session* session) {
  if (tenant_mode_ == TenantMode::kNone) return;
  TenantChunks& entry = tenant_chunks_[session->tenant];
  ++entry.sessions;
  session->owned = &entry;
}

void SessionTable::LeaveTenant(const Session& session) {
  if (session.owned == nullptr) return;
  if (--session.owned->sessions == 0 && session.owned->chunks.empty()) {
    tenant_chunks_.erase(session.tenant);
  }
}

Status SessionTable::CheckTenantChunks() const {
  std::unordered_map<std::string, uint32_t> sessions;
  for (const auto& [id, s] : sessions_) {
    if (s.owned != nullptr) ++sessions[s.tenant];
    auto entry = tenant_chunks_.find(s.tenant);
    if ((s.owned == nullptr) != (tenant_mode_ == TenantMode::kNone) ||
        (s.owned != nullptr && (entry == tenant_chunks_.end() || &entry->second != s.owned))) {
      return Internal("session " + std::to_string(id) + " does not point at the chunk list of " +
                      "its tenant '" + s.tenant + "'");
    }
  }
  size_t listed = 0, owned = 0;
  for (const auto& [tenant, entry] : tenant_chunks_) {
    auto count = sessions.find(tenant);
    if (entry.sessions != (count == sessions.end() ? 0 : count->second) ||
        (entry.sessions == 0 && entry.chunks.empty())) {
      return Internal("tenant '" + tenant + "' counts " + std::to_string(entry.sessions) +
                      " sessions and lists " + std::to_string(entry.chunks.size()) + " chunks");
    }
    for (size_t k = 0; k < entry.chunks.size(); ++k) {
      const uint32_t c = entry.chunks[k];
      if (c >= chunk_owners_.size() || chunk_owners_[c].tenant != tenant ||
          (k > 0 && entry.chunks[k - 1] >= c)) {
        return Internal("tenant '" + tenant + "' lists chunk " + std::to_string(c) +
                        " out of order or not its own");
      }
    }
    listed += entry.chunks.size();
  }
  for (const ChunkOwner& owner : chunk_owners_) owned += owner.tenant.empty() ? 0 : 1;
  if (listed != owned) {
    return Internal("tenant chunk lists hold " + std::to_string(listed) + " chunks; " +
                    std::to_string(owned) + " chunks have a tenant");
  }
  return Status::Ok();
}

namespace {
ChunkGrant GrantOf(const Arena& arena, uint32_t chunk) {
  return {chunk, arena.generation(chunk), arena.backing(chunk)};
}

// Remembered for FreshBacking: who may keep this backing after its session.
void NoteRecipient(std::vector<pid_t>* recipients, pid_t pid) {
  if (pid <= 0) return;
  if (std::find(recipients->begin(), recipients->end(), pid) == recipients->end()) {
    recipients->push_back(pid);
  }
}
}  // namespace

Result<std::vector<ChunkGrant>> SessionTable::AttachChunks(uint64_t session_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return NotFound("session " + std::to_string(session_id));
  std::vector<ChunkGrant> chunks;
  for (uint32_t c = 0; c < chunk_owners_.size(); ++c) {
    ChunkOwner& owner = chunk_owners_[c];
    if (tenant_mode_ == TenantMode::kNone || owner.tenant == it->second.tenant) {
      chunks.push_back(GrantOf(*arena_, c));
      owner.holders.push_back(session_id);
      NoteRecipient(&owner.recipients, it->second.peer.pid);
    }
  }
  return chunks;
}

Result<std::vector<ChunkGrant>> SessionTable::GrantChunks(uint64_t session_id,
                                                          const std::vector<uint32_t>& chunks) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return NotFound("session " + std::to_string(session_id));
  for (uint32_t c : chunks) {
    if (c >= chunk_owners_.size()) {
      return InvalidArgument("chunk " + std::to_string(c) + " does not exist (the arena has " +
                             std::to_string(chunk_owners_.size()) + ")");
    }
    if (tenant_mode_ != TenantMode::kNone && chunk_owners_[c].tenant != it->second.tenant) {
      return PermissionDenied("chunk " + std::to_string(c) + " does not belong to tenant " +
                              it->second.tenant);
    }
  }
  std::vector<ChunkGrant> grants;
  for (uint32_t c : chunks) {
    auto& holders = chunk_owners_[c].holders;
    if (std::find(holders.begin(), holders.end(), session_id) == holders.end()) {
      holders.push_back(session_id);
    }
    NoteRecipient(&chunk_owners_[c].recipients, it->second.peer.pid);
    grants.push_back(GrantOf(*arena_, c));
  }
  return grants;
}

}  // namespace memoffload::daemon
