// H2Guard: the HTTP/2 rules of the gRPC edge, fed bytes as a client would
// send them, split at every point; and a random property test that whole
// frames are all that is ever forwarded.
#include "edge/h2_guard.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>

namespace memoffload::daemon {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr std::string_view kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr uint8_t kData = 0x0, kHeaders = 0x1, kRst = 0x3, kSettings = 0x4, kPing = 0x6,
                  kContinuation = 0x9;
constexpr uint8_t kEndStream = 0x1, kEndHeaders = 0x4;

std::string Frame(uint8_t type, uint8_t flags, uint32_t stream, size_t length) {
  std::string f;
  f.push_back(static_cast<char>(length >> 16));
  f.push_back(static_cast<char>(length >> 8));
  f.push_back(static_cast<char>(length));
  f.push_back(static_cast<char>(type));
  f.push_back(static_cast<char>(flags));
  f.push_back(static_cast<char>(stream >> 24));
  f.push_back(static_cast<char>(stream >> 16));
  f.push_back(static_cast<char>(stream >> 8));
  f.push_back(static_cast<char>(stream));
  f.append(length, 'x');
  return f;
}

struct Fixture {
  H2Limits limits;
  std::shared_ptr<H2Budget> budget;
  Clock::time_point now = Clock::now();
  std::unique_ptr<H2Guard> guard;
  explicit Fixture(H2Limits l = {}) : limits(l) {
    budget = std::make_shared<H2Budget>(limits, now);
    guard = std::make_unique<H2Guard>(limits, budget, now);
  }
  H2Violation Feed(const std::string& bytes) { return guard->ClientBytes(bytes, now); }
};

TEST(H2Guard, AUnaryCallPassesWholeAndOnlyWholeFrames) {
  Fixture f;
  std::string call = std::string(kPreface) + Frame(kSettings, 0, 0, 6) +
                     Frame(kHeaders, kEndHeaders, 1, 120) + Frame(kData, kEndStream, 1, 40);
  // Fed one byte at a time: forwardable bytes only ever end a frame.
  uint64_t last = 0;
  for (size_t i = 0; i < call.size(); ++i) {
    ASSERT_EQ(f.Feed(call.substr(i, 1)), H2Violation::kNone);
    const uint64_t fw = f.guard->ForwardableBytes();
    ASSERT_GE(fw, last);
    if (fw != last) {
      // Frame ends: the preface, then each of the three frames.
      const size_t preface = kPreface.size();
      const size_t ends[] = {preface, preface + 15, preface + 15 + 129, call.size()};
      EXPECT_NE(std::find(std::begin(ends), std::end(ends), fw), std::end(ends)) << fw;
    }
    last = fw;
  }
  EXPECT_EQ(last, call.size());
  // Sent, not yet answered: live, no longer open.
  EXPECT_EQ(f.guard->live_streams(), 1u);
  EXPECT_EQ(f.budget->open_streams, 0u);
  f.guard->ServerBytes(Frame(kHeaders, kEndHeaders | kEndStream, 1, 10));
  EXPECT_EQ(f.guard->live_streams(), 0u);
  EXPECT_EQ(f.budget->live_streams, 0u);
}

TEST(H2Guard, NotAPrefaceIsRefused) {
  Fixture f;
  EXPECT_EQ(f.Feed("GET / HTTP/1.1\r\n\r\n"), H2Violation::kPreface);
  EXPECT_EQ(f.guard->ForwardableBytes(), 0u);
}

TEST(H2Guard, AFrameOverTheMaxFrameSizeIsRefusedBeforeItPasses) {
  Fixture f;
  ASSERT_EQ(f.Feed(std::string(kPreface)), H2Violation::kNone);
  const uint64_t before = f.guard->ForwardableBytes();
  EXPECT_EQ(f.Feed(Frame(kData, 0, 1, f.limits.max_frame_bytes + 1).substr(0, 9)),
            H2Violation::kFrameSize);
  EXPECT_EQ(f.guard->ForwardableBytes(), before);
}

TEST(H2Guard, ContinuationFloodIsCutAtTheHeaderBlockLimit) {
  Fixture f;
  ASSERT_EQ(f.Feed(std::string(kPreface) + Frame(kHeaders, 0, 1, 100)), H2Violation::kNone);
  H2Violation v = H2Violation::kNone;
  int frames = 1;
  while (v == H2Violation::kNone && frames < 1000) {
    v = f.Feed(Frame(kContinuation, 0, 1, 4096));
    ++frames;
  }
  EXPECT_EQ(v, H2Violation::kHeaderBlock);
  EXPECT_LE(frames, f.limits.max_header_block_frames + 1);
  EXPECT_NE(f.guard->Message().find("header block"), std::string::npos) << f.guard->Message();
}

TEST(H2Guard, AFinishedHeaderBlockWithinLimitsPasses) {
  Fixture f;
  ASSERT_EQ(
      f.Feed(std::string(kPreface) + Frame(kHeaders, 0, 1, 100) + Frame(kContinuation, 0, 1, 100) +
             Frame(kContinuation, kEndHeaders, 1, 100) + Frame(kData, kEndStream, 1, 5)),
      H2Violation::kNone);
  EXPECT_EQ(f.budget->open_streams, 0u);
  EXPECT_EQ(f.guard->live_streams(), 1u);
}

TEST(H2Guard, AFrameInsideAnOpenHeaderBlockIsRefused) {
  Fixture f;
  ASSERT_EQ(f.Feed(std::string(kPreface) + Frame(kHeaders, 0, 1, 100)), H2Violation::kNone);
  EXPECT_EQ(f.Feed(Frame(kHeaders, kEndHeaders, 3, 10)), H2Violation::kHeaderBlock);
}

TEST(H2Guard, ATrickledHeaderBlockExpires) {
  Fixture f;
  ASSERT_EQ(f.Feed(std::string(kPreface) + Frame(kHeaders, 0, 1, 100)), H2Violation::kNone);
  EXPECT_EQ(f.guard->Expired(f.now + f.limits.header_block_deadline / 2), H2Violation::kNone);
  EXPECT_EQ(f.guard->Expired(f.now + f.limits.header_block_deadline + milliseconds(1)),
            H2Violation::kSlow);
}

TEST(H2Guard, AFrameFedSlowerThanTheDeadlineExpires) {
  Fixture f;
  ASSERT_EQ(f.Feed(std::string(kPreface) + Frame(kData, 0, 1, 100).substr(0, 50)),
            H2Violation::kNone);
  EXPECT_EQ(f.guard->Expired(f.now + f.limits.header_block_deadline + milliseconds(1)),
            H2Violation::kSlow);
}

TEST(H2Guard, AnIdleConnectionBetweenFramesNeverExpires) {
  Fixture f;
  ASSERT_EQ(f.Feed(std::string(kPreface) + Frame(kSettings, 0, 0, 0)), H2Violation::kNone);
  EXPECT_EQ(f.guard->Expired(f.now + std::chrono::hours(1)), H2Violation::kNone);
}

TEST(H2Guard, RapidResetIsCutAfterTheBurstAndTheRateRefills) {
  H2Limits limits;
  limits.reset_burst = 10;
  limits.resets_per_second = 5;
  Fixture f(limits);
  ASSERT_EQ(f.Feed(std::string(kPreface)), H2Violation::kNone);
  uint32_t id = 1;
  auto pair = [&](Clock::time_point at) {
    std::string b = Frame(kHeaders, kEndHeaders, id, 20) + Frame(kRst, 0, id, 4);
    id += 2;
    return f.guard->ClientBytes(b, at);
  };
  for (int i = 0; i < 10; ++i) ASSERT_EQ(pair(f.now), H2Violation::kNone) << i;
  // One second later five more fit, the sixth does not.
  const auto later = f.now + std::chrono::seconds(1);
  for (int i = 0; i < 5; ++i) ASSERT_EQ(pair(later), H2Violation::kNone) << i;
  EXPECT_EQ(pair(later), H2Violation::kResets);
  EXPECT_EQ(f.budget->open_streams, 0u);
}

TEST(H2Guard, AUidsConnectionsShareOneResetBudget) {
  H2Limits limits;
  limits.reset_burst = 4;
  limits.resets_per_second = 0.001;
  Fixture f(limits);
  H2Guard second(limits, f.budget, f.now);
  ASSERT_EQ(f.Feed(std::string(kPreface) + Frame(kRst, 0, 1, 4) + Frame(kRst, 0, 3, 4)),
            H2Violation::kNone);
  ASSERT_EQ(second.ClientBytes(std::string(kPreface) + Frame(kRst, 0, 1, 4) + Frame(kRst, 0, 3, 4),
                               f.now),
            H2Violation::kNone);
  EXPECT_EQ(second.ClientBytes(Frame(kRst, 0, 5, 4), f.now), H2Violation::kResets);
}

TEST(H2Guard, SettingsAndPingsTheClientNeverLetsGrpcAnswerAreBounded) {
  H2Limits limits;
  limits.max_unanswered_controls = 8;
  Fixture f(limits);
  ASSERT_EQ(f.Feed(std::string(kPreface)), H2Violation::kNone);
  // ACKs from the client are free; answered PINGs are too.
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(f.Feed(Frame(kSettings, 0x1, 0, 0) + Frame(kPing, 0, 0, 8)), H2Violation::kNone);
    f.guard->ServerBytes(Frame(kPing, 0x1, 0, 8));
  }
  for (int i = 0; i < 8; ++i) ASSERT_EQ(f.Feed(Frame(kPing, 0, 0, 8)), H2Violation::kNone);
  EXPECT_EQ(f.Feed(Frame(kSettings, 0, 0, 0)), H2Violation::kControl);
  EXPECT_NE(f.guard->Message().find("not answered"), std::string::npos) << f.guard->Message();
}

TEST(H2Guard, StreamsLeftOpenAreBoundedPerUidAndGivenBackWhenAConnectionGoes) {
  H2Limits limits;
  limits.max_open_streams = 5;
  Fixture f(limits);
  ASSERT_EQ(f.Feed(std::string(kPreface)), H2Violation::kNone);
  for (uint32_t id = 1; id <= 9; id += 2) {
    ASSERT_EQ(f.Feed(Frame(kHeaders, kEndHeaders, id, 20)), H2Violation::kNone);
  }
  EXPECT_EQ(f.budget->open_streams, 5u);
  {
    H2Guard other(limits, f.budget, f.now);
    EXPECT_EQ(other.ClientBytes(std::string(kPreface) + Frame(kHeaders, kEndHeaders, 1, 20), f.now),
              H2Violation::kStreams);
  }
  // The server ending a stream (trailers) frees its place.
  f.guard->ServerBytes(Frame(kHeaders, kEndHeaders | kEndStream, 3, 10));
  EXPECT_EQ(f.budget->open_streams, 4u);
  f.guard.reset();
  EXPECT_EQ(f.budget->open_streams, 0u);
}

// A peer that never reads its replies keeps its calls alive inside gRPC:
// their number is bounded per uid, and trailers or a reset free a place.
TEST(H2Guard, CallsGrpcHasNotAnsweredAreBoundedPerUid) {
  H2Limits limits;
  limits.max_live_streams = 3;
  Fixture f(limits);
  ASSERT_EQ(f.Feed(std::string(kPreface)), H2Violation::kNone);
  for (uint32_t id = 1; id <= 5; id += 2) {
    ASSERT_EQ(f.Feed(Frame(kHeaders, kEndHeaders | kEndStream, id, 20)), H2Violation::kNone);
  }
  EXPECT_EQ(f.budget->open_streams, 0u);
  EXPECT_EQ(f.budget->live_streams, 3u);
  f.guard->ServerBytes(Frame(kRst, 0, 3, 4));
  ASSERT_EQ(f.Feed(Frame(kHeaders, kEndHeaders | kEndStream, 7, 20)), H2Violation::kNone);
  EXPECT_EQ(f.Feed(Frame(kHeaders, kEndHeaders | kEndStream, 9, 20)), H2Violation::kStreams);
  EXPECT_NE(f.guard->Message().find("not answered"), std::string::npos) << f.guard->Message();
}

TEST(H2Guard, FramesOnAStreamGrpcEndedOpenNothing) {
  Fixture f;
  ASSERT_EQ(f.Feed(std::string(kPreface) + Frame(kHeaders, kEndHeaders | kEndStream, 5, 20)),
            H2Violation::kNone);
  f.guard->ServerBytes(Frame(kHeaders, kEndHeaders | kEndStream, 5, 10));
  ASSERT_EQ(f.Feed(Frame(kHeaders, kEndHeaders, 5, 20) + Frame(kHeaders, kEndHeaders, 3, 20)),
            H2Violation::kNone);
  EXPECT_EQ(f.budget->live_streams, 0u);
  EXPECT_EQ(f.budget->open_streams, 0u);
}

TEST(H2Guard, DataOnUnfinishedStreamsIsBoundedPerUid) {
  H2Limits limits;
  limits.max_pending_data_bytes = 3 * 16384;
  Fixture f(limits);
  ASSERT_EQ(f.Feed(std::string(kPreface) + Frame(kHeaders, kEndHeaders, 1, 20)),
            H2Violation::kNone);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(f.Feed(Frame(kData, 0, 1, 16384)), H2Violation::kNone);
  EXPECT_EQ(f.Feed(Frame(kData, 0, 1, 1)), H2Violation::kStreams);
}

// Random frames cut at random points: ForwardableBytes never ends inside a
// frame, and the stream counts match a reference.
TEST(H2Guard, RandomSplitsForwardOnlyFrameBoundaries) {
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    H2Limits limits;
    limits.reset_burst = 1e9;
    limits.max_unanswered_controls = 1000;
    Fixture f(limits);
    std::string bytes(kPreface);
    std::vector<uint64_t> ends = {0, bytes.size()};
    uint32_t id = 1;
    for (int i = 0; i < 30; ++i) {
      const int kind = static_cast<int>(rng() % 4);
      std::string frame;
      if (kind == 0) frame = Frame(kHeaders, kEndHeaders, id, rng() % 200);
      if (kind == 1) frame = Frame(kData, kEndStream, id, rng() % 3000), id += 2;
      if (kind == 2) frame = Frame(kSettings, 0, 0, 6 * (rng() % 3));
      if (kind == 3) frame = Frame(kRst, 0, id, 4), id += 2;
      bytes += frame;
      ends.push_back(bytes.size());
    }
    size_t at = 0;
    while (at < bytes.size()) {
      const size_t n = std::min<size_t>(bytes.size() - at, 1 + rng() % 700);
      ASSERT_EQ(f.Feed(bytes.substr(at, n)), H2Violation::kNone);
      at += n;
      const uint64_t fw = f.guard->ForwardableBytes();
      ASSERT_TRUE(std::binary_search(ends.begin(), ends.end(), fw)) << fw;
      ASSERT_LE(fw, at);
    }
    EXPECT_EQ(f.guard->ForwardableBytes(), bytes.size());
    EXPECT_EQ(f.budget->live_streams, f.guard->live_streams());
    EXPECT_LE(f.budget->open_streams, f.budget->live_streams);
  }
}

}  // namespace
}  // namespace memoffload::daemon
