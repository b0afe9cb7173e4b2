#include "memoffload/client/verified_read.h"

#include <algorithm>
#include <cstdio>

#include "memoffload/common/crc32c.h"

namespace memoffload::client {
namespace {

// Reads go in pieces of this size, each checksummed right after its copy.
constexpr uint64_t kPiece = 256 << 10;

}  // namespace

VerifiedRead::VerifiedRead(Client* client, std::string name, Placement placement)
    : client_(client), name_(std::move(name)), placement_(std::move(placement)) {
  uint64_t start = 0;
  for (size_t i = 0; i < placement_.extent_crc32c.size() && i < placement_.extents.size(); ++i) {
    const uint64_t length = placement_.extents[i].length;
    const uint64_t used = placement_.used_bytes > start ? placement_.used_bytes - start : 0;
    lanes_.push_back(Lane{start, std::min(length, used), 0, 0});
    start += length;
  }
}

Status VerifiedRead::Compare(size_t i) const {
  if (lanes_[i].crc == placement_.extent_crc32c[i]) return Status::Ok();
  const Extent& e = placement_.extents[i];
  char buf[96];
  std::snprintf(buf, sizeof(buf), "expected crc32c %08x, read %08x", placement_.extent_crc32c[i],
                lanes_[i].crc);
  return Status(StatusCode::kDataLoss, "checksum mismatch in region " + name_ + " at chunk " +
                                           std::to_string(e.chunk) + " offset " +
                                           std::to_string(e.offset) + " (extent " +
                                           std::to_string(i) + "): " + buf);
}

Status VerifiedRead::Extend(uint64_t at, uint64_t n, const uint8_t* p,
                            std::optional<uint32_t> crc) {
  size_t i = std::min(hint_, lanes_.size() - 1);
  while (i + 1 < lanes_.size() && at >= lanes_[i + 1].start) ++i;
  while (i > 0 && at < lanes_[i].start) --i;
  hint_ = i;
  Lane& lane = lanes_[i];
  const uint64_t in_extent = at - lane.start;
  if (in_extent >= placement_.extents[i].length) return Status::Ok();  // past the checked ones
  if (in_extent != lane.done || lane.done >= lane.used) return Status::Ok();  // not in line
  const uint64_t m = std::min(n, lane.used - lane.done);
  lane.crc = crc.has_value() && m == n ? Crc32cCombine(lane.crc, *crc, m) : Crc32c(p, m, lane.crc);
  lane.done += m;
  if (lane.done == lane.used) return Compare(i);
  return Status::Ok();
}

Status VerifiedRead::Read(uint64_t offset, void* dst, uint64_t length) {
  uint8_t* out = static_cast<uint8_t*>(dst);
  if (lanes_.empty()) return client_->Read(placement_.extents, offset, out, length);
  for (uint64_t done = 0; done < length;) {
    const uint64_t k = std::min(kPiece, length - done);
    MEMOFFLOAD_RETURN_IF_ERROR(client_->Read(placement_.extents, offset + done, out + done, k));
    // The piece may span extents: checksum each part, from the copy, while
    // it is in cache.
    uint64_t at = offset + done;
    MEMOFFLOAD_RETURN_IF_ERROR(client_->ForEachPiece(
        placement_.extents, at, k, [&](uint8_t*, uint64_t part_done, uint64_t n) {
          return Extend(at + part_done, n, out + done + part_done, std::nullopt);
        }));
    done += k;
  }
  return Status::Ok();
}

Status VerifiedRead::View(uint64_t offset, uint64_t length, std::vector<ArenaSpan>* spans,
                          uint32_t* crc) {
  spans->clear();
  uint32_t whole = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(client_->ForEachPiece(
      placement_.extents, offset, length, [&](uint8_t* p, uint64_t done, uint64_t n) {
        const uint32_t c = Crc32c(p, n);
        whole = Crc32cCombine(whole, c, n);
        spans->push_back({p, n});
        return lanes_.empty() ? Status::Ok() : Extend(offset + done, n, p, c);
      }));
  *crc = whole;
  return Status::Ok();
}

Status VerifiedRead::VerifyRest() {
  for (size_t i = 0; i < lanes_.size(); ++i) {
    Lane& lane = lanes_[i];
    if (lane.done == lane.used) continue;
    const Extent& e = placement_.extents[i];
    const uint8_t* p =
        client_->Address(Extent{e.chunk, e.offset + lane.done, lane.used - lane.done});
    if (p == nullptr) {
      return Internal("region " + name_ + ": chunk " + std::to_string(e.chunk) +
                      " is not mapped in this process");
    }
    lane.crc = Crc32c(p, lane.used - lane.done, lane.crc);
    lane.done = lane.used;
    MEMOFFLOAD_RETURN_IF_ERROR(Compare(i));
  }
  return Status::Ok();
}

}  // namespace memoffload::client
