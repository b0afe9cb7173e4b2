#include "memoffload/client/link_frames.h"

#include <cstring>

namespace memoffload::client {
namespace {

constexpr uint32_t kHelloBytes = 4 + 2 + 4 + 8 + 4 + 4;
constexpr uint32_t kMaxItemBytes = 1 + 8 + 2 + kLinkMaxNameBytes;

void Le(std::string* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t ReadLe(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

Status Broken(const std::string& what) {
  return InvalidArgument("link stream broke its rules: " + what);
}

}  // namespace

std::string EncodeLinkFrameHeader(LinkFrameType type, uint32_t length) {
  std::string out;
  out.push_back(static_cast<char>(type));
  Le(&out, length, 4);
  return out;
}

std::string EncodeLinkHello(const LinkHello& hello) {
  std::string out = EncodeLinkFrameHeader(LinkFrameType::kHello, kHelloBytes);
  Le(&out, kLinkMagic, 4);
  Le(&out, kLinkVersion, 2);
  Le(&out, static_cast<uint32_t>(hello.rank), 4);
  Le(&out, hello.call, 8);
  Le(&out, hello.seq, 4);
  Le(&out, hello.items, 4);
  return out;
}

std::string EncodeLinkItem(const LinkItem& item) {
  const std::string name = item.name.substr(0, kLinkMaxNameBytes);
  std::string out =
      EncodeLinkFrameHeader(LinkFrameType::kItem, static_cast<uint32_t>(1 + 8 + 2 + name.size()));
  out.push_back(static_cast<char>(item.kind));
  Le(&out, item.size_bytes, 8);
  Le(&out, name.size(), 2);
  out += name;
  return out;
}

std::string EncodeLinkPieceHeader(uint64_t offset, uint32_t crc32c, uint32_t length) {
  std::string out = EncodeLinkFrameHeader(LinkFrameType::kPiece,
                                          static_cast<uint32_t>(kLinkPieceHeaderBytes + length));
  Le(&out, offset, 8);
  Le(&out, crc32c, 4);
  return out;
}

std::string EncodeLinkFail(const std::string& reason) {
  const std::string r = reason.substr(0, kLinkMaxReasonBytes);
  return EncodeLinkFrameHeader(LinkFrameType::kFail, static_cast<uint32_t>(r.size())) + r;
}

std::string EncodeLinkEnd() { return EncodeLinkFrameHeader(LinkFrameType::kEnd, 0); }

Result<uint32_t> CheckLinkFrameHeader(const unsigned char* header, uint64_t piece_bytes,
                                      LinkFrameType* type) {
  const uint8_t t = header[0];
  const uint64_t length = ReadLe(header + 1, 4);
  uint64_t most = 0;
  uint64_t least = 0;
  switch (static_cast<LinkFrameType>(t)) {
    case LinkFrameType::kHello:
      least = most = kHelloBytes;
      break;
    case LinkFrameType::kItem:
      least = 1 + 8 + 2;
      most = kMaxItemBytes;
      break;
    case LinkFrameType::kPiece:
      least = kLinkPieceHeaderBytes + 1;
      most = kLinkPieceHeaderBytes + piece_bytes;
      break;
    case LinkFrameType::kBlob:
      least = 1;
      most = piece_bytes;
      break;
    case LinkFrameType::kFail:
      most = kLinkMaxReasonBytes;
      break;
    case LinkFrameType::kEnd:
      break;
    default:
      return Broken("unknown frame type " + std::to_string(t));
  }
  if (length < least || length > most) {
    return Broken("a frame of type " + std::to_string(t) + " with " + std::to_string(length) +
                  " bytes (" + std::to_string(least) + ".." + std::to_string(most) + " allowed)");
  }
  *type = static_cast<LinkFrameType>(t);
  return static_cast<uint32_t>(length);
}

Result<LinkHello> DecodeLinkHello(const std::string& payload) {
  if (payload.size() != kHelloBytes) return Broken("a hello of the wrong size");
  const auto* p = reinterpret_cast<const unsigned char*>(payload.data());
  if (ReadLe(p, 4) != kLinkMagic) return Broken("not a memoffload link hello");
  const uint64_t version = ReadLe(p + 4, 2);
  if (version != kLinkVersion) {
    return Broken("link version " + std::to_string(version) + ", this side speaks " +
                  std::to_string(kLinkVersion));
  }
  LinkHello hello;
  const uint32_t rank = static_cast<uint32_t>(ReadLe(p + 6, 4));
  std::memcpy(&hello.rank, &rank, 4);
  hello.call = ReadLe(p + 10, 8);
  hello.seq = static_cast<uint32_t>(ReadLe(p + 18, 4));
  hello.items = static_cast<uint32_t>(ReadLe(p + 22, 4));
  if (hello.rank < 0) return Broken("a negative rank");
  if (hello.items > kLinkMaxItems) return Broken("too many items");
  return hello;
}

Result<LinkItem> DecodeLinkItem(const std::string& payload) {
  if (payload.size() < 11 || payload.size() > kMaxItemBytes) return Broken("an item of a bad size");
  const auto* p = reinterpret_cast<const unsigned char*>(payload.data());
  LinkItem item;
  if (p[0] != static_cast<uint8_t>(LinkItemKind::kRegion) &&
      p[0] != static_cast<uint8_t>(LinkItemKind::kBlob)) {
    return Broken("an item of unknown kind " + std::to_string(p[0]));
  }
  item.kind = static_cast<LinkItemKind>(p[0]);
  item.size_bytes = ReadLe(p + 1, 8);
  const uint64_t name_len = ReadLe(p + 9, 2);
  if (name_len != payload.size() - 11) return Broken("an item whose name length is wrong");
  item.name = payload.substr(11);
  return item;
}

void DecodeLinkPieceHeader(const unsigned char* bytes, uint64_t* offset, uint32_t* crc32c) {
  *offset = ReadLe(bytes, 8);
  *crc32c = static_cast<uint32_t>(ReadLe(bytes + 8, 4));
}

Status LinkStreamCheck::Hello(const LinkHello& hello) const {
  if (hello.items != expected_.size()) {
    return Broken("the peer announces " + std::to_string(hello.items) + " items, " +
                  std::to_string(expected_.size()) + " were agreed");
  }
  return Status::Ok();
}

Status LinkStreamCheck::CloseItem() {
  if (!open_) return Status::Ok();
  if (!failed_item_ && done_ != expected_[index_].size_bytes) {
    return Broken("item " + std::to_string(index_) + " ended after " + std::to_string(done_) +
                  " of its " + std::to_string(expected_[index_].size_bytes) + " bytes");
  }
  open_ = false;
  return Status::Ok();
}

Status LinkStreamCheck::Item(const LinkItem& item) {
  if (ended_) return Broken("an item after END");
  MEMOFFLOAD_RETURN_IF_ERROR(CloseItem());
  if (next_ >= expected_.size()) return Broken("more items than were agreed");
  const LinkItem& want = expected_[next_];
  if (item.kind != want.kind || item.name != want.name) {
    return Broken("item " + std::to_string(next_) + " is not the one agreed");
  }
  if (want.kind == LinkItemKind::kRegion ? item.size_bytes != want.size_bytes
                                         : item.size_bytes > want.size_bytes) {
    return Broken("item " + std::to_string(next_) + " has " + std::to_string(item.size_bytes) +
                  " bytes, " + std::to_string(want.size_bytes) +
                  (want.kind == LinkItemKind::kRegion ? " were agreed" : " at most were agreed"));
  }
  index_ = next_++;
  expected_[index_].size_bytes = item.size_bytes;
  open_ = true;
  failed_item_ = false;
  done_ = 0;
  return Status::Ok();
}

Status LinkStreamCheck::Piece(uint64_t offset, uint64_t length) {
  if (!open_ || failed_item_ || expected_[index_].kind != LinkItemKind::kRegion) {
    return Broken("a piece outside a region");
  }
  if (length == 0 || length > piece_bytes_) return Broken("a piece of a bad size");
  if (offset != done_) {
    return Broken("a piece at offset " + std::to_string(offset) + ", " + std::to_string(done_) +
                  " was next");
  }
  if (length > expected_[index_].size_bytes - done_) return Broken("a piece past its region");
  done_ += length;
  return Status::Ok();
}

Status LinkStreamCheck::Blob(uint64_t length) {
  if (!open_ || failed_item_ || expected_[index_].kind != LinkItemKind::kBlob) {
    return Broken("blob bytes outside a blob");
  }
  if (length == 0 || length > expected_[index_].size_bytes - done_) {
    return Broken("blob bytes past the blob's size");
  }
  done_ += length;
  return Status::Ok();
}

Status LinkStreamCheck::Fail() {
  if (!open_ || failed_item_) return Broken("a FAIL outside an item");
  failed_item_ = true;
  return Status::Ok();
}

Status LinkStreamCheck::End() {
  if (ended_) return Broken("END twice");
  MEMOFFLOAD_RETURN_IF_ERROR(CloseItem());
  if (next_ != expected_.size()) {
    return Broken("END after " + std::to_string(next_) + " of " + std::to_string(expected_.size()) +
                  " items");
  }
  ended_ = true;
  return Status::Ok();
}

}  // namespace memoffload::client
