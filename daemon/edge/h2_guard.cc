#include "edge/h2_guard.h"

#include <algorithm>
#include <cstring>

namespace memoffload::daemon {

namespace {

constexpr std::string_view kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

// RFC 9113 frame types and flags.
constexpr uint8_t kData = 0x0;
constexpr uint8_t kHeaders = 0x1;
constexpr uint8_t kRstStream = 0x3;
constexpr uint8_t kSettings = 0x4;
constexpr uint8_t kPing = 0x6;
constexpr uint8_t kContinuation = 0x9;
constexpr uint8_t kEndStream = 0x1;
constexpr uint8_t kEndHeaders = 0x4;
constexpr uint8_t kAck = 0x1;

uint32_t Length(const uint8_t* h) { return (uint32_t{h[0]} << 16) | (uint32_t{h[1]} << 8) | h[2]; }
uint32_t StreamId(const uint8_t* h) {
  return ((uint32_t{h[5]} << 24) | (uint32_t{h[6]} << 16) | (uint32_t{h[7]} << 8) | h[8]) &
         0x7fffffffu;
}

}  // namespace

const char* H2ViolationName(H2Violation v) {
  switch (v) {
    case H2Violation::kNone:
      return "none";
    case H2Violation::kPreface:
      return "preface";
    case H2Violation::kFrameSize:
      return "frame_size";
    case H2Violation::kHeaderBlock:
      return "header_block";
    case H2Violation::kSlow:
      return "slow";
    case H2Violation::kResets:
      return "resets";
    case H2Violation::kControl:
      return "control_frames";
    case H2Violation::kStreams:
      return "streams";
  }
  return "unknown";
}

bool TokenBucket::Take(double burst, double per_second, std::chrono::steady_clock::time_point now) {
  const double seconds = std::chrono::duration<double>(now - last).count();
  if (seconds > 0) {
    tokens = std::min(burst, tokens + seconds * per_second);
    last = now;
  }
  if (tokens < 1) return false;
  tokens -= 1;
  return true;
}

H2Guard::H2Guard(const H2Limits& limits, std::shared_ptr<H2Budget> budget, Clock::time_point now)
    : limits_(limits), frame_started_(now), budget_(std::move(budget)) {}

H2Guard::~H2Guard() {
  for (auto& [id, stream] : streams_) {
    ClientDone(stream);
    --budget_->live_streams;
  }
}

H2Violation H2Guard::Fail(H2Violation v, std::string message) {
  if (violation_ == H2Violation::kNone) {
    violation_ = v;
    message_ = std::move(message);
  }
  return violation_;
}

H2Violation H2Guard::ClientBytes(std::string_view bytes, Clock::time_point now) {
  if (violation_ != H2Violation::kNone) return violation_;
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t n = bytes.size();
  while (n > 0 && preface_have_ < kPreface.size()) {
    const size_t take = std::min(n, kPreface.size() - preface_have_);
    if (std::memcmp(p, kPreface.data() + preface_have_, take) != 0) {
      return Fail(H2Violation::kPreface, "the connection did not open with the HTTP/2 preface");
    }
    preface_have_ += take;
    fed_ += take;
    p += take;
    n -= take;
    if (preface_have_ == kPreface.size()) forwardable_ = fed_;
  }
  while (n > 0) {
    FrameCursor& c = client_;
    if (c.header_have == 0 && c.payload_left == 0) frame_started_ = now;
    if (c.header_have < sizeof(c.header)) {
      const size_t take = std::min(n, sizeof(c.header) - c.header_have);
      std::memcpy(c.header + c.header_have, p, take);
      c.header_have += take;
      fed_ += take;
      p += take;
      n -= take;
      if (c.header_have < sizeof(c.header)) break;
      c.payload_left = Length(c.header);
      if (H2Violation v = OnClientFrame(c.header, now); v != H2Violation::kNone) return v;
    }
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, c.payload_left));
    c.payload_left -= take;
    fed_ += take;
    p += take;
    n -= take;
    if (c.payload_left == 0) {
      c.header_have = 0;
      forwardable_ = fed_;
    }
  }
  return H2Violation::kNone;
}

H2Violation H2Guard::OnClientFrame(const uint8_t* h, Clock::time_point now) {
  const uint32_t length = Length(h);
  const uint8_t type = h[3];
  const uint8_t flags = h[4];
  const uint32_t stream = StreamId(h);
  if (length > limits_.max_frame_bytes) {
    return Fail(H2Violation::kFrameSize, "a frame of " + std::to_string(length) +
                                             " bytes (at most " +
                                             std::to_string(limits_.max_frame_bytes) + ")");
  }
  if (block_stream_ != 0 && (type != kContinuation || stream != block_stream_)) {
    return Fail(H2Violation::kHeaderBlock, "a frame inside an unfinished header block");
  }
  switch (type) {
    case kHeaders:
      return OnClientHeaders(stream, length, flags, now);
    case kContinuation:
      return OnClientContinuation(stream, length, flags);
    case kData:
      return OnClientData(stream, length, flags);
    case kRstStream:
      EndStream(stream);
      if (!budget_->resets.Take(limits_.reset_burst, limits_.resets_per_second, now)) {
        return Fail(H2Violation::kResets, "RST_STREAM faster than " +
                                              std::to_string(int(limits_.resets_per_second)) +
                                              " per second (HTTP/2 rapid reset)");
      }
      break;
    case kSettings:
    case kPing:
      if ((flags & kAck) == 0 && ++unanswered_controls_ > limits_.max_unanswered_controls) {
        return Fail(H2Violation::kControl,
                    "more than " + std::to_string(limits_.max_unanswered_controls) +
                        " SETTINGS or PING frames not answered yet (their ACKs not read)");
      }
      break;
    default:
      break;
  }
  return H2Violation::kNone;
}

H2Violation H2Guard::OnClientHeaders(uint32_t stream, uint32_t length, uint8_t flags,
                                     Clock::time_point now) {
  if (stream == 0) return Fail(H2Violation::kHeaderBlock, "HEADERS on stream 0");
  block_bytes_ = length;
  block_frames_ = 1;
  block_started_ = now;
  if ((flags & kEndHeaders) == 0) block_stream_ = stream;
  const bool ends = (flags & kEndStream) != 0;
  if (auto it = streams_.find(stream); it != streams_.end()) {
    if (ends) ClientDone(it->second);  // the client's trailers
    return H2Violation::kNone;
  }
  // Not a new stream (ids only grow): frames on a stream gRPC ended.
  if (stream <= last_stream_) return H2Violation::kNone;
  last_stream_ = stream;
  if (budget_->live_streams >= limits_.max_live_streams) {
    return Fail(H2Violation::kStreams, "more than " + std::to_string(limits_.max_live_streams) +
                                           " calls of this uid not answered yet");
  }
  if (!ends && budget_->open_streams >= limits_.max_open_streams) {
    return Fail(H2Violation::kStreams, "more than " + std::to_string(limits_.max_open_streams) +
                                           " streams of this uid opened and not finished");
  }
  streams_[stream].client_open = !ends;
  ++budget_->live_streams;
  if (!ends) ++budget_->open_streams;
  return H2Violation::kNone;
}

H2Violation H2Guard::OnClientContinuation(uint32_t stream, uint32_t length, uint8_t flags) {
  if (block_stream_ == 0 || stream != block_stream_) {
    return Fail(H2Violation::kHeaderBlock, "CONTINUATION without an open header block");
  }
  block_bytes_ += length;
  ++block_frames_;
  if (block_bytes_ > limits_.max_header_block_bytes ||
      block_frames_ > limits_.max_header_block_frames) {
    return Fail(H2Violation::kHeaderBlock,
                "a header block over " + std::to_string(limits_.max_header_block_bytes) +
                    " bytes or " + std::to_string(limits_.max_header_block_frames) + " frames");
  }
  if ((flags & kEndHeaders) != 0) block_stream_ = 0;
  return H2Violation::kNone;
}

H2Violation H2Guard::OnClientData(uint32_t stream, uint32_t length, uint8_t flags) {
  if (auto it = streams_.find(stream); it != streams_.end() && it->second.client_open) {
    it->second.data_bytes += length;
    budget_->pending_data_bytes += length;
    if (budget_->pending_data_bytes > limits_.max_pending_data_bytes) {
      return Fail(H2Violation::kStreams, "more than " +
                                             std::to_string(limits_.max_pending_data_bytes) +
                                             " bytes of DATA on unfinished streams of this uid");
    }
    if ((flags & kEndStream) != 0) ClientDone(it->second);
  }
  return H2Violation::kNone;
}

void H2Guard::ClientDone(Stream& s) {
  if (!s.client_open) return;
  s.client_open = false;
  budget_->pending_data_bytes -= s.data_bytes;
  s.data_bytes = 0;
  --budget_->open_streams;
}

void H2Guard::EndStream(uint32_t stream) {
  auto it = streams_.find(stream);
  if (it == streams_.end()) return;
  ClientDone(it->second);
  --budget_->live_streams;
  streams_.erase(it);
}

void H2Guard::ServerBytes(std::string_view bytes) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t n = bytes.size();
  while (n > 0) {
    FrameCursor& c = server_;
    if (c.header_have < sizeof(c.header)) {
      const size_t take = std::min(n, sizeof(c.header) - c.header_have);
      std::memcpy(c.header + c.header_have, p, take);
      c.header_have += take;
      p += take;
      n -= take;
      if (c.header_have < sizeof(c.header)) break;
      c.payload_left = Length(c.header);
      OnServerFrame(c.header);
    }
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, c.payload_left));
    c.payload_left -= take;
    p += take;
    n -= take;
    if (c.payload_left == 0) c.header_have = 0;
  }
}

void H2Guard::OnServerFrame(const uint8_t* h) {
  const uint8_t type = h[3];
  // The server ended the stream (trailers or a reset): the client will
  // send nothing more on it that counts.
  if (type == kRstStream || (type == kHeaders && (h[4] & kEndStream) != 0)) {
    EndStream(StreamId(h));
  } else if ((type == kSettings || type == kPing) && (h[4] & kAck) != 0 &&
             unanswered_controls_ > 0) {
    --unanswered_controls_;
  }
}

H2Violation H2Guard::Expired(Clock::time_point now) {
  if (violation_ != H2Violation::kNone) return violation_;
  const auto limit = limits_.header_block_deadline;
  if (block_stream_ != 0 && now - block_started_ > limit) {
    return Fail(H2Violation::kSlow,
                "a header block not finished within " + std::to_string(limit.count()) + " ms");
  }
  const bool partial = client_.header_have > 0 || preface_have_ < kPreface.size();
  if (partial && fed_ > 0 && now - frame_started_ > limit) {
    return Fail(H2Violation::kSlow,
                "a frame not finished within " + std::to_string(limit.count()) + " ms");
  }
  return H2Violation::kNone;
}

}  // namespace memoffload::daemon
