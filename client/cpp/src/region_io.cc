#include "memoffload/client/region_io.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "memoffload/client/log.h"
#include "memoffload/common/crc32c.h"

namespace memoffload::client {
namespace {

// Checksummed copies go in pieces of this size: each is checksummed right
// after it is written, while it is still in the cache.
constexpr uint64_t kCopyPiece = 256 << 10;

// What a reader checks as it reads: the placement's checksums only when they
// were not checked at open (or are never to be).
Placement ChecksumsToCheckAsRead(Placement placement, bool verify_as_read) {
  if (!verify_as_read) placement.extent_crc32c.clear();
  return placement;
}

}  // namespace

RegionWriter::RegionWriter(std::shared_ptr<Client> client, std::string name,
                           Reservation reservation, bool checksums)
    : client_(std::move(client)),
      name_(std::move(name)),
      reservation_(std::move(reservation)),
      checksums_(checksums) {}

RegionWriter::~RegionWriter() {
  if (state_ != State::kOpen) return;
  if (Result<uint64_t> r = client_->DeleteRegion(name_); !r.ok()) {
    Log(LogLevel::kWarning, r.status().code(),
        "aborting uncommitted region " + name_ + " failed: " + r.status().ToString());
  }
}

Status RegionWriter::CheckOpen() const {
  if (state_ == State::kOpen) return Status::Ok();
  return FailedPrecondition("region " + name_ + " is " +
                            (state_ == State::kCommitted ? "committed already" : "aborted"));
}

Result<uint64_t> RegionWriter::Append(const void* data, uint64_t size_bytes) {
  return AppendFrom(static_cast<const uint8_t*>(data), size_bytes, nullptr);
}

Result<uint64_t> RegionWriter::Append(uint64_t size_bytes, const DeviceCopy& copy) {
  return AppendFrom(nullptr, size_bytes, &copy);
}

Status RegionWriter::CheckRoom(uint64_t size_bytes) const {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckOpen());
  if (size_bytes > reservation_.reserved_bytes - written_) {
    return Status(StatusCode::kOutOfRange,
                  "appending " + std::to_string(size_bytes) + " bytes to region " + name_ +
                      " passes its size: " + std::to_string(written_) + " of " +
                      std::to_string(reservation_.reserved_bytes) + " bytes written");
  }
  return Status::Ok();
}

Result<uint64_t> RegionWriter::AppendFrom(const uint8_t* src, uint64_t size_bytes,
                                          const DeviceCopy* copy) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRoom(size_bytes));
  const uint64_t at = written_;
  MEMOFFLOAD_RETURN_IF_ERROR(Copy(src, size_bytes, copy));
  return at;
}

Status RegionWriter::Expose(uint64_t size_bytes, std::vector<ArenaSpan>* spans) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRoom(size_bytes));
  spans->clear();
  return client_->ForEachPiece(reservation_.extents, written_, size_bytes,
                               [spans](uint8_t* p, uint64_t, uint64_t n) {
                                 spans->push_back({p, n});
                                 return Status::Ok();
                               });
}

Result<uint32_t> RegionWriter::Filled(uint64_t size_bytes) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRoom(size_bytes));
  const std::vector<Extent>& extents = reservation_.extents;
  if (crc_.size() != extents.size()) crc_.assign(extents.size(), 0);
  uint32_t whole = 0;
  uint64_t start = 0;  // of extent i in the region's byte stream
  for (size_t i = 0; i < extents.size() && size_bytes != 0; start += extents[i].length, ++i) {
    const uint64_t end = start + extents[i].length;
    if (written_ >= end) continue;
    const uint64_t in_extent = written_ - start;
    const uint64_t n = std::min(size_bytes, extents[i].length - in_extent);
    const uint8_t* p = client_->Address(Extent{extents[i].chunk, extents[i].offset + in_extent, n});
    if (p == nullptr) return NotMapped(extents[i].chunk);
    const uint32_t c = Crc32c(p, n);
    if (checksums_) crc_[i] = Crc32cCombine(crc_[i], c, n);
    whole = Crc32cCombine(whole, c, n);
    written_ += n;
    size_bytes -= n;
  }
  return whole;
}

Result<uint64_t> RegionWriter::Place(uint64_t size_bytes, uint64_t align, uint8_t** address) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckOpen());
  if (size_bytes == 0 || align == 0 || (align & (align - 1)) != 0) {
    return InvalidArgument("Place needs a positive size and a power-of-two alignment");
  }
  uint64_t start = 0;  // of extent i in the region's byte stream
  for (const Extent& e : reservation_.extents) {
    const uint64_t end = start + e.length;
    if (written_ < end) {
      // Extents start page-aligned, so aligning the offset in the extent
      // aligns the address.
      const uint64_t from = std::max(written_, start);
      const uint64_t at = start + ((from - start + align - 1) & ~(align - 1));
      if (at + size_bytes <= end) {
        *address = client_->Address(Extent{e.chunk, e.offset + (at - start), size_bytes});
        if (*address == nullptr) return NotMapped(e.chunk);
        placed_ = true;
        written_ = at + size_bytes;
        return at;
      }
    }
    start = end;
  }
  return Status(StatusCode::kOutOfRange,
                "placing " + std::to_string(size_bytes) + " contiguous bytes in region " + name_ +
                    ": no extent has room left (" + std::to_string(written_) + " of " +
                    std::to_string(reservation_.reserved_bytes) + " bytes written)");
}

Result<uint64_t> RegionWriter::Commit(const std::string& rename_to) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckOpen());
  std::vector<uint32_t> crcs;
  if (checksums_ && placed_) {
    Result<std::vector<uint32_t>> from_mapping =
        client_->ExtentChecksums(reservation_.extents, written_);
    if (!from_mapping.ok()) return from_mapping.status();
    crcs = std::move(from_mapping).value();
  } else if (checksums_) {
    size_t touched = 0;
    for (uint64_t pos = 0; touched < reservation_.extents.size() && pos < written_; ++touched) {
      pos += reservation_.extents[touched].length;
    }
    crcs.assign(crc_.begin(), crc_.begin() + static_cast<ptrdiff_t>(touched));
  }
  Result<CommitInfo> r = client_->CommitRegion(name_, written_, crcs, rename_to);
  if (!r.ok()) return r.status();
  state_ = State::kCommitted;
  return written_;
}

Status RegionWriter::Abort() {
  if (state_ != State::kOpen) return Status::Ok();
  state_ = State::kAborted;
  return client_->DeleteRegion(name_).status();
}

// Appends at written_, extent by extent, checksumming each piece just
// written into its extent's running CRC.
Status RegionWriter::Copy(const uint8_t* src, uint64_t length, const DeviceCopy* copy) {
  const std::vector<Extent>& extents = reservation_.extents;
  if (crc_.size() != extents.size()) crc_.assign(extents.size(), 0);
  uint64_t from = 0;   // into the source
  uint64_t start = 0;  // of extent i in the region's byte stream
  for (size_t i = 0; i < extents.size() && length != 0; start += extents[i].length, ++i) {
    const uint64_t end = start + extents[i].length;
    if (written_ >= end) continue;
    const uint64_t in_extent = written_ - start;
    const uint64_t n = std::min(length, extents[i].length - in_extent);
    MEMOFFLOAD_RETURN_IF_ERROR(
        CopyIntoExtent(i, in_extent, n, src == nullptr ? nullptr : src + from, from, copy));
    from += n;
    written_ += n;
    length -= n;
  }
  return Status::Ok();
}

// Copies n bytes into extent i at in_extent: from src, else (a device
// source) with one `copy` of the source's [from, from + n) straight into the
// mapping; then checksums them piece by piece.
Status RegionWriter::CopyIntoExtent(size_t i, uint64_t in_extent, uint64_t n, const uint8_t* src,
                                    uint64_t from, const DeviceCopy* copy) {
  const Extent& extent = reservation_.extents[i];
  if (src == nullptr) {
    const Extent whole{extent.chunk, extent.offset + in_extent, n};
    uint8_t* dst = client_->Address(whole);
    if (dst == nullptr) return NotMapped(whole.chunk);
    MEMOFFLOAD_RETURN_IF_ERROR((*copy)(from, dst, n));
  }
  for (uint64_t done = 0; done < n;) {
    const uint64_t k = std::min(kCopyPiece, n - done);
    const Extent piece{extent.chunk, extent.offset + in_extent + done, k};
    uint8_t* dst = client_->Address(piece);
    if (dst == nullptr) return NotMapped(piece.chunk);
    if (src != nullptr) std::memcpy(dst, src + done, k);
    if (checksums_) crc_[i] = Crc32c(dst, k, crc_[i]);
    done += k;
  }
  return Status::Ok();
}

Status RegionWriter::NotMapped(uint32_t chunk) const {
  return Internal("region " + name_ + ": chunk " + std::to_string(chunk) +
                  " is not mapped in this process");
}

RegionReader::RegionReader(std::shared_ptr<Client> client, std::string name, Placement placement,
                           bool verify_as_read)
    : client_(std::move(client)),
      name_(std::move(name)),
      read_(client_.get(), name_, ChecksumsToCheckAsRead(std::move(placement), verify_as_read)) {}

RegionReader::~RegionReader() {
  if (closed_) return;
  if (Status st = client_->CloseRegion(name_); !st.ok()) {
    Log(LogLevel::kWarning, st.code(), "closing region " + name_ + " failed: " + st.ToString());
  }
}

Status RegionReader::CheckRange(uint64_t offset, uint64_t length) const {
  if (closed_) return FailedPrecondition("region " + name_ + " is closed");
  const uint64_t used = size_bytes();
  if (offset > used || length > used - offset) {
    return Status(StatusCode::kOutOfRange, "reading " + std::to_string(length) +
                                               " bytes at offset " + std::to_string(offset) +
                                               " of region " + name_ + ", which holds " +
                                               std::to_string(used) + " bytes");
  }
  return Status::Ok();
}

Status RegionReader::Read(uint64_t offset, void* dst, uint64_t length) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRange(offset, length));
  return read_.Read(offset, dst, length);
}

Result<std::string> RegionReader::Read(uint64_t offset, uint64_t length) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRange(offset, length));
  std::string out(length, '\0');
  MEMOFFLOAD_RETURN_IF_ERROR(read_.Read(offset, out.data(), length));
  return Result<std::string>(std::move(out));
}

Status RegionReader::View(uint64_t offset, uint64_t length, std::vector<ArenaSpan>* spans,
                          uint32_t* crc) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckRange(offset, length));
  return read_.View(offset, length, spans, crc);
}

Status RegionReader::VerifyRest() {
  if (closed_) return FailedPrecondition("region " + name_ + " is closed");
  return read_.VerifyRest();
}

Status RegionReader::Close() {
  if (closed_) return Status::Ok();
  closed_ = true;
  return client_->CloseRegion(name_);
}

Result<std::unique_ptr<RegionStore>> RegionStore::Attach(const RegionStoreOptions& options) {
  if (options.job_id.empty()) {
    return InvalidArgument(
        "checkpoint regions need an explicit job id (the same for every rank and for the job "
        "that restarts from the checkpoint)");
  }
  AttachOptions attach;
  attach.runtime_dir = options.runtime_dir;
  attach.job_id = options.job_id;
  attach.rank = options.rank;
  attach.kind = SessionKind::kCheckpoints;
  attach.rpc_timeout_ms = options.rpc_timeout_ms;
  Result<std::unique_ptr<Client>> client = Client::Attach(attach);
  if (!client.ok()) return client.status();
  return std::unique_ptr<RegionStore>(
      new RegionStore(std::shared_ptr<Client>(std::move(client).value()), options.checksums));
}

Status RegionStore::CheckLive() const {
  if (client_ == nullptr) return FailedPrecondition("this RegionStore is closed");
  return Status::Ok();
}

Result<std::unique_ptr<RegionWriter>> RegionStore::Create(const std::string& name,
                                                          uint64_t size_bytes, double ttl_seconds) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckLive());
  Result<Reservation> r = client_->CreateRegion(name, size_bytes, ttl_seconds);
  if (!r.ok()) return r.status();
  return std::make_unique<RegionWriter>(client_, name, std::move(r).value(), checksums_);
}

Result<std::unique_ptr<RegionReader>> RegionStore::Open(const std::string& name, bool verify,
                                                        bool verify_as_read) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckLive());
  Result<Placement> r = client_->OpenRegion(name, verify && !verify_as_read);
  if (!r.ok()) return r.status();
  return std::make_unique<RegionReader>(client_, name, std::move(r).value(),
                                        verify && verify_as_read);
}

Result<uint64_t> RegionStore::Delete(const std::string& name) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckLive());
  return client_->DeleteRegion(name);
}

Result<std::vector<RegionInfo>> RegionStore::List(const std::string& prefix) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckLive());
  return client_->ListRegions(prefix);
}

Result<uint64_t> RegionStore::session_id() const {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckLive());
  return client_->session_id();
}

Result<uint64_t> RegionStore::instance_id() const {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckLive());
  return client_->instance_id();
}

Result<Client::LinkKeys> RegionStore::ReplicationKeys() {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckLive());
  return client_->ReplicationKeys();
}

}  // namespace memoffload::client
