#include "app/state_recovery.h"

#include <unistd.h>

#include <chrono>
#include <set>

#include "app/takeover.h"
#include "base/log.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {

void UseKeptLayout(const ArenaLayout& kept, const DaemonConfig& config, const char* whose,
                   ArenaOptions* options) {
  options->size_bytes = kept.capacity_bytes;
  options->chunk_size_bytes = kept.chunk_bytes;
  if (kept.capacity_bytes == config.arena_size_bytes &&
      kept.chunk_bytes == config.chunk_size_bytes) {
    return;
  }
  MO_LOG_WARN(
      "the %s arena is %s in %s chunks; the configuration asks for %s in %s chunks: the %s one "
      "is used, with its checkpoint regions. The new size applies after a start with nothing "
      "kept (docs/restarts.md, 'Where the state lives': which drops the node's regions)",
      whose, FormatSize(kept.capacity_bytes).c_str(), FormatSize(kept.chunk_bytes).c_str(),
      FormatSize(config.arena_size_bytes).c_str(), FormatSize(config.chunk_size_bytes).c_str(),
      whose);
}

Result<StateLoad> LoadKeptState(const DaemonConfig& config, ArenaOptions* options) {
  // Another pod's keeper only where pods share the runtime dir.
  const bool pods =
      config.take_over == "auto" &&
      config.keeper_socket.substr(0, config.keeper_socket.rfind('/')) == config.runtime_dir;
  Result<StateLoad> load = LoadState(config.state_store, config.keeper_socket, pods);
  if (!load.ok()) {
    return Status(load.status().code(), "lifecycle.state_store: " + load.status().message());
  }
  for (const std::string& problem : load->problems) MO_LOG_WARN("kept state: %s", problem.c_str());
  if (load->refused) {
    CloseChunkFds(&*load);
    return FailedPrecondition(
        "the kept state was written by a newer memoffloadd (above); refusing to start so as "
        "not to drop it: start the newer version, or release the state (systemctl stop, or "
        "stop the keeper) to start empty");
  }
  if (load->store == nullptr) {
    MO_LOG_INFO(
        "state store: none: a restart of the daemon empties the node (run it under systemd "
        "with FileDescriptorStoreMax=, or beside 'memoffloadd keeper'; docs/deploy.md)");
    return load;
  }
  const ArenaLayout& kept = load->state.layout;
  if (!load->state.found) {
    MO_LOG_INFO("state store: %s: nothing kept, starting empty", load->store->Describe().c_str());
    load->chunk_fds.clear();
    return load;
  }
  UseKeptLayout(kept, config, "kept", options);
  // The arena owns them from here (Arena::Build maps or closes each).
  for (int fd : load->chunk_fds) load->adopted.push_back(fd >= 0);
  options->adopt_fds = std::move(load->chunk_fds);
  load->chunk_fds.clear();
  return load;
}

namespace {

// A new, pre-faulted memfd behind chunk `index` (locked when the arena is).
Status FreshChunk(Arena* arena, uint32_t index) {
  Result<Chunk> fresh =
      Chunk::Create("memoffload-chunk-" + std::to_string(index), arena->chunk_bytes(index), false);
  if (!fresh.ok()) return fresh.status();
  if (arena->mlocked()) (void)!fresh->LockOnFault().ok();
  MEMOFFLOAD_RETURN_IF_ERROR(fresh->Prefault(0, fresh->size_bytes(), Chunk::kMmapLockPiece));
  arena->ReplaceBacking(index, std::make_shared<Chunk>(std::move(fresh).value()));
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<StateStore>> ResumeKeptState(
    StateLoad* load, Arena* arena_ptr, SessionTable* table, int threads, uint64_t instance_id,
    const std::vector<SessionTable::ChunkOwner>& owners, bool took_over, bool owners_complete,
    MetricsInfo* info) {
  Arena& arena = *arena_ptr;
  if (load->store == nullptr && !load->state.found) return std::unique_ptr<StateStore>();
  const auto start = std::chrono::steady_clock::now();
  const std::string where =
      took_over ? std::string("the serving daemon")
      : !load->source_path.empty()
          ? "the keeper at " + load->source_path + " (another pod's: its daemon does not run)"
          : load->store->Describe();
  if (load->store != nullptr) info->state_store = load->store->Kind();
  std::vector<bool> adopted(arena.chunk_count(), false);
  for (size_t i = 0; i < load->adopted.size() && i < adopted.size(); ++i) {
    adopted[i] = load->adopted[i];
  }
  std::vector<RegionRecord> regions;
  std::vector<std::string> dropped, unverified;
  const size_t kept_count = load->state.regions.size();
  for (auto& [key, region] : load->state.regions) {
    bool whole = true;
    for (const Extent& e : region.extents) whole &= e.chunk < adopted.size() && adopted[e.chunk];
    if (!whole) {
      dropped.push_back("region " + region.name + " of job " + region.job_id + " (uid " +
                        std::to_string(region.uid) + "): its chunk's memfd was not kept");
      continue;
    }
    regions.push_back(std::move(region));
  }
  VerifyRegions(arena, threads, &regions, &dropped, &unverified);
  const SessionTable::Recovered placed = table->Recover(regions, &dropped);
  // Only the chunks of uids with a session that may resume stay theirs as
  // they are: any other kept chunk gets new memory below, since a process
  // of a session that will not resume may still map it and copy out of it.
  std::set<uid_t> resuming;
  for (const SessionRecord& s : load->state.sessions) {
    if (s.pid > 0) resuming.insert(s.uid);
  }
  std::vector<SessionTable::ChunkOwner> kept_owners;
  for (const SessionTable::ChunkOwner& o : owners) {
    if (resuming.count(o.uid) != 0) kept_owners.push_back(o);
  }
  table->AdoptChunkOwners(kept_owners);
  // A take-over's sessions (or those a SIGTERM kept), placed back before any
  // chunk is renewed (their chunks are their tenants', so none of theirs is).
  const char* how = took_over ? "take-over" : "restart";
  std::vector<std::string> dropped_sessions;
  const SessionTable::Adopted sessions =
      table->AdoptSessions(load->state.sessions, kResumeWithin, &dropped_sessions);
  if (!load->state.sessions.empty()) {
    MO_LOG_INFO(
        "%s: %u of %zu sessions handed on (%lu groups, %s) wait for their processes to resume "
        "them (up to %lld s)",
        how, sessions.sessions, load->state.sessions.size(),
        static_cast<unsigned long>(sessions.groups), FormatSize(sessions.bytes).c_str(),
        static_cast<long long>(kResumeWithin.count()));
  }
  for (const std::string& d : dropped_sessions) {
    MO_LOG_WARN("%s: dropped %s; its process attaches again", how, d.c_str());
  }
  // An adopted chunk left with no region and no owner would be handed to
  // the next tenant as it is: old processes may still map it, and it holds
  // their bytes (a dropped region's, a dead session's).
  std::vector<bool> owned(arena.chunk_count(), false);
  for (const SessionTable::ChunkOwner& o : table->ChunkOwners()) {
    if (o.chunk < owned.size()) owned[o.chunk] = true;
  }
  // Only what was placed is kept from now on.
  const std::vector<RegionRecord> kept = table->CommittedRegions();
  for (const RegionRecord& r : kept) {
    for (const Extent& e : r.extents) {
      if (e.chunk < owned.size()) owned[e.chunk] = true;  // tenant none: no owners
    }
  }
  // A chunk never handed to a process keeps its memory (no second copy of
  // an idle arena): a take-over names every chunk's tenant, and one that
  // never had one was never handed out (a session gets its tenant's chunks
  // only); a restart has the store's record of the chunks handed out.
  std::vector<bool> handed_out(arena.chunk_count(), !owners_complete);
  if (!took_over && !load->handed.empty()) {
    for (size_t i = 0; i < handed_out.size(); ++i) {
      handed_out[i] = i >= load->handed.size() || load->handed[i];
    }
  }
  for (const SessionTable::ChunkOwner& o : owners) {
    if (o.chunk < handed_out.size()) handed_out[o.chunk] = true;
  }
  uint32_t renewed = 0;
  for (uint32_t i = 0; i < arena.chunk_count(); ++i) {
    // With tenant = none every session maps every chunk anyway.
    if (!adopted[i] || owned[i] || !handed_out[i] || table->tenant_mode() == TenantMode::kNone) {
      continue;
    }
    if (Status st = FreshChunk(&arena, i); !st.ok()) {
      return Status(st.code(), "cannot give kept chunk " + std::to_string(i) +
                                   " a new memfd: " + st.message());
    }
    adopted[i] = false;
    ++renewed;
  }
  // What the next start may keep as it is: a chunk kept here that no
  // process was handed (a renewed or new one has not been yet).
  for (uint32_t i = 0; i < arena.chunk_count(); ++i) handed_out[i] = handed_out[i] && adopted[i];
  if (renewed != 0) {
    MO_LOG_INFO("kept state: %u kept chunk%s with no region left got new memfds", renewed,
                renewed == 1 ? "" : "s");
  }
  std::unique_ptr<StateStore> store;
  if (load->store != nullptr) {
    store =
        std::make_unique<StateStore>(std::move(load->store),
                                     ArenaLayout{arena.capacity_bytes(), arena.chunk_size_bytes(),
                                                 static_cast<uint32_t>(arena.page_bytes())},
                                     instance_id);
    store->Prepare(&arena, load->state.last_seq, kept, adopted, handed_out, load->old_names);
    // A take-over's, once the node is this daemon's (Daemon::Start).
    if (!took_over) {
      if (Status st = store->Begin(); !st.ok()) {
        return Status(st.code(), "cannot keep the node's state in " + where + ": " + st.message());
      }
      table->SetRecorder(store.get());
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  info->recovered_regions = placed.regions;
  info->recovered_bytes = placed.bytes;
  info->dropped_regions = static_cast<uint32_t>(dropped.size());
  info->unverified_regions = static_cast<uint32_t>(unverified.size());
  info->recovery_seconds = seconds;
  if (load->state.found) {
    MO_LOG_INFO(
        "recovered the node from %s: %u of %zu checkpoint regions (%s) in %.3f s, instance id "
        "%016lx, state through record %lu (%lu journal records after the snapshot); %zu "
        "unverified (saved without checksums), %zu dropped",
        where.c_str(), placed.regions, kept_count, FormatSize(placed.bytes).c_str(), seconds,
        static_cast<unsigned long>(instance_id), static_cast<unsigned long>(load->state.last_seq),
        static_cast<unsigned long>(load->state.journal_records), unverified.size(), dropped.size());
    for (const std::string& note : load->state.notes) MO_LOG_WARN("kept state: %s", note.c_str());
    for (const std::string& d : dropped) MO_LOG_WARN("kept state: dropped %s", d.c_str());
    for (const std::string& u : unverified) {
      MO_LOG_INFO("kept state: %s is unverified (saved without checksums)", u.c_str());
    }
  }
  if (store == nullptr) {
    MO_LOG_INFO("state store: none: a restart of the daemon empties the node (docs/restarts.md)");
  } else {
    MO_LOG_INFO("state store: %s: the arena and its checkpoint regions outlive a restart",
                store->Describe().c_str());
  }
  return store;
}

}  // namespace memoffload::daemon
