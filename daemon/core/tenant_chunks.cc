#include "core/tenant_chunks.h"

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <utility>

namespace memoffload::daemon {

Result<TenantMode> ParseTenantMode(const std::string& text) {
  if (text == "uid") return TenantMode::kUid;
  if (text == "job") return TenantMode::kJob;
  if (text == "none") return TenantMode::kNone;
  return InvalidArgument("'" + text + "' is not a tenant mode: uid, job or none");
}

namespace {

bool ProcessLivesNow(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

}  // namespace

TenantChunks::TenantChunks(uint32_t chunk_count, TenantMode mode, ProcessLives lives)
    : mode_(mode),
      lives_(lives != nullptr ? std::move(lives) : ProcessLives(ProcessLivesNow)),
      chunks_(chunk_count) {}

uint32_t TenantChunks::owned_chunks() const {
  uint32_t owned = 0;
  for (const ChunkOwner& c : chunks_) owned += c.tenant.empty() ? 0 : 1;
  return owned;
}

const TenantChunks::Owned* TenantChunks::Find(const std::string& tenant) const {
  auto it = owned_.find(tenant);
  return it == owned_.end() ? nullptr : &it->second;
}

TenantChunks::Owned& TenantChunks::Entry(const std::string& tenant, uid_t uid) {
  auto [it, made] = owned_.try_emplace(tenant);
  if (made) {
    it->second.uid = uid;
    if (free_pools_.empty()) {
      it->second.pool = next_pool_++;
    } else {
      it->second.pool = free_pools_.back();
      free_pools_.pop_back();
    }
  }
  return it->second;
}

void TenantChunks::Drop(std::unordered_map<std::string, Owned>::iterator entry) {
  free_pools_.push_back(entry->second.pool);
  owned_.erase(entry);
}

const TenantChunks::Owned* TenantChunks::Join(const std::string& tenant, uid_t uid) {
  if (mode_ == TenantMode::kNone) return nullptr;
  Owned& entry = Entry(tenant, uid);
  ++entry.sessions;
  return &entry;
}

void TenantChunks::Leave(const std::string& tenant) {
  if (mode_ == TenantMode::kNone) return;
  auto it = owned_.find(tenant);
  if (it == owned_.end()) return;
  if (--it->second.sessions == 0 && it->second.chunks.empty()) Drop(it);
}

void TenantChunks::Hand(uint32_t chunk, uint64_t session_id, const std::string& tenant, pid_t pid) {
  ChunkOwner& c = chunks_[chunk];
  if (std::none_of(c.holders.begin(), c.holders.end(),
                   [&](const Holder& h) { return h.session_id == session_id; })) {
    c.holders.push_back(Holder{session_id, tenant});
  }
  // Remembered for FreshBacking: who may keep this backing after its session.
  if (pid > 0 && std::find(c.recipients.begin(), c.recipients.end(), pid) == c.recipients.end()) {
    c.recipients.push_back(pid);
    if (c.recipients.size() >= c.sweep_at) SweepRecipients(&c);
  }
}

void TenantChunks::SweepRecipients(ChunkOwner* c) const {
  c->recipients.erase(std::remove_if(c->recipients.begin(), c->recipients.end(),
                                     [this](pid_t pid) { return !lives_(pid); }),
                      c->recipients.end());
  // Amortised: the next sweep comes after at least as many new recipients
  // as it kept (and 32 at least).
  c->sweep_at = std::max(kRecipientSweep, 2 * c->recipients.size());
}

std::vector<uint32_t> TenantChunks::Attach(uint64_t session_id, const std::string& tenant,
                                           pid_t pid) {
  std::vector<uint32_t> handed;
  for (uint32_t c = 0; c < chunks_.size(); ++c) {
    if (mode_ == TenantMode::kNone || chunks_[c].tenant == tenant) {
      handed.push_back(c);
      Hand(c, session_id, tenant, pid);
    }
  }
  return handed;
}

Status TenantChunks::Grant(uint64_t session_id, const std::string& tenant, pid_t pid,
                           const std::vector<uint32_t>& chunks) {
  for (uint32_t c : chunks) {
    if (c >= chunks_.size()) {
      return InvalidArgument("chunk " + std::to_string(c) + " does not exist (the arena has " +
                             std::to_string(chunks_.size()) + ")");
    }
    if (mode_ != TenantMode::kNone && chunks_[c].tenant != tenant) {
      return PermissionDenied("chunk " + std::to_string(c) + " does not belong to tenant " +
                              tenant);
    }
  }
  for (uint32_t c : chunks) Hand(c, session_id, tenant, pid);
  return Status::Ok();
}

void TenantChunks::Forget(uint64_t session_id) {
  for (ChunkOwner& c : chunks_) {
    c.holders.erase(std::remove_if(c.holders.begin(), c.holders.end(),
                                   [&](const Holder& h) { return h.session_id == session_id; }),
                    c.holders.end());
  }
}

bool TenantChunks::MayClaim(uint32_t c, const std::string& tenant,
                            const std::function<bool(uint32_t)>& empty,
                            const uid_t* only_of_uid) const {
  const ChunkOwner& owner = chunks_[c];
  if (owner.tenant == tenant || !empty(c)) return false;
  if (only_of_uid != nullptr &&
      (owner.tenant.empty() || owned_.at(owner.tenant).uid != *only_of_uid)) {
    return false;
  }
  // No open session of another tenant may still have it mapped.
  return std::none_of(owner.holders.begin(), owner.holders.end(),
                      [&](const Holder& h) { return h.tenant != tenant; });
}

int64_t TenantChunks::Claimable(const std::string& tenant,
                                const std::function<bool(uint32_t)>& empty,
                                const uid_t* only_of_uid) const {
  int64_t reused = -1;
  for (uint32_t c = 0; c < chunks_.size(); ++c) {
    if (!MayClaim(c, tenant, empty, only_of_uid)) continue;
    if (chunks_[c].tenant.empty()) return c;  // never used: no new backing needed
    if (reused < 0) reused = c;
  }
  return reused;
}

std::vector<uint32_t> TenantChunks::ClaimableChunks(const std::string& tenant,
                                                    const std::function<bool(uint32_t)>& empty,
                                                    const uid_t* only_of_uid) const {
  std::vector<uint32_t> out;
  for (uint32_t c = 0; c < chunks_.size(); ++c) {
    if (MayClaim(c, tenant, empty, only_of_uid)) out.push_back(c);
  }
  return out;
}

uint32_t TenantChunks::CountClaimable(const std::string& tenant,
                                      const std::function<bool(uint32_t)>& empty,
                                      const uid_t* only_of_uid) const {
  uint32_t count = 0;
  for (uint32_t c = 0; c < chunks_.size(); ++c) count += MayClaim(c, tenant, empty, only_of_uid);
  return count;
}

bool TenantChunks::ChangesTenant(uint32_t chunk, const std::string& tenant) const {
  const std::string& owner = chunks_[chunk].tenant;
  return !owner.empty() && owner != tenant;
}

void TenantChunks::Assign(uint32_t chunk, const std::string& tenant, uid_t uid) {
  ChunkOwner& owner = chunks_[chunk];
  if (owner.tenant == tenant) return;
  if (!owner.tenant.empty()) {
    owner.holders.clear();  // only sessions of the old tenant, none open
    owner.recipients.clear();
    owner.sweep_at = kRecipientSweep;
    auto old = owned_.find(owner.tenant);
    std::vector<uint32_t>& list = old->second.chunks;
    list.erase(std::lower_bound(list.begin(), list.end(), chunk));
    auto count = uid_chunks_.find(old->second.uid);
    if (--count->second == 0) uid_chunks_.erase(count);
    if (list.empty() && old->second.sessions == 0) Drop(old);
  }
  Owned& entry = Entry(tenant, uid);
  entry.chunks.insert(std::upper_bound(entry.chunks.begin(), entry.chunks.end(), chunk), chunk);
  ++uid_chunks_[entry.uid];
  owner.tenant = tenant;
}

Status TenantChunks::CheckInvariants(
    const std::unordered_map<std::string, uint32_t>& sessions_by_tenant) const {
  size_t listed = 0;
  std::unordered_map<uint32_t, std::string> pools;
  std::unordered_map<uid_t, uint32_t> uid_chunks;
  for (const auto& [tenant, entry] : owned_) {
    if (entry.pool == kNoTenantPool || !pools.emplace(entry.pool, tenant).second) {
      return Internal("tenant '" + tenant + "' has pool " + std::to_string(entry.pool) +
                      ", which is 0 or another tenant's");
    }
    auto count = sessions_by_tenant.find(tenant);
    if (entry.sessions != (count == sessions_by_tenant.end() ? 0 : count->second) ||
        (entry.sessions == 0 && entry.chunks.empty())) {
      return Internal("tenant '" + tenant + "' counts " + std::to_string(entry.sessions) +
                      " sessions and lists " + std::to_string(entry.chunks.size()) + " chunks");
    }
    for (size_t k = 0; k < entry.chunks.size(); ++k) {
      const uint32_t c = entry.chunks[k];
      if (c >= chunks_.size() || chunks_[c].tenant != tenant ||
          (k > 0 && entry.chunks[k - 1] >= c)) {
        return Internal("tenant '" + tenant + "' lists chunk " + std::to_string(c) +
                        " out of order or not its own");
      }
    }
    listed += entry.chunks.size();
    if (!entry.chunks.empty()) uid_chunks[entry.uid] += entry.chunks.size();
  }
  if (uid_chunks != uid_chunks_) {
    return Internal("the chunks counted per uid disagree with the tenants' chunk lists");
  }
  for (const auto& [tenant, count] : sessions_by_tenant) {
    if (count != 0 && owned_.count(tenant) == 0) {
      return Internal("tenant '" + tenant + "' has " + std::to_string(count) +
                      " sessions and no entry");
    }
  }
  if (listed != owned_chunks()) {
    return Internal("tenant chunk lists hold " + std::to_string(listed) + " chunks; " +
                    std::to_string(owned_chunks()) + " chunks have a tenant");
  }
  return Status::Ok();
}

}  // namespace memoffload::daemon
