// The tenant side of SessionTable: which chunks a tenant owns, handing their
// fds out, and taking over (and zeroing) empty chunks of another tenant.
#include <algorithm>
#include <cstring>

#include "memoffload/daemon/session_table.h"

namespace memoffload::daemon {

using Clock = std::chrono::steady_clock;

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
    if (owner.tenant.empty()) return c;  // never used: no zeroing needed
    if (reused < 0) reused = c;
  }
  return reused;
}

void SessionTable::Claim(uint32_t chunk, const std::string& tenant) {
  ChunkOwner& owner = chunk_owners_[chunk];
  if (!owner.tenant.empty() && owner.tenant != tenant) {
    const auto start = Clock::now();
    const Chunk& c = arena_->chunk(chunk);
    std::memset(c.data(), 0, c.size_bytes());
    zeroing_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
    ++zeroed_chunks_;
  }
  owner.tenant = tenant;
}

Result<std::vector<uint32_t>> SessionTable::AttachChunks(uint64_t session_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return NotFound("session " + std::to_string(session_id));
  std::vector<uint32_t> chunks;
  for (uint32_t c = 0; c < chunk_owners_.size(); ++c) {
    ChunkOwner& owner = chunk_owners_[c];
    if (tenant_mode_ == TenantMode::kNone || owner.tenant == it->second.tenant) {
      chunks.push_back(c);
      owner.holders.push_back(session_id);
    }
  }
  return chunks;
}

Status SessionTable::GrantChunks(uint64_t session_id, const std::vector<uint32_t>& chunks) {
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
  for (uint32_t c : chunks) {
    auto& holders = chunk_owners_[c].holders;
    if (std::find(holders.begin(), holders.end(), session_id) == holders.end()) {
      holders.push_back(session_id);
    }
  }
  return Status::Ok();
}

}  // namespace memoffload::daemon
