#include "app/state_store.h"

#include <absl/strings/match.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "app/process_setup.h"
#include "app/state_names.h"
#include "base/log.h"

namespace memoffload::daemon {

StateStore::StateStore(std::unique_ptr<FdStore> store, ArenaLayout layout, uint64_t instance_id)
    : store_(std::move(store)),
      layout_(layout),
      instance_id_(instance_id),
      generation_(RandomInstanceId()) {}

StateStore::~StateStore() = default;

void StateStore::RemoveName(const std::string& name) {
  if (Status st = store_->Remove(name); !st.ok()) Failed("cannot remove " + name, st);
}

void StateStore::Failed(const std::string& what, const Status& status) {
  ++stats_.errors;
  MO_LOG_LIMITED(LogLevel::kError, "state store: %s: %s; a restart may lose what changed since",
                 what.c_str(), status.ToString().c_str());
}

void StateStore::Prepare(const Arena* arena, uint64_t last_seq, std::vector<RegionRecord> regions,
                         std::vector<bool> adopted, std::vector<bool> handed,
                         std::vector<std::string> old_names) {
  absl::MutexLock lock(&mu_);
  prepared_ = Prepared{arena,
                       last_seq,
                       std::move(regions),
                       std::move(adopted),
                       std::move(handed),
                       std::move(old_names)};
}

Status StateStore::Begin() {
  absl::MutexLock lock(&mu_);
  if (prepared_.arena == nullptr) return FailedPrecondition("the state store was not prepared");
  const Prepared p = std::exchange(prepared_, Prepared{});
  abandon_names_ = p.old_names;
  const Arena& arena = *p.arena;
  const std::vector<bool>& adopted = p.adopted;
  const std::vector<bool>& handed = p.handed;
  const std::vector<std::string>& old_names = p.old_names;
  for (const RegionRecord& r : p.regions) regions_[KeyOf(r)] = r;
  // One past the kept state's last record: this snapshot differs from a
  // kept one of that number (regions that were dropped are not in it).
  seq_ = p.last_seq + 1;
  for (const std::string& name : old_names) {
    if (absl::StartsWith(name, kChunkPrefix) &&
        std::strtoull(name.c_str() + std::strlen(kChunkPrefix), nullptr, 10) >=
            arena.chunk_count()) {
      RemoveName(name);
    }
  }
  for (uint32_t i = 0; i < arena.chunk_count(); ++i) {
    // An adopted chunk is put again (a take-over's store may not have it;
    // systemd and the keeper keep one copy of the same memfd), never
    // removed first: it holds kept regions.
    const bool same = i < adopted.size() && adopted[i];
    const std::string name = kChunkPrefix + std::to_string(i);
    if (!same && std::find(old_names.begin(), old_names.end(), name) != old_names.end()) {
      RemoveName(name);
    }
    if (Status st = store_->Put(name, arena.chunk(i).fd()); !st.ok()) return st;
  }
  // The record of an earlier daemon goes first: without one a start counts
  // every chunk as handed out, never one as not.
  if (std::find(old_names.begin(), old_names.end(), kHandedChunksName) != old_names.end()) {
    RemoveName(kHandedChunksName);
  }
  std::vector<bool> record(arena.chunk_count(), false);
  for (size_t i = 0; i < handed.size() && i < record.size(); ++i) record[i] = handed[i];
  Result<std::unique_ptr<HandedChunks>> made = HandedChunks::Create(record, generation_);
  Status put = made.ok() ? store_->Put(kHandedChunksName, (*made)->fd()) : made.status();
  if (put.ok()) {
    handed_ = std::move(made).value();
    marking_.store(handed_.get());
  } else {
    Failed("cannot keep the record of the chunks handed out", put);
  }
  // This daemon's store from here: a mark left in it (a hand-over or another
  // pod taking the node from it, earlier) no longer says anything true.
  if (std::find(old_names.begin(), old_names.end(), kHandedOverName) != old_names.end()) {
    RemoveName(kHandedOverName);
  }
  const std::string old_journal = journal_name_, old_snapshot = snapshot_name_;
  MEMOFFLOAD_RETURN_IF_ERROR(CompactLocked());
  for (const std::string& name : old_names) {
    if ((absl::StartsWith(name, kJournalPrefix) || absl::StartsWith(name, kSnapshotPrefix)) &&
        name != journal_name_ && name != snapshot_name_) {
      RemoveName(name);
    }
  }
  return Status::Ok();
}

Status StateStore::MarkHandedOver(const std::string& why) {
  absl::MutexLock lock(&mu_);
  return MarkStoreHandedOver(store_.get(), why);
}

void StateStore::ChunksHanded(const std::vector<uint32_t>& chunks) {
  // Byte stores into the record (atomic): callers need no lock of ours.
  HandedChunks* record = marking_.load();
  if (record == nullptr) return;
  for (uint32_t c : chunks) record->Mark(c);
}

void StateStore::Abandon() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names = abandon_names_;
  names.insert(names.end(), {journal_name_, snapshot_name_, kHandedChunksName, kHandedOverName});
  for (const std::string& name : names) {
    if (absl::StartsWith(name, kJournalPrefix) || absl::StartsWith(name, kSnapshotPrefix) ||
        name == kHandedChunksName || name == kHandedOverName) {
      (void)store_->Remove(name).ok();  // best effort: the store already failed
    }
  }
}

void StateStore::DisownHandedRecord() {
  absl::MutexLock lock(&mu_);
  if (handed_ == nullptr) return;
  if (Status st = DisownHandedChunksFd(handed_->fd()); !st.ok()) {
    Failed("cannot disown the record of the chunks handed out", st);
  }
}

void StateStore::ClearHandOverMark() {
  absl::MutexLock lock(&mu_);
  RemoveName(kHandedOverName);
}

Status StateStore::Compact(const std::vector<SessionRecord>& sessions,
                           const std::vector<ChunkOwnerRecord>& owners) {
  absl::MutexLock lock(&mu_);
  return CompactLocked(sessions, owners);
}

Status StateStore::CompactLocked(const std::vector<SessionRecord>& sessions,
                                 const std::vector<ChunkOwnerRecord>& owners) {
  SnapshotContents s;
  s.last_seq = seq_;
  s.instance_id = instance_id_;
  s.layout = layout_;
  s.regions = regions_;
  s.sessions = sessions;
  if (!sessions.empty()) s.owners = owners;
  Result<int> sealed = SealedMemfd("memoffload-snapshot", EncodeSnapshot(s));
  if (!sealed.ok()) return sealed.status();
  const int fd = *sealed;
  Result<Chunk> journal = Chunk::Create("memoffload-journal", kJournalBytes, false);
  if (!journal.ok()) {
    close(fd);
    return journal.status();
  }
  const std::string header = EncodeJournalHeader(layout_, instance_id_, seq_ + 1, generation_);
  std::memcpy(journal->data(), header.data(), header.size());
  // The snapshot first: a start that finds it ignores the journals' records
  // up to its last_seq, and finds the records after it in the new journal.
  // One with sessions at the same record as the last snapshot is another
  // name (SnapshotNewer puts it first): the one before stays until it is in.
  const std::string snapshot_name =
      kSnapshotPrefix + std::to_string(seq_) + (sessions.empty() ? "" : kWithSessions);
  const std::string journal_name = kJournalPrefix + std::to_string(seq_ + 1);
  Status put = Status::Ok();
  if (snapshot_name != snapshot_name_) put = store_->Put(snapshot_name, fd);
  close(fd);
  MEMOFFLOAD_RETURN_IF_ERROR(put);
  if (journal_name == journal_name_) RemoveName(journal_name_);  // nothing after the last
  MEMOFFLOAD_RETURN_IF_ERROR(store_->Put(journal_name, journal->fd()));
  if (!snapshot_name_.empty() && snapshot_name_ != snapshot_name) RemoveName(snapshot_name_);
  if (!journal_name_.empty() && journal_name_ != journal_name) RemoveName(journal_name_);
  snapshot_name_ = snapshot_name;
  journal_name_ = journal_name;
  journal_ = std::make_unique<Chunk>(std::move(journal).value());
  journal_used_ = header.size();
  ++stats_.snapshots;
  return Status::Ok();
}

void StateStore::Append(const std::string& record) {
  if (journal_ == nullptr) {  // Begin failed
    Failed("no journal to record a change in", Unavailable("the state store did not start"));
    return;
  }
  if (journal_used_ + record.size() > kJournalBytes) {
    // The new journal starts at this record's seq. The mirror holds its
    // change already, so the snapshot (through seq - 1) has it too:
    // replaying the record over it changes nothing.
    --seq_;
    Status st = CompactLocked();
    ++seq_;
    if (!st.ok()) {
      Failed("cannot compact the full journal", st);
      return;
    }
  }
  std::memcpy(journal_->data() + journal_used_, record.data(), record.size());
  journal_used_ += record.size();
  ++stats_.records;
}

void StateStore::RegionCommitted(const RegionRecord& region) {
  absl::MutexLock lock(&mu_);
  regions_[KeyOf(region)] = region;
  Append(EncodeRegionCommitted(++seq_, region));
}

void StateStore::RegionDeleted(const RegionKey& key) {
  absl::MutexLock lock(&mu_);
  regions_.erase(key);
  Append(EncodeRegionDeleted(++seq_, key));
}

void StateStore::BackingReplaced(uint32_t index, const std::shared_ptr<const Chunk>& backing) {
  absl::MutexLock lock(&mu_);
  // The old backing held no region (only empty chunks change tenant), so
  // losing it between these two calls loses nothing.
  const std::string name = kChunkPrefix + std::to_string(index);
  RemoveName(name);
  if (Status st = store_->Put(name, backing->fd()); !st.ok()) Failed("chunk " + name, st);
}

uint64_t StateStore::last_seq() const {
  absl::MutexLock lock(&mu_);
  return seq_;
}

StateStoreStats StateStore::Stats() const {
  absl::MutexLock lock(&mu_);
  StateStoreStats s = stats_;
  s.journal_bytes = journal_used_;
  return s;
}

}  // namespace memoffload::daemon
