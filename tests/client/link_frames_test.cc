// The link's frames (link_frames.h): what encodes decodes back, a header
// naming more than its type may carry is refused before anything is read,
// and LinkStreamCheck holds a peer to the items agreed.
#include "memoffload/client/link_frames.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace memoffload::client {
namespace {

constexpr uint64_t kPiece = 1 << 20;

const unsigned char* Bytes(const std::string& s) {
  return reinterpret_cast<const unsigned char*>(s.data());
}

TEST(LinkFrames, WhatIsEncodedDecodesBack) {
  LinkHello hello{7, 0x1234567890abcdefull, 3, 2};
  const std::string frame = EncodeLinkHello(hello);
  LinkFrameType type;
  Result<uint32_t> length = CheckLinkFrameHeader(Bytes(frame), kPiece, &type);
  ASSERT_TRUE(length.ok()) << length.status().ToString();
  EXPECT_EQ(type, LinkFrameType::kHello);
  Result<LinkHello> back = DecodeLinkHello(frame.substr(kLinkFrameHeaderBytes));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->rank, 7);
  EXPECT_EQ(back->call, 0x1234567890abcdefull);
  EXPECT_EQ(back->seq, 3u);
  EXPECT_EQ(back->items, 2u);
  const std::string item = EncodeLinkItem({LinkItemKind::kRegion, 5000, "dcp/step-1/__0_0.distcp"});
  ASSERT_TRUE(CheckLinkFrameHeader(Bytes(item), kPiece, &type).ok());
  EXPECT_EQ(type, LinkFrameType::kItem);
  Result<LinkItem> decoded = DecodeLinkItem(item.substr(kLinkFrameHeaderBytes));
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->name, "dcp/step-1/__0_0.distcp");
  EXPECT_EQ(decoded->size_bytes, 5000u);
  const std::string piece = EncodeLinkPieceHeader(4096, 0xdeadbeef, 100);
  ASSERT_EQ(piece.size(), kLinkFrameHeaderBytes + kLinkPieceHeaderBytes);
  EXPECT_EQ(*CheckLinkFrameHeader(Bytes(piece), kPiece, &type), kLinkPieceHeaderBytes + 100);
  uint64_t offset = 0;
  uint32_t crc = 0;
  DecodeLinkPieceHeader(Bytes(piece) + kLinkFrameHeaderBytes, &offset, &crc);
  EXPECT_EQ(offset, 4096u);
  EXPECT_EQ(crc, 0xdeadbeefu);
}

TEST(LinkFrames, AHeaderNamingMoreThanItsTypeCarriesIsRefusedFirst) {
  LinkFrameType type;
  // A piece longer than the pieces agreed, a blob of 0 bytes, a hello of the
  // wrong size, END with a payload, an unknown type.
  for (const std::string& header :
       {EncodeLinkFrameHeader(LinkFrameType::kPiece, kLinkPieceHeaderBytes + kPiece + 1),
        EncodeLinkFrameHeader(LinkFrameType::kBlob, 0),
        EncodeLinkFrameHeader(LinkFrameType::kHello, 25),
        EncodeLinkFrameHeader(LinkFrameType::kEnd, 1),
        EncodeLinkFrameHeader(LinkFrameType::kFail, kLinkMaxReasonBytes + 1),
        EncodeLinkFrameHeader(static_cast<LinkFrameType>(99), 0)}) {
    EXPECT_EQ(CheckLinkFrameHeader(Bytes(header), kPiece, &type).status().code(),
              StatusCode::kInvalidArgument);
  }
  // What a gloo peer or a TLS ClientHello sends first is no frame of ours.
  EXPECT_FALSE(DecodeLinkHello(std::string(26, '\x16')).ok());
}

TEST(LinkFrames, AStreamMustCarryTheItemsAgreedInOrderAndWhole) {
  std::vector<LinkItem> agreed = {{LinkItemKind::kRegion, 2500, "a"},
                                  {LinkItemKind::kBlob, 100, ""}};
  LinkStreamCheck ok(agreed, 1000);
  ASSERT_TRUE(ok.Hello({1, 0, 0, 2}).ok());
  ASSERT_TRUE(ok.Item({LinkItemKind::kRegion, 2500, "a"}).ok());
  ASSERT_TRUE(ok.Piece(0, 1000).ok());
  ASSERT_TRUE(ok.Piece(1000, 1000).ok());
  ASSERT_TRUE(ok.Piece(2000, 500).ok());
  ASSERT_TRUE(ok.Item({LinkItemKind::kBlob, 60, ""}).ok());  // a blob may be shorter
  ASSERT_TRUE(ok.Blob(60).ok());
  ASSERT_TRUE(ok.End().ok());
  EXPECT_FALSE(ok.End().ok());

  auto broken = [&](auto&& steps) {
    LinkStreamCheck c(agreed, 1000);
    return !steps(c).ok();
  };
  EXPECT_TRUE(broken([](LinkStreamCheck& c) { return c.Hello({1, 0, 0, 3}); }));
  EXPECT_TRUE(broken([](LinkStreamCheck& c) {
    return c.Item({LinkItemKind::kRegion, 2500, "b"});
  }));
  EXPECT_TRUE(broken([](LinkStreamCheck& c) {
    return c.Item({LinkItemKind::kRegion, 2600, "a"});
  }));
  EXPECT_TRUE(broken([](LinkStreamCheck& c) { return c.Piece(0, 10); }));  // no item yet
  EXPECT_TRUE(broken([](LinkStreamCheck& c) {
    (void)c.Item({LinkItemKind::kRegion, 2500, "a"});
    return c.Piece(1000, 1000);  // a gap
  }));
  EXPECT_TRUE(broken([](LinkStreamCheck& c) {
    (void)c.Item({LinkItemKind::kRegion, 2500, "a"});
    (void)c.Piece(0, 1000);
    (void)c.Piece(1000, 1000);
    return c.Piece(2000, 1000);  // past the region
  }));
  EXPECT_TRUE(broken([](LinkStreamCheck& c) {
    (void)c.Item({LinkItemKind::kRegion, 2500, "a"});
    (void)c.Piece(0, 1000);
    return c.Item({LinkItemKind::kBlob, 10, ""});  // the region was not whole
  }));
  EXPECT_TRUE(broken([](LinkStreamCheck& c) {
    (void)c.Item({LinkItemKind::kRegion, 2500, "a"});
    (void)c.Piece(0, 2500 - 1500);
    return c.End();
  }));
  EXPECT_TRUE(broken([](LinkStreamCheck& c) { return c.Item({LinkItemKind::kBlob, 200, ""}); }));
  // A FAIL ends an item early, and nothing more of it may come.
  LinkStreamCheck failed(agreed, 1000);
  ASSERT_TRUE(failed.Item({LinkItemKind::kRegion, 2500, "a"}).ok());
  ASSERT_TRUE(failed.Piece(0, 1000).ok());
  ASSERT_TRUE(failed.Fail().ok());
  EXPECT_FALSE(failed.Piece(1000, 1000).ok());
  ASSERT_TRUE(failed.Item({LinkItemKind::kBlob, 100, ""}).ok());
  ASSERT_TRUE(failed.Blob(100).ok());
  EXPECT_TRUE(failed.End().ok());
}

}  // namespace
}  // namespace memoffload::client
