// Fuzzes what the link between nodes reads from a peer once its TLS
// handshake is done (link_frames.h): a stream of frames, each header checked
// against its type's bound before anything is read, each payload decoded,
// and the stream held to the items agreed (LinkStreamCheck). The input's
// first byte picks the agreement (how many regions and blobs, their sizes);
// the rest is the stream. Checks:
//   - a header is accepted only within its type's bounds (nothing larger
//     is ever allocated), and a decoded hello or item re-encodes to its bytes;
//   - the check never lets a region take more bytes than agreed, or pieces
//     out of order, nor END before every item is whole;
//   - a stream that reaches END carried exactly the items agreed.
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "memoffload/client/link_frames.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memoffload;
  using namespace memoffload::client;
  if (size == 0) return 0;
  constexpr uint64_t kPiece = 4096;
  const uint8_t shape = data[0];
  std::vector<LinkItem> agreed;
  for (int i = 0; i < (shape & 3); ++i) {
    agreed.push_back({LinkItemKind::kRegion, static_cast<uint64_t>(1 + (shape >> 2) * 997 % 20000),
                      "r" + std::to_string(i)});
  }
  if (shape & 0x80) agreed.push_back({LinkItemKind::kBlob, 5000, ""});
  LinkStreamCheck check(agreed, kPiece);
  std::vector<uint64_t> whole(agreed.size(), 0);
  size_t pos = 1;
  bool dropped = false;
  while (!dropped && pos + kLinkFrameHeaderBytes <= size) {
    LinkFrameType type;
    Result<uint32_t> length = CheckLinkFrameHeader(data + pos, kPiece, &type);
    pos += kLinkFrameHeaderBytes;
    if (!length.ok()) {
      fuzz::Check(length.status().code() == StatusCode::kInvalidArgument, "header error code");
      break;
    }
    fuzz::Check(*length <= kLinkPieceHeaderBytes + kPiece, "a header past every bound accepted");
    if (pos + *length > size) break;
    const std::string payload(reinterpret_cast<const char*>(data + pos), *length);
    pos += *length;
    Status st;
    switch (type) {
      case LinkFrameType::kHello: {
        Result<LinkHello> hello = DecodeLinkHello(payload);
        if (hello.ok()) {
          fuzz::Check(EncodeLinkHello(*hello).substr(kLinkFrameHeaderBytes) == payload,
                      "hello does not re-encode");
          st = check.Hello(*hello);
        } else {
          st = hello.status();
        }
        break;
      }
      case LinkFrameType::kItem: {
        Result<LinkItem> item = DecodeLinkItem(payload);
        if (item.ok()) {
          fuzz::Check(EncodeLinkItem(*item).substr(kLinkFrameHeaderBytes) == payload,
                      "item does not re-encode");
          st = check.Item(*item);
        } else {
          st = item.status();
        }
        break;
      }
      case LinkFrameType::kPiece: {
        uint64_t offset = 0;
        uint32_t crc = 0;
        DecodeLinkPieceHeader(reinterpret_cast<const unsigned char*>(payload.data()), &offset,
                              &crc);
        const uint64_t n = payload.size() - kLinkPieceHeaderBytes;
        st = check.Piece(offset, n);
        if (st.ok()) {
          whole[check.index()] += n;
          fuzz::Check(whole[check.index()] <= check.current().size_bytes,
                      "a region took more bytes than agreed");
          fuzz::Check(offset + n == check.done_bytes(), "pieces out of order accepted");
        }
        break;
      }
      case LinkFrameType::kBlob:
        st = check.Blob(payload.size());
        if (st.ok()) {
          whole[check.index()] += payload.size();
          fuzz::Check(whole[check.index()] <= check.current().size_bytes,
                      "a blob took more bytes than agreed");
        }
        break;
      case LinkFrameType::kFail:
        st = check.Fail();
        break;
      case LinkFrameType::kEnd:
        st = check.End();
        if (st.ok()) fuzz::Check(check.ended(), "END accepted but the stream is not ended");
        break;
    }
    if (!st.ok()) {
      fuzz::Check(st.code() == StatusCode::kInvalidArgument, "check error code");
      dropped = true;  // the receiver drops the stream
    }
  }
  return 0;
}
