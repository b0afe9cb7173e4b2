// The frames of the link between nodes (link.h): what one rank's stream to
// a peer carries inside its TLS connection. Typed and bounded: every length
// is checked against its frame type's limit before anything is allocated
// or read, and a stream is checked against what the receiver expects from
// that peer (the items, in order, and their sizes). Nothing is unpickled.
//
// A stream is: HELLO, then for each item an ITEM and its data (PIECEs of a
// region, in order, or BLOB frames), or a FAIL in their place when the
// sender could not read it; then END. Integers are little-endian.
//
//   frame   := type u8 | length u32 | payload[length]
//   HELLO   := magic u32 "MOLK" | version u16 | rank i32 | call u64 | seq u32 | items u32
//   ITEM    := kind u8 (1 region, 2 blob) | size u64 | name_len u16 | name
//   PIECE   := offset u64 | crc32c u32 | bytes[length - 12]
//   BLOB    := bytes (the next part of the current blob)
//   FAIL    := reason (the rest of the current item will not come)
//   END     := (empty)
#ifndef MEMOFFLOAD_CLIENT_LINK_FRAMES_H_
#define MEMOFFLOAD_CLIENT_LINK_FRAMES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload::client {

inline constexpr uint32_t kLinkMagic = 0x4b4c4f4d;  // "MOLK"
inline constexpr uint16_t kLinkVersion = 1;
inline constexpr size_t kLinkFrameHeaderBytes = 5;
inline constexpr size_t kLinkPieceHeaderBytes = 12;
inline constexpr size_t kLinkMaxNameBytes = 255;
inline constexpr size_t kLinkMaxReasonBytes = 4096;
inline constexpr uint64_t kLinkMaxPieceBytes = 64ull << 20;
inline constexpr uint64_t kLinkMaxBlobBytes = 1ull << 30;
inline constexpr uint32_t kLinkMaxItems = 1 << 16;

enum class LinkFrameType : uint8_t {
  kHello = 1,
  kItem = 2,
  kPiece = 3,
  kBlob = 4,
  kFail = 5,
  kEnd = 6,
};

enum class LinkItemKind : uint8_t { kRegion = 1, kBlob = 2 };

struct LinkHello {
  int32_t rank = -1;
  uint64_t call = 0;
  uint32_t seq = 0;
  uint32_t items = 0;
};

struct LinkItem {
  LinkItemKind kind = LinkItemKind::kRegion;
  uint64_t size_bytes = 0;
  std::string name;  // a region's name; "" for a blob
};

// Frame header bytes for `type` with a payload of `length` bytes.
std::string EncodeLinkFrameHeader(LinkFrameType type, uint32_t length);
std::string EncodeLinkHello(const LinkHello& hello);  // a whole frame
std::string EncodeLinkItem(const LinkItem& item);     // a whole frame
// The frame header and piece header of a piece of `length` bytes.
std::string EncodeLinkPieceHeader(uint64_t offset, uint32_t crc32c, uint32_t length);
std::string EncodeLinkFail(const std::string& reason);  // a whole frame
std::string EncodeLinkEnd();                            // a whole frame

// The largest payload a frame of `type` may carry with pieces of
// `piece_bytes`; a header naming more is refused before anything is read.
Result<uint32_t> CheckLinkFrameHeader(const unsigned char* header, uint64_t piece_bytes,
                                      LinkFrameType* type);
Result<LinkHello> DecodeLinkHello(const std::string& payload);
Result<LinkItem> DecodeLinkItem(const std::string& payload);
// offset and crc32c of a piece header (kLinkPieceHeaderBytes bytes).
void DecodeLinkPieceHeader(const unsigned char* bytes, uint64_t* offset, uint32_t* crc32c);

// What a receiver expects from one peer and checks each frame against: the
// items in order, a region's pieces at increasing offsets covering it
// exactly, a blob's parts up to its size, then END. Pure bookkeeping (no
// I/O), so the stream's rules are one place, and fuzzed.
class LinkStreamCheck {
 public:
  explicit LinkStreamCheck(std::vector<LinkItem> expected, uint64_t piece_bytes)
      : expected_(std::move(expected)), piece_bytes_(piece_bytes) {}

  // Each returns INVALID_ARGUMENT naming what broke the rules; the stream is
  // then to be dropped.
  Status Hello(const LinkHello& hello) const;  // its item count
  Status Item(const LinkItem& item);
  // A piece of `length` bytes at `offset` of the current region.
  Status Piece(uint64_t offset, uint64_t length);
  Status Blob(uint64_t length);
  Status Fail();
  Status End();

  // The current item (valid after Item), its index, and whether it is whole.
  const LinkItem& current() const { return expected_[index_]; }
  size_t index() const { return index_; }
  uint64_t done_bytes() const { return done_; }
  bool item_open() const { return open_; }
  bool ended() const { return ended_; }

 private:
  Status CloseItem();

  std::vector<LinkItem> expected_;
  const uint64_t piece_bytes_;
  size_t index_ = 0;  // of the current item, or the next when none is open
  size_t next_ = 0;   // of the next item expected
  bool open_ = false;
  bool failed_item_ = false;
  uint64_t done_ = 0;  // bytes of the current item so far
  bool ended_ = false;
};

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_LINK_FRAMES_H_
