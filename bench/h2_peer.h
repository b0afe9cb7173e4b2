// H2Peer: a raw HTTP/2 client on the daemon's gRPC socket that sends any
// frames it is told to, well-formed or not: the hostile local peer of
// issue 29 item 3, for the edge benchmark (`memoffload-bench edge`) and the
// integration tests. Not a gRPC client: it never waits for answers, and
// drops whatever the daemon sends.
#ifndef MEMOFFLOAD_BENCH_H2_PEER_H_
#define MEMOFFLOAD_BENCH_H2_PEER_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "memoffload/common/status.h"

namespace memoffload::bench {

class H2Peer {
 public:
  // Connects to `socket_path` and sends the client preface and SETTINGS.
  static Result<std::unique_ptr<H2Peer>> Connect(const std::string& socket_path);
  ~H2Peer();
  H2Peer(const H2Peer&) = delete;
  H2Peer& operator=(const H2Peer&) = delete;

  // Sends all of `bytes`, reading and dropping what the daemon sends while
  // the socket is full. False when the daemon closed the connection, or
  // nothing could be sent for timeout_ms.
  bool Send(std::string_view bytes, int timeout_ms = 5000);
  // Reads and drops what arrived; false once the daemon closed the
  // connection.
  bool Alive();
  // Waits up to timeout_ms for the daemon to close the connection.
  bool WaitClosed(int timeout_ms);
  // The next client stream id (1, 3, 5, ...).
  uint32_t NextStream();

  // One frame (RFC 9113 section 4.1).
  static std::string Frame(uint8_t type, uint8_t flags, uint32_t stream, std::string_view payload);
  // An HPACK block (literals, no Huffman) of a gRPC request to `path`.
  static std::string RequestHeaders(std::string_view path);
  // HPACK integer with an N-bit prefix (RFC 7541 section 5.1).
  static void HpackInt(std::string* out, uint8_t first_bits, int prefix_bits, uint64_t value);

 private:
  explicit H2Peer(int fd) : fd_(fd) {}
  int fd_;
  uint32_t next_stream_ = 1;
  bool closed_ = false;
};

// What one attack did.
struct AttackResult {
  uint64_t bytes_sent = 0;
  uint64_t frames_sent = 0;
  bool closed_by_daemon = false;  // the daemon closed an attacking connection
  double seconds = 0;             // from the first byte to the close (or the end)
  std::string error;              // set when the attack could not run
};

// HEADERS + RST_STREAM pairs, `pairs` of them, in writes of 1,000.
AttackResult RapidReset(const std::string& socket_path, uint64_t pairs);
// A header block never finished: HEADERS, then CONTINUATION frames of 16 KiB
// until `bytes` were sent.
AttackResult ContinuationFlood(const std::string& socket_path, uint64_t bytes);
// On each of `connections`: HEADERS announcing a header value of 1 GiB,
// then CONTINUATION frames of 4 KiB every 10 ms for `seconds`.
AttackResult TrickledHeader(const std::string& socket_path, int connections, double seconds);

// Runs `attack` in a child process that first becomes `uid` (no
// supplementary groups; the caller must be root unless uid is its own) and
// returns what it reported.
AttackResult RunAsUid(uid_t uid, const std::function<AttackResult()>& attack);

}  // namespace memoffload::bench

#endif  // MEMOFFLOAD_BENCH_H2_PEER_H_
