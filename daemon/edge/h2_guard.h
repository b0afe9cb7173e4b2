// H2Guard: the HTTP/2 rules one gRPC connection must keep, checked on the
// bytes a client sends before gRPC sees them (gRPC 1.51, Debian 12's, has no
// defence of its own against these; see docs/request_path.md, "The gRPC
// edge"). A model part: no socket, no thread, no clock of its own; the edge
// relay (edge_relay.h) feeds it bytes and the time.
//
// What it bounds, per connection:
//  - frames: at most max_frame_bytes of payload (what gRPC advertises);
//  - header blocks (HEADERS + CONTINUATION): at most max_header_block_bytes
//    and max_header_block_frames frames, finished within
//    header_block_deadline of their first frame (the CONTINUATION flood and
//    the trickled header);
//  - a frame begun must end within header_block_deadline too (a frame fed a
//    byte at a time);
//  - SETTINGS and PING from the client that gRPC has not answered yet (its
//    ACKs are seen going back): at most max_unanswered_controls (each ACK a
//    client never reads stays queued inside gRPC);
// and, across all connections of one uid (an H2Budget they share, so that
// more connections buy an attacker nothing):
//  - RST_STREAM from the client: a token bucket (rapid reset);
//  - streams the client has opened and not finished sending (all our calls
//    are unary or server-streaming): at most max_open_streams, holding at
//    most max_pending_data_bytes of DATA between them;
//  - streams gRPC has not ended yet (no trailers or reset seen going back):
//    at most max_live_streams. A peer that never reads its replies keeps
//    every call it makes alive inside gRPC; this bounds how many.
// A connection that breaks a rule is closed: the relay drops it, which ends
// every call of it inside gRPC.
//
// Only whole frames pass: ForwardableBytes() says how much of what was fed
// may go to gRPC now; the rest is the start of a frame that has not arrived.
#ifndef MEMOFFLOAD_DAEMON_H2_GUARD_H_
#define MEMOFFLOAD_DAEMON_H2_GUARD_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

namespace memoffload::daemon {

struct H2Limits {
  size_t max_frame_bytes = 16384;
  size_t max_header_block_bytes = 16384;
  int max_header_block_frames = 4;
  std::chrono::milliseconds header_block_deadline{2000};
  size_t max_unanswered_controls = 1024;
  // Per uid. RST_STREAM: a burst, then this many per second.
  double reset_burst = 1024;
  double resets_per_second = 512;
  // Per uid.
  size_t max_open_streams = 1024;
  size_t max_live_streams = 2048;
  uint64_t max_pending_data_bytes = 16ull << 20;
};

// A token bucket: `burst` at most, refilled at `per_second`.
struct TokenBucket {
  double tokens;
  std::chrono::steady_clock::time_point last;
  bool Take(double burst, double per_second, std::chrono::steady_clock::time_point now);
};

// What every connection of one uid shares. One thread (the relay's).
struct H2Budget {
  H2Budget(const H2Limits& limits, std::chrono::steady_clock::time_point now)
      : resets{limits.reset_burst, now} {}
  size_t open_streams = 0;
  size_t live_streams = 0;
  uint64_t pending_data_bytes = 0;
  TokenBucket resets;
};

// Why a connection was closed, for logs and the
// memoffload_edge_connections_closed_total{reason} counter.
enum class H2Violation {
  kNone = 0,
  kPreface,      // not an HTTP/2 client preface
  kFrameSize,    // a frame over max_frame_bytes
  kHeaderBlock,  // a header block too large, too many frames, or interleaved
  kSlow,         // a header block or frame not finished in time
  kResets,       // RST_STREAM over its rate
  kControl,      // too many SETTINGS/PING not answered yet
  kStreams,      // too many open streams or pending DATA bytes
};
inline constexpr int kH2ViolationCount = 8;
const char* H2ViolationName(H2Violation v);

class H2Guard {
 public:
  using Clock = std::chrono::steady_clock;
  H2Guard(const H2Limits& limits, std::shared_ptr<H2Budget> budget, Clock::time_point now);
  // Gives back to the budget what this connection's streams held.
  ~H2Guard();
  H2Guard(const H2Guard&) = delete;
  H2Guard& operator=(const H2Guard&) = delete;

  // Takes the next bytes the client sent. Returns kNone while the
  // connection keeps the rules; once it returns a violation the guard stays
  // in it (Message() says what happened) and the connection must be closed.
  H2Violation ClientBytes(std::string_view bytes, Clock::time_point now);
  // Takes the next bytes gRPC sent the client: a stream the server ended
  // (trailers, RST_STREAM) no longer counts as open, and an ACK answers a
  // SETTINGS or PING.
  void ServerBytes(std::string_view bytes);
  // Checks the deadlines at `now` (the relay calls it now and then).
  H2Violation Expired(Clock::time_point now);

  // Of all client bytes fed so far, how many end whole, checked frames and
  // may be forwarded (the count only grows).
  uint64_t ForwardableBytes() const { return forwardable_; }
  H2Violation violation() const { return violation_; }
  const std::string& Message() const { return message_; }
  // Streams of this connection gRPC has not ended.
  size_t live_streams() const { return streams_.size(); }

 private:
  // Incremental frame-header reader for one direction.
  struct FrameCursor {
    uint8_t header[9];
    size_t header_have = 0;
    uint64_t payload_left = 0;
  };
  H2Violation OnClientFrame(const uint8_t* header, Clock::time_point now);
  // OnClientFrame's rules for HEADERS (stream limits), CONTINUATION (the
  // header block's limits) and DATA (unfinished streams' bytes).
  H2Violation OnClientHeaders(uint32_t stream, uint32_t length, uint8_t flags,
                              Clock::time_point now);
  H2Violation OnClientContinuation(uint32_t stream, uint32_t length, uint8_t flags);
  H2Violation OnClientData(uint32_t stream, uint32_t length, uint8_t flags);
  void OnServerFrame(const uint8_t* header);
  H2Violation Fail(H2Violation v, std::string message);
  struct Stream {
    bool client_open = false;  // the client has not sent END_STREAM
    uint64_t data_bytes = 0;   // DATA while client_open
  };
  // The client finished sending on `stream`.
  void ClientDone(Stream& s);
  // The stream is over (a reset either way, or gRPC's trailers).
  void EndStream(uint32_t stream);

  const H2Limits limits_;
  H2Violation violation_ = H2Violation::kNone;
  std::string message_;
  size_t preface_have_ = 0;
  uint64_t fed_ = 0;
  uint64_t forwardable_ = 0;
  FrameCursor client_;
  FrameCursor server_;
  // When the frame now arriving began (its first byte), if one is partial.
  Clock::time_point frame_started_;
  // The open header block, if any (stream 0 = none).
  uint32_t block_stream_ = 0;
  size_t block_bytes_ = 0;
  int block_frames_ = 0;
  Clock::time_point block_started_;
  size_t unanswered_controls_ = 0;
  std::shared_ptr<H2Budget> budget_;
  // This connection's streams gRPC has not ended (counted in budget_ too).
  std::unordered_map<uint32_t, Stream> streams_;
  uint32_t last_stream_ = 0;  // the highest stream id the client opened
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_H2_GUARD_H_
