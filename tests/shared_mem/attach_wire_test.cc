#include "memoffload/shared_mem/attach_wire.h"

#include <gtest/gtest.h>

#include <random>

namespace memoffload {
namespace {

TEST(AttachWire, HelloRoundTrip) {
  Hello h;
  h.job_id = "llama-70b/run-3";
  h.rank = 17;
  h.local_rank = 1;
  h.max_bytes = 123456789;
  Result<Hello> d = DecodeHello(EncodeHello(h));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->job_id, h.job_id);
  EXPECT_EQ(d->rank, 17);
  EXPECT_EQ(d->local_rank, 1);
  EXPECT_EQ(d->max_bytes, 123456789u);
}

TEST(AttachWire, HelloCarriesItsKindAndRefusesAnUnknownOne) {
  Hello h;
  h.job_id = "job";
  h.kind = SessionKind::kState;
  Result<Hello> d = DecodeHello(EncodeHello(h));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->kind, SessionKind::kState);
  EXPECT_STREQ(SessionKindName(d->kind), "state");
  std::string bytes = EncodeHello(h);
  bytes.back() = static_cast<char>(kSessionKindCount);
  Result<Hello> bad = DecodeHello(bytes);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("unknown session kind"), std::string::npos);
}

TEST(AttachWire, NoticeRoundTripAndIsTellsItFromReplies) {
  const std::string bytes = EncodeNotice({NoticeKind::kLeave, "memoffloadd is draining"});
  EXPECT_TRUE(IsNotice(bytes));
  Result<Notice> n = DecodeNotice(bytes);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(n->kind, NoticeKind::kLeave);
  EXPECT_EQ(n->message, "memoffloadd is draining");
  Result<Notice> resume = DecodeNotice(EncodeNotice({NoticeKind::kResume, "restarting"}));
  ASSERT_TRUE(resume.ok()) << resume.status().ToString();
  EXPECT_EQ(resume->kind, NoticeKind::kResume);
  EXPECT_FALSE(IsNotice(EncodeChunkReply({})));
  EXPECT_FALSE(IsNotice(EncodeLinkKeyReply({})));
  EXPECT_FALSE(DecodeChunkReply(bytes).ok());
  std::string unknown = bytes;
  unknown[7] = 9;  // the kind byte, after the 7-byte header
  EXPECT_EQ(DecodeNotice(unknown).status().code(), StatusCode::kInvalidArgument);
}

TEST(AttachWire, ReplyAndBatchRoundTrip) {
  AttachReply r;
  r.session_id = 42;
  r.session_token = "00112233445566778899aabbccddeeff";
  r.grpc_socket = "/run/memoffload/memoffload.sock";
  r.page_bytes = 4096;
  r.chunks = {{0, 1 << 30}, {1, 1 << 20}};
  r.fd_frames = 1;
  r.instance_id = 0x0123456789abcdefull;
  Result<AttachReply> d = DecodeAttachReply(EncodeAttachReply(r));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->session_id, 42u);
  EXPECT_EQ(d->session_token, r.session_token);
  ASSERT_EQ(d->chunks.size(), 2u);
  EXPECT_EQ(d->chunks[1].size_bytes, 1u << 20);
  EXPECT_EQ(d->fd_frames, 1u);
  EXPECT_EQ(d->instance_id, r.instance_id);

  ChunkFdBatch b{{3, 4, 5}, {1, 7, 1ull << 40}};
  Result<ChunkFdBatch> db = DecodeChunkFdBatch(EncodeChunkFdBatch(b));
  ASSERT_TRUE(db.ok());
  EXPECT_EQ(db->chunk_indexes, b.chunk_indexes);
  EXPECT_EQ(db->generations, b.generations);

  ChunkReply c;
  c.chunk_indexes = {2, 9};
  c.generations = {3, 4};
  Result<ChunkReply> dc = DecodeChunkReply(EncodeChunkReply(c));
  ASSERT_TRUE(dc.ok());
  EXPECT_EQ(dc->chunk_indexes, c.chunk_indexes);
  EXPECT_EQ(dc->generations, c.generations);
}

TEST(AttachWire, RefusalCarriesCodeAndMessage) {
  AttachReply r;
  r.code = StatusCode::kPermissionDenied;
  r.message = "uid 1234 is not allowed";
  Result<AttachReply> d = DecodeAttachReply(EncodeAttachReply(r));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->code, StatusCode::kPermissionDenied);
  EXPECT_EQ(d->message, r.message);
}

TEST(AttachWire, RejectsWrongVersionMagicTypeAndTrailingBytes) {
  Hello h;
  std::string bytes = EncodeHello(h);
  std::string wrong_version = bytes;
  wrong_version[4] = 9;
  Result<Hello> r = DecodeHello(wrong_version);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("version 9"), std::string::npos);
  std::string wrong_magic = bytes;
  wrong_magic[0] = 'X';
  EXPECT_FALSE(DecodeHello(wrong_magic).ok());
  EXPECT_FALSE(DecodeAttachReply(bytes).ok());  // a hello is not a reply
  EXPECT_FALSE(DecodeHello(bytes + "x").ok());
}

TEST(AttachWire, RejectsBadJobIdAndRanks) {
  Hello h;
  h.job_id = std::string(kMaxJobIdBytes + 1, 'a');
  EXPECT_FALSE(DecodeHello(EncodeHello(h)).ok());
  h.job_id = "bad\nid";
  EXPECT_FALSE(DecodeHello(EncodeHello(h)).ok());
  h.job_id = "ok";
  h.rank = -5;
  EXPECT_FALSE(DecodeHello(EncodeHello(h)).ok());
}

TEST(AttachWire, EveryTruncationAndRandomBytesAreRejectedNotCrashes) {
  Hello h;
  h.job_id = "job";
  const std::string bytes = EncodeHello(h);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(DecodeHello(bytes.substr(0, n)).ok()) << n;
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    std::string junk = bytes;
    junk[rng() % junk.size()] = static_cast<char>(rng());
    if (rng() % 2) junk.resize(rng() % (junk.size() + 8), 'z');
    (void)DecodeHello(junk);
    (void)DecodeAttachReply(junk);
    (void)DecodeChunkFdBatch(junk);
    (void)DecodeLinkKeyReply(junk);
    (void)DecodeLinkKeyRequest(junk);
  }
}

// A session's request for its job's replication keys, and the reply: keys
// round-trip, a refusal keeps its code, and a chunk request is never taken
// for a key request (the broker tells them apart by type).
TEST(AttachWire, LinkKeysRoundTrip) {
  const std::string request = EncodeLinkKeyRequest({});
  EXPECT_TRUE(IsLinkKeyRequest(request));
  EXPECT_TRUE(DecodeLinkKeyRequest(request).ok());
  EXPECT_FALSE(IsLinkKeyRequest(EncodeChunkRequest({{1, 2}})));
  EXPECT_FALSE(DecodeLinkKeyRequest(EncodeChunkRequest({{1}})).ok());
  LinkKeyReply reply;
  reply.key_ids = {"2026-11", "2026-10"};
  reply.keys = {std::string(32, '\x01'), std::string(32, '\x02')};
  Result<LinkKeyReply> back = DecodeLinkKeyReply(EncodeLinkKeyReply(reply));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->key_ids, reply.key_ids);
  EXPECT_EQ(back->keys, reply.keys);
  LinkKeyReply refused;
  refused.code = StatusCode::kNotFound;
  refused.message = "no key file";
  Result<LinkKeyReply> no = DecodeLinkKeyReply(EncodeLinkKeyReply(refused));
  ASSERT_TRUE(no.ok());
  EXPECT_EQ(no->code, StatusCode::kNotFound);
  EXPECT_EQ(no->message, "no key file");
  EXPECT_TRUE(no->keys.empty());
  const std::string bytes = EncodeLinkKeyReply(reply);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(DecodeLinkKeyReply(bytes.substr(0, n)).ok()) << n;
  }
}

}  // namespace
}  // namespace memoffload
