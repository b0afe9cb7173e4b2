// The tenant side of SessionTable: handing out chunk fds and taking over an
// empty chunk of another tenant with a new memfd (fresh backing). Which
// chunk is whose is TenantChunks' business; this file adds the sessions and
// the backings.
#include <algorithm>
#include <map>

#include "base/log.h"
#include "core/session_table.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

// TenantChunks' `empty`: chunk c of the arena holds no extent.
std::function<bool(uint32_t)> EmptyIn(Arena* arena) {
  return [arena](uint32_t c) {
    return arena->allocator().chunk_free_bytes(c) == arena->chunk(c).size_bytes();
  };
}

ChunkGrant GrantOf(const Arena& arena, uint32_t chunk) {
  return {chunk, arena.generation(chunk), arena.backing(chunk)};
}

}  // namespace

uint32_t SessionTable::UidChunks(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  return tenant_chunks_.UidChunks(uid);
}

void SessionTable::WarnIfSharedWithoutUidLimits(uid_t uid) {
  if (warned_shared_uids_ || ledger_.uids().size() < 2) return;
  const Policy& p = quota_.policy();
  const bool bytes_off = p.uid_max_bytes == 0;
  const bool chunks_off = p.uid_max_chunks == 0 && tenant_chunks_.mode() != TenantMode::kNone;
  if (!bytes_off && !chunks_off) return;
  uid_t other = uid;
  for (const auto& [u, totals] : ledger_.uids()) {
    if (u != uid) other = u;
  }
  const std::string off = bytes_off && chunks_off ? "quotas.uid_max_bytes and uid_max_chunks are"
                          : bytes_off             ? "quotas.uid_max_bytes is"
                                                  : "quotas.uid_max_chunks is";
  warned_shared_uids_ = true;
  MO_LOG_WARN(
      "uid %u opened a session while uid %u has sessions, and %s 0 (no limit): one uid can %s. "
      "On a node shared by several uids set them (docs/security.md, 'Local peers'); "
      "logged once",
      static_cast<unsigned>(uid), static_cast<unsigned>(other), off.c_str(),
      bytes_off && chunks_off ? "hold the whole arena and keep every chunk from the others"
      : bytes_off             ? "hold the whole arena"
                              : "keep every chunk from the others with a few KiB in each");
}

std::vector<UidSnapshot> SessionTable::ListUids() const {
  absl::MutexLock lock(&mu_);
  std::map<uid_t, UidSnapshot> by_uid;
  for (const auto& [uid, totals] : ledger_.uids()) {
    UidSnapshot& u = by_uid[uid];
    u.sessions = totals.sessions;
    u.held_bytes = totals.held_bytes;
  }
  for (const auto& [uid, chunks] : tenant_chunks_.chunks_by_uid())
    by_uid[uid].owned_chunks = chunks;
  for (const auto& [uid, regions] : uid_regions_) {
    UidSnapshot& u = by_uid[uid];
    u.region_bytes = regions.held_bytes;
    u.regions = regions.count;
  }
  std::vector<UidSnapshot> out;
  for (auto& [uid, u] : by_uid) {
    u.uid = uid;
    out.push_back(u);
  }
  return out;
}

int64_t SessionTable::ClaimableFor(const Session& s, bool* capped) {
  const std::function<bool(uint32_t)> empty = EmptyIn(arena_);
  *capped = false;
  const uint64_t cap = quota_.policy().uid_max_chunks;
  if (cap == 0 || tenant_chunks_.UidChunks(s.peer.uid) < cap) {
    return tenant_chunks_.Claimable(s.tenant, empty);
  }
  const int64_t own = tenant_chunks_.Claimable(s.tenant, empty, &s.peer.uid);
  if (own < 0) *capped = tenant_chunks_.Claimable(s.tenant, empty) >= 0;
  return own;
}

Status SessionTable::UidChunksFor(const Session& s, uint64_t rounded, bool single_extent,
                                  RejectReason* reject) {
  if (quota_.policy().uid_max_chunks == 0) return Status::Ok();
  const uint64_t chunk = arena_->chunk_size_bytes();
  const uint64_t pool_free = arena_->allocator().pool_free_bytes(s.owned->pool);
  const uint64_t more =
      single_extent ? 1 : (rounded - std::min(rounded, pool_free) + chunk - 1) / chunk;
  const uint32_t owned = tenant_chunks_.UidChunks(s.peer.uid);
  if (quota_.MayTakeChunks(s.peer.uid, owned, more, rounded, reject).ok()) return Status::Ok();
  // Chunks another job of the uid left empty move without raising the count.
  const uint32_t movable = tenant_chunks_.CountClaimable(s.tenant, EmptyIn(arena_), &s.peer.uid);
  return quota_.MayTakeChunks(s.peer.uid, owned, more > movable ? more - movable : 0, rounded,
                              reject);
}

Status SessionTable::ClaimsCover(const Session& s, uint64_t rounded, bool single_extent,
                                 RejectReason* reject) {
  const std::function<bool(uint32_t)> empty = EmptyIn(arena_);
  // With the uid's chunk limit set, at most `fresh` chunks that raise its
  // count; those another tenant of the uid owns move without raising it.
  const uint64_t cap = quota_.policy().uid_max_chunks;
  const uint32_t owned = tenant_chunks_.UidChunks(s.peer.uid);
  uint64_t fresh = cap == 0 ? UINT64_MAX : (cap > owned ? cap - owned : 0);
  const uint64_t pool_free = arena_->allocator().pool_free_bytes(s.owned->pool);
  uint64_t cover = single_extent ? 0 : pool_free;
  uint32_t takeable = 0;
  std::vector<uint32_t> moving;
  if (cap != 0) moving = tenant_chunks_.ClaimableChunks(s.tenant, empty, &s.peer.uid);
  for (uint32_t c : tenant_chunks_.ClaimableChunks(s.tenant, empty)) {
    if (!std::binary_search(moving.begin(), moving.end(), c)) {
      if (fresh == 0) continue;
      --fresh;
    }
    ++takeable;
    const uint64_t size = arena_->chunk_bytes(c);
    cover = single_extent ? std::max(cover, size) : cover + size;
    if (cover >= rounded) return Status::Ok();
  }
  *reject = RejectReason::kArenaFull;
  return ResourceExhausted(
      "arena full: cannot reserve " + FormatSize(rounded) +
      (single_extent ? " as one extent" : "") + " in the chunks of tenant " + s.tenant +
      " (chunks of other tenants are not shared): " + FormatSize(pool_free) + " free in its " +
      std::to_string(s.owned->chunks.size()) + " chunk" + (s.owned->chunks.size() == 1 ? "" : "s") +
      ", and " + std::to_string(takeable) + " empty chunk" + (takeable == 1 ? "" : "s") +
      " it may take over; none was taken (the rest of the free space is in chunks other "
      "tenants hold or still map)");
}

bool SessionTable::UidChunksHold(const Session& s, uint64_t rounded, bool single_extent) {
  if (s.owned == nullptr || quota_.policy().uid_max_chunks == 0 ||
      arena_->allocator().FitsInPool(rounded, single_extent, s.owned->pool)) {
    return false;
  }
  // Placement would refuse it for the limit before or while taking chunks.
  RejectReason ignored;
  if (!UidChunksFor(s, rounded, single_extent, &ignored).ok()) return true;
  bool capped = false;
  ClaimableFor(s, &capped);
  return capped;
}

Status SessionTable::CheckFitsUidChunks(const Session& s, uint64_t rounded,
                                        RejectReason* reject) const {
  if (tenant_chunks_.mode() == TenantMode::kNone) return Status::Ok();
  return quota_.CheckFitsUidChunks(s.peer.uid, rounded, arena_->chunk_size_bytes(), reject);
}

Status SessionTable::Claim(uint32_t chunk, const std::string& tenant, uid_t uid) {
  if (tenant_chunks_.ChangesTenant(chunk, tenant)) {
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
    if (recorder_ != nullptr) recorder_->BackingReplaced(chunk, arena_->backing(chunk));
    if (fresh_backing_ != nullptr) {
      fresh_backing_->Retire(std::move(old), tenant_chunks_.recipients(chunk));
    }
    ++replaced_backings_;
  }
  tenant_chunks_.Assign(chunk, tenant, uid);
  // Its free space (all of it: only empty chunks change tenant) joins the
  // tenant's pool, where its Reserves search.
  if (Status moved = arena_->allocator().SetChunkPool(chunk, tenant_chunks_.Find(tenant)->pool);
      !moved.ok()) {
    MO_LOG_ERROR("internal error: chunk %u of tenant %s not moved to its pool: %s", chunk,
                 tenant.c_str(), moved.ToString().c_str());
    return Internal("chunk " + std::to_string(chunk) + " of tenant " + tenant + ": " +
                    moved.message());
  }
  return Status::Ok();
}

Status SessionTable::CheckTenantChunks() const {
  std::unordered_map<std::string, uint32_t> sessions;
  for (const auto& [id, s] : sessions_) {
    if (s.owned != nullptr) ++sessions[s.tenant];
    if ((s.owned == nullptr) != (tenant_chunks_.mode() == TenantMode::kNone) ||
        (s.owned != nullptr && tenant_chunks_.Find(s.tenant) != s.owned)) {
      return Internal("session " + std::to_string(id) + " does not point at the chunk list of " +
                      "its tenant '" + s.tenant + "'");
    }
  }
  MEMOFFLOAD_RETURN_IF_ERROR(tenant_chunks_.CheckInvariants(sessions));
  // Each chunk sits in its tenant's pool of the allocator.
  for (uint32_t c = 0; c < arena_->chunk_count(); ++c) {
    const std::string& owner = tenant_chunks_.OwnerOf(c);
    const uint32_t pool = owner.empty() || tenant_chunks_.mode() == TenantMode::kNone
                              ? TenantChunks::kNoTenantPool
                              : tenant_chunks_.Find(owner)->pool;
    if (arena_->allocator().chunk_pool(c) != pool) {
      return Internal("chunk " + std::to_string(c) + " of tenant '" + owner + "' is in pool " +
                      std::to_string(arena_->allocator().chunk_pool(c)) + ", its tenant's is " +
                      std::to_string(pool));
    }
  }
  return Status::Ok();
}

Result<std::vector<ChunkGrant>> SessionTable::AttachChunks(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return NotFound("session " + std::to_string(session_id));
  const std::vector<uint32_t> handed =
      tenant_chunks_.Attach(session_id, it->second.tenant, it->second.peer.pid);
  if (recorder_ != nullptr && !handed.empty()) recorder_->ChunksHanded(handed);
  std::vector<ChunkGrant> chunks;
  for (uint32_t c : handed) chunks.push_back(GrantOf(*arena_, c));
  return chunks;
}

Result<std::vector<ChunkGrant>> SessionTable::GrantChunks(uint64_t session_id,
                                                          const std::vector<uint32_t>& chunks) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return NotFound("session " + std::to_string(session_id));
  MEMOFFLOAD_RETURN_IF_ERROR(
      tenant_chunks_.Grant(session_id, it->second.tenant, it->second.peer.pid, chunks));
  if (recorder_ != nullptr && !chunks.empty()) recorder_->ChunksHanded(chunks);
  std::vector<ChunkGrant> grants;
  for (uint32_t c : chunks) grants.push_back(GrantOf(*arena_, c));
  return grants;
}

}  // namespace memoffload::daemon
