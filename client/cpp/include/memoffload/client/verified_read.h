// VerifiedRead: reads a committed region's bytes out of the arena while
// checking its per-extent CRC32Cs in the same pass.
//
// Each extent's checksum is extended over the bytes a read copies out when
// that read continues the extent in order (checksummed from the destination,
// right after the copy, while it is in cache); when an extent's used bytes
// are all checked its checksum is compared. VerifyRest checks whatever no
// in-order read covered, reading it from the arena. So a reader that reads a
// region front to back pays one pass instead of two (a verify at open, then
// the copy). A mismatch is DATA_LOSS naming the region, chunk and offset; the
// bytes already copied out of that extent are then not to be trusted.
//
// Not thread-safe; the Client must outlive it.
#ifndef MEMOFFLOAD_CLIENT_VERIFIED_READ_H_
#define MEMOFFLOAD_CLIENT_VERIFIED_READ_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memoffload/client/client.h"

namespace memoffload::client {

// Bytes of the arena mapped in this process.
struct ArenaSpan {
  uint8_t* data = nullptr;
  uint64_t length = 0;
};

class VerifiedRead {
 public:
  // `placement` as OpenRegion(name, /*verify=*/false) returned it. Without
  // checksums nothing is checked.
  VerifiedRead(Client* client, std::string name, Placement placement);

  // Copies [offset, offset + length) of the region into dst.
  Status Read(uint64_t offset, void* dst, uint64_t length);
  // [offset, offset + length) where it lies in the arena, without a copy:
  // one span per extent it touches, checked as Read checks them, and in
  // `crc` the CRC32C of the whole range, from the same single pass.
  Status View(uint64_t offset, uint64_t length, std::vector<ArenaSpan>* spans, uint32_t* crc);
  // Checks the bytes no in-order read checked.
  Status VerifyRest();

  const Placement& placement() const { return placement_; }

 private:
  struct Lane {
    uint64_t start = 0;  // of the extent, in the region's byte stream
    uint64_t used = 0;   // of its bytes, the region's
    uint64_t done = 0;   // [0, done) are checksummed into crc
    uint32_t crc = 0;
  };
  Status Compare(size_t lane) const;
  // Extends the checksum of the extent holding region bytes [at, at + n)
  // (within one extent), found at `p`, when they are next in line: with
  // `crc` when it is already known to be theirs (not read again).
  Status Extend(uint64_t at, uint64_t n, const uint8_t* p, std::optional<uint32_t> crc);

  Client* client_;
  const std::string name_;
  const Placement placement_;
  std::vector<Lane> lanes_;  // one per checksummed extent
  size_t hint_ = 0;          // the lane of the last read
};

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_VERIFIED_READ_H_
