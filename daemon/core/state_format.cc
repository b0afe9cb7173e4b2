#include "core/state_format.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "memoffload/common/crc32c.h"

namespace memoffload::daemon {
namespace {

constexpr char kJournalMagic[8] = {'M', 'O', 'J', 'O', 'U', 'R', 'N', 'L'};
constexpr char kSnapshotMagic[8] = {'M', 'O', 'S', 'N', 'A', 'P', 'S', 'H'};

void PutU16(std::string* out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
void PutString(std::string* out, const std::string& s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out->append(s);
}
void SetU32(std::string* out, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) (*out)[at + i] = static_cast<char>(v >> (8 * i));
}

// Bounds-checked little-endian reads; the first short read fails the reader.
class Reader {
 public:
  Reader(const void* data, size_t size) : p_(static_cast<const uint8_t*>(data)), size_(size) {}
  bool ok() const { return ok_; }
  size_t pos() const { return pos_; }
  bool done() const { return pos_ == size_; }
  uint64_t Uint(int bytes) {
    if (!Have(bytes)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p_[pos_ + i]) << (8 * i);
    pos_ += bytes;
    return v;
  }
  uint16_t U16() { return static_cast<uint16_t>(Uint(2)); }
  uint32_t U32() { return static_cast<uint32_t>(Uint(4)); }
  uint64_t U64() { return Uint(8); }
  std::string String() {
    const uint32_t n = U32();
    if (n > kMaxStateString || !Have(n)) {
      ok_ = false;
      return {};
    }
    std::string s(reinterpret_cast<const char*>(p_ + pos_), n);
    pos_ += n;
    return s;
  }
  bool Magic(const char (&magic)[8]) {
    if (!Have(8) || std::memcmp(p_ + pos_, magic, 8) != 0) return ok_ = false;
    pos_ += 8;
    return true;
  }

 private:
  bool Have(size_t n) {
    if (!ok_ || size_ - pos_ < n) ok_ = false;
    return ok_;
  }
  const uint8_t* p_;
  size_t size_;
  size_t pos_ = 0;
  bool ok_ = true;
};

uint64_t DoubleBits(double d) {
  uint64_t v;
  std::memcpy(&v, &d, sizeof v);
  return v;
}
double BitsDouble(uint64_t v) {
  double d;
  std::memcpy(&d, &v, sizeof d);
  return d;
}

void PutLayout(std::string* out, const ArenaLayout& layout) {
  PutU64(out, layout.capacity_bytes);
  PutU64(out, layout.chunk_bytes);
  PutU32(out, layout.page_bytes);
}
ArenaLayout GetLayout(Reader* r) {
  ArenaLayout layout;
  layout.capacity_bytes = r->U64();
  layout.chunk_bytes = r->U64();
  layout.page_bytes = r->U32();
  return layout;
}

// Extents, then their CRC32Cs (at most one per extent).
void PutExtents(std::string* out, const std::vector<Extent>& extents,
                const std::vector<uint32_t>& crcs) {
  PutU32(out, static_cast<uint32_t>(extents.size()));
  for (const Extent& e : extents) {
    PutU32(out, e.chunk);
    PutU64(out, e.offset);
    PutU64(out, e.length);
  }
  PutU32(out, static_cast<uint32_t>(crcs.size()));
  for (uint32_t crc : crcs) PutU32(out, crc);
}
bool GetExtents(Reader* r, std::vector<Extent>* extents, std::vector<uint32_t>* crcs) {
  const uint32_t n = r->U32();
  if (!r->ok() || n > kMaxStateExtents) return false;
  for (uint32_t i = 0; i < n && r->ok(); ++i) {
    Extent e;
    e.chunk = r->U32();
    e.offset = r->U64();
    e.length = r->U64();
    extents->push_back(e);
  }
  const uint32_t count = r->U32();
  if (!r->ok() || count > n) return false;
  for (uint32_t i = 0; i < count && r->ok(); ++i) crcs->push_back(r->U32());
  return r->ok();
}

void PutRegion(std::string* out, const RegionRecord& region) {
  PutU32(out, region.uid);
  PutString(out, region.job_id);
  PutString(out, region.tenant);
  PutString(out, region.name);
  PutU64(out, region.used_bytes);
  PutU64(out, region.ttl_ms);
  PutU64(out, DoubleBits(region.committed_unix));
  PutExtents(out, region.extents, region.extent_crc32c);
}
bool GetRegion(Reader* r, RegionRecord* region) {
  region->uid = r->U32();
  region->job_id = r->String();
  region->tenant = r->String();
  region->name = r->String();
  region->used_bytes = r->U64();
  region->ttl_ms = r->U64();
  region->committed_unix = BitsDouble(r->U64());
  return GetExtents(r, &region->extents, &region->extent_crc32c);
}

void PutSession(std::string* out, const SessionRecord& s) {
  PutU64(out, s.id);
  PutString(out, s.token);
  PutU32(out, s.uid);
  PutU32(out, s.gid);
  PutU32(out, static_cast<uint32_t>(s.pid));
  PutString(out, s.job_id);
  PutU32(out, static_cast<uint32_t>(s.rank));
  PutU32(out, static_cast<uint32_t>(s.local_rank));
  PutU64(out, s.max_bytes);
  PutU64(out, s.job_max_bytes);
  PutU16(out, s.kind);
  PutU64(out, s.limit_bytes);
  PutU32(out, static_cast<uint32_t>(s.groups.size()));
  for (const GroupRecord& g : s.groups) {
    PutU64(out, g.id);
    PutU16(out, g.state);
    PutU64(out, g.used_bytes);
    PutExtents(out, g.extents, g.extent_crc32c);
  }
  PutU32(out, static_cast<uint32_t>(s.writing.size()));
  for (const RegionRecord& r : s.writing) PutRegion(out, r);
  PutU32(out, static_cast<uint32_t>(s.opened.size()));
  for (const std::string& name : s.opened) PutString(out, name);
  PutU32(out, static_cast<uint32_t>(s.deleted_open.size()));
  for (const RegionRecord& r : s.deleted_open) PutRegion(out, r);
}
bool GetSession(Reader* r, SessionRecord* s) {
  s->id = r->U64();
  s->token = r->String();
  s->uid = r->U32();
  s->gid = r->U32();
  s->pid = static_cast<int32_t>(r->U32());
  s->job_id = r->String();
  s->rank = static_cast<int32_t>(r->U32());
  s->local_rank = static_cast<int32_t>(r->U32());
  s->max_bytes = r->U64();
  s->job_max_bytes = r->U64();
  s->kind = r->U16();
  s->limit_bytes = r->U64();
  const uint32_t groups = r->U32();
  if (!r->ok() || groups > kMaxStateExtents) return false;
  for (uint32_t i = 0; i < groups && r->ok(); ++i) {
    GroupRecord g;
    g.id = r->U64();
    g.state = r->U16();
    g.used_bytes = r->U64();
    if (!GetExtents(r, &g.extents, &g.extent_crc32c)) return false;
    s->groups.push_back(std::move(g));
  }
  const uint32_t writing = r->U32();
  if (!r->ok() || writing > kMaxStateExtents) return false;
  for (uint32_t i = 0; i < writing && r->ok(); ++i) {
    RegionRecord region;
    if (!GetRegion(r, &region)) return false;
    s->writing.push_back(std::move(region));
  }
  const uint32_t opened = r->U32();
  if (!r->ok() || opened > kMaxStateExtents) return false;
  for (uint32_t i = 0; i < opened && r->ok(); ++i) s->opened.push_back(r->String());
  const uint32_t deleted_open = r->U32();
  if (!r->ok() || deleted_open > kMaxStateExtents) return false;
  for (uint32_t i = 0; i < deleted_open && r->ok(); ++i) {
    RegionRecord region;
    if (!GetRegion(r, &region)) return false;
    s->deleted_open.push_back(std::move(region));
  }
  return r->ok();
}

// Whether a decoded layout is one a daemon could have built (bounds what a
// start allocates from it: one entry per chunk, at most 65536 chunks).
bool LayoutSane(const ArenaLayout& l) {
  return l.page_bytes >= 4096 && (l.page_bytes & (l.page_bytes - 1)) == 0 &&
         l.chunk_bytes >= l.page_bytes && l.chunk_bytes % l.page_bytes == 0 &&
         l.capacity_bytes > 0 && l.capacity_bytes % l.page_bytes == 0 &&
         l.capacity_bytes / l.chunk_bytes < (1u << 16);
}

Status NewerVersion(const char* what, uint32_t version) {
  return FailedPrecondition(std::string(what) + " format v" + std::to_string(version) +
                            " was written by a newer memoffloadd; this one reads up to v" +
                            std::to_string(kStateFormatVersion));
}

std::string Record(uint64_t seq, JournalRecordType type, const std::string& payload) {
  std::string out;
  PutU32(&out, static_cast<uint32_t>(payload.size()));
  PutU32(&out, 0);  // the CRC, set below
  PutU64(&out, seq);
  PutU16(&out, static_cast<uint16_t>(type));
  out.append(6, '\0');
  out.append(payload);
  out.append((8 - out.size() % 8) % 8, '\0');
  SetU32(&out, 4, Crc32c(out.data() + 8, kJournalRecordHeaderBytes - 8 + payload.size()));
  return out;
}

}  // namespace

uint64_t RegionRecord::held_bytes() const {
  uint64_t held = 0;
  for (const Extent& e : extents) held += e.length;
  return held;
}

std::string EncodeJournalHeader(const ArenaLayout& layout, uint64_t instance_id, uint64_t first_seq,
                                uint64_t generation) {
  std::string out(kJournalMagic, 8);
  PutU32(&out, 1);  // the journal is as v1 wrote it (v2 added sessions to snapshots only)
  PutU64(&out, first_seq);
  PutU64(&out, instance_id);
  PutLayout(&out, layout);
  // In what v1 left zero: a daemon of either version reads the header.
  PutU64(&out, generation);
  out.resize(kJournalHeaderBytes - 4, '\0');
  PutU32(&out, Crc32c(out.data(), out.size()));
  return out;
}

std::string EncodeRegionCommitted(uint64_t seq, const RegionRecord& region) {
  std::string payload;
  PutRegion(&payload, region);
  return Record(seq, JournalRecordType::kRegionCommitted, payload);
}

std::string EncodeRegionDeleted(uint64_t seq, const RegionKey& key) {
  std::string payload;
  PutU32(&payload, std::get<0>(key));
  PutString(&payload, std::get<1>(key));
  PutString(&payload, std::get<2>(key));
  return Record(seq, JournalRecordType::kRegionDeleted, payload);
}

std::string EncodeSnapshot(const SnapshotContents& snapshot) {
  std::string out(kSnapshotMagic, 8);
  // Without sessions, v1: a daemon of either version reads it.
  const uint32_t version = snapshot.sessions.empty() ? 1 : 2;
  PutU32(&out, version);
  PutU64(&out, snapshot.last_seq);
  PutU64(&out, snapshot.instance_id);
  PutLayout(&out, snapshot.layout);
  PutU32(&out, static_cast<uint32_t>(snapshot.regions.size()));
  for (const auto& [key, region] : snapshot.regions) PutRegion(&out, region);
  if (version >= 2) {
    PutU32(&out, static_cast<uint32_t>(snapshot.sessions.size()));
    for (const SessionRecord& s : snapshot.sessions) PutSession(&out, s);
    PutU32(&out, static_cast<uint32_t>(snapshot.owners.size()));
    for (const ChunkOwnerRecord& o : snapshot.owners) {
      PutU32(&out, o.chunk);
      PutString(&out, o.tenant);
      PutU32(&out, o.uid);
    }
  }
  PutU32(&out, Crc32c(out.data(), out.size()));
  return out;
}

Result<SnapshotContents> DecodeSnapshot(const void* data, size_t size) {
  Reader r(data, size);
  if (!r.Magic(kSnapshotMagic)) return DataLoss("not a memoffload state snapshot (bad magic)");
  SnapshotContents s;
  s.version = r.U32();
  if (r.ok() && s.version > kStateFormatVersion) return NewerVersion("snapshot", s.version);
  if (r.ok() && s.version == 0) return DataLoss("snapshot version 0 does not exist");
  if (size < 4 ||
      Crc32c(data, size - 4) != Reader(static_cast<const uint8_t*>(data) + size - 4, 4).U32()) {
    return DataLoss("snapshot fails its CRC32C (" + std::to_string(size) + " bytes)");
  }
  Reader body(data, size - 4);
  body.Magic(kSnapshotMagic);
  body.U32();
  s.last_seq = body.U64();
  s.instance_id = body.U64();
  s.layout = GetLayout(&body);
  const uint32_t count = body.U32();
  for (uint32_t i = 0; i < count && body.ok(); ++i) {
    RegionRecord region;
    if (!GetRegion(&body, &region)) return DataLoss("snapshot body is malformed");
    RegionKey key = KeyOf(region);
    const std::string name = region.name;
    if (!s.regions.emplace(std::move(key), std::move(region)).second) {
      return DataLoss("snapshot names region " + name + " twice");
    }
  }
  if (s.version >= 2 && body.ok()) {
    const uint32_t sessions = body.U32();
    if (sessions > kMaxStateSessions) return DataLoss("snapshot holds too many sessions");
    std::set<uint64_t> ids;
    for (uint32_t i = 0; i < sessions && body.ok(); ++i) {
      SessionRecord session;
      if (!GetSession(&body, &session)) return DataLoss("snapshot body is malformed");
      if (!ids.insert(session.id).second) {
        return DataLoss("snapshot names session " + std::to_string(session.id) + " twice");
      }
      s.sessions.push_back(std::move(session));
    }
    const uint32_t owners = body.U32();
    if (owners > (1u << 16)) return DataLoss("snapshot names too many chunk owners");
    for (uint32_t i = 0; i < owners && body.ok(); ++i) {
      ChunkOwnerRecord o;
      o.chunk = body.U32();
      o.tenant = body.String();
      o.uid = body.U32();
      s.owners.push_back(std::move(o));
    }
  }
  if (!body.ok() || !body.done()) return DataLoss("snapshot body is malformed");
  if (!LayoutSane(s.layout)) return DataLoss("snapshot names an arena layout no daemon builds");
  return s;
}

Result<JournalContents> DecodeJournal(const void* data, size_t size) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  Reader h(data, std::min(size, kJournalHeaderBytes));
  if (!h.Magic(kJournalMagic)) return DataLoss("not a memoffload state journal (bad magic)");
  JournalContents j;
  const uint32_t version = h.U32();
  if (h.ok() && version > kStateFormatVersion) return NewerVersion("journal", version);
  if (size < kJournalHeaderBytes ||
      Crc32c(data, kJournalHeaderBytes - 4) != Reader(bytes + kJournalHeaderBytes - 4, 4).U32()) {
    return DataLoss("journal header fails its CRC32C");
  }
  if (version == 0) return DataLoss("journal version 0 does not exist");
  j.first_seq = h.U64();
  j.instance_id = h.U64();
  j.layout = GetLayout(&h);
  j.generation = h.U64();
  if (!LayoutSane(j.layout)) return DataLoss("journal names an arena layout no daemon builds");
  size_t at = kJournalHeaderBytes;
  uint64_t expect = j.first_seq;
  while (true) {
    if (size - at < kJournalRecordHeaderBytes) break;  // the end of the journal
    Reader rh(bytes + at, kJournalRecordHeaderBytes);
    const uint32_t length = rh.U32();
    const uint32_t crc = rh.U32();
    const uint64_t seq = rh.U64();
    const uint16_t type = rh.U16();
    if (length == 0 && crc == 0 && seq == 0) break;  // never written: the clean end
    const size_t padded = (kJournalRecordHeaderBytes + static_cast<size_t>(length) + 7) / 8 * 8;
    const std::string where = "record at offset " + std::to_string(at);
    if (length > size - at - kJournalRecordHeaderBytes || padded > size - at) {
      j.stopped = where + " is torn (its length passes the journal's end)";
      break;
    }
    if (Crc32c(bytes + at + 8, kJournalRecordHeaderBytes - 8 + length) != crc) {
      j.stopped = where + " fails its CRC32C (cut short by a crash, or overwritten)";
      break;
    }
    if (seq != expect) {
      j.stopped =
          where + " has sequence " + std::to_string(seq) + ", expected " + std::to_string(expect);
      break;
    }
    JournalEntry entry;
    entry.seq = seq;
    Reader p(bytes + at + kJournalRecordHeaderBytes, length);
    bool ok = false;
    if (type == static_cast<uint16_t>(JournalRecordType::kRegionCommitted)) {
      entry.type = JournalRecordType::kRegionCommitted;
      ok = GetRegion(&p, &entry.region) && p.done();
    } else if (type == static_cast<uint16_t>(JournalRecordType::kRegionDeleted)) {
      entry.type = JournalRecordType::kRegionDeleted;
      entry.region.uid = p.U32();
      entry.region.job_id = p.String();
      entry.region.name = p.String();
      ok = p.ok() && p.done();
    } else {
      j.stopped = where + " has an unknown type " + std::to_string(type);
      break;
    }
    if (!ok) {
      j.stopped = where + " passes its CRC but its payload is malformed";
      break;
    }
    j.entries.push_back(std::move(entry));
    ++expect;
    at += padded;
  }
  j.end_offset = at;
  return j;
}

ReplayedState Replay(const SnapshotContents* snapshot,
                     const std::vector<JournalContents>& journals) {
  ReplayedState out;
  if (snapshot != nullptr) {
    out.found = true;
    out.instance_id = snapshot->instance_id;
    out.layout = snapshot->layout;
    out.last_seq = snapshot->last_seq;
    out.regions = snapshot->regions;
    out.sessions = snapshot->sessions;
    out.owners = snapshot->owners;
  }
  // Every readable record, by sequence number (journals may overlap when
  // a compaction was cut short).
  std::map<uint64_t, const JournalEntry*> records;
  std::vector<const JournalContents*> ordered;
  for (const JournalContents& j : journals) ordered.push_back(&j);
  std::sort(ordered.begin(), ordered.end(), [](const JournalContents* a, const JournalContents* b) {
    return a->first_seq < b->first_seq;
  });
  for (const JournalContents* jp : ordered) {
    const JournalContents& j = *jp;
    if (!out.found) {
      out.found = true;
      out.instance_id = j.instance_id;
      out.layout = j.layout;
      out.last_seq = j.first_seq - 1;
    } else if (!(j.layout == out.layout) || j.instance_id != out.instance_id) {
      out.notes.push_back("a journal from another arena or node (instance " +
                          std::to_string(j.instance_id) + ") was ignored");
      continue;
    }
    if (!j.stopped.empty()) out.notes.push_back("journal: " + j.stopped);
    for (const JournalEntry& e : j.entries) records.emplace(e.seq, &e);
  }
  for (auto it = records.upper_bound(out.last_seq); it != records.end(); ++it) {
    if (it->first != out.last_seq + 1) {
      out.notes.push_back("journal records from " + std::to_string(out.last_seq + 1) +
                          " are missing; replay stops at " + std::to_string(out.last_seq));
      break;
    }
    const JournalEntry& e = *it->second;
    if (e.type == JournalRecordType::kRegionCommitted) {
      out.regions[KeyOf(e.region)] = e.region;
    } else {
      out.regions.erase(KeyOf(e.region));
    }
    out.last_seq = e.seq;
    ++out.journal_records;
  }
  return out;
}

}  // namespace memoffload::daemon
