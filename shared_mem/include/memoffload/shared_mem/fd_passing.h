// Framed messages with file descriptors over a Unix stream socket.
//
// A frame is a 4-byte little-endian payload length (the frame header)
// followed by the payload, at most kMaxFrameBytes: the broker's wire format,
// sent and read here by the client and by the daemon's asynchronous broker
// with EncodeFrameHeader / DecodeFrameHeader; both refuse a longer frame.
// File descriptors travel as SCM_RIGHTS ancillary data with the frame's first
// byte, at most kMaxFdsPerFrame per frame (the kernel's SCM_MAX_FD is 253).
// Received fds are close-on-exec and owned by the caller.
#ifndef MEMOFFLOAD_SHARED_MEM_FD_PASSING_H_
#define MEMOFFLOAD_SHARED_MEM_FD_PASSING_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload {

inline constexpr size_t kMaxFdsPerFrame = 240;
// The largest payload either side sends or accepts. An attach reply lists
// up to 65536 chunks (attach_wire.cc's kMaxChunks, 12 bytes each), so it
// needs more than the other frames (a hello, a chunk request of at most
// kMaxFdsPerFrame chunks: about a KiB).
inline constexpr size_t kMaxFrameBytes = 1 << 20;
// The largest frame a client may send the daemon (a hello, a chunk
// request): the daemon refuses a longer one from its header, before it
// holds any of it, so an unanswered connection costs it at most this.
inline constexpr size_t kMaxRequestFrameBytes = 64 * 1024;
inline constexpr size_t kFrameHeaderBytes = 4;

// The header of a frame of `payload_bytes` (<= kMaxFrameBytes).
std::string EncodeFrameHeader(uint32_t payload_bytes);
// The payload length a header gives (not yet checked against the limit).
uint32_t DecodeFrameHeader(const unsigned char* header);

// Writes one frame on a blocking socket (retries on EINTR and short writes).
// Fails with INVALID_ARGUMENT when payload or fd count exceed the limits.
Status SendFrame(int sock, const std::string& payload, const std::vector<int>& fds = {});

// Reads one frame on a blocking socket. Fds that arrive with it are appended
// to *fds (the caller closes them). UNAVAILABLE when the peer closed the
// connection before a full frame; INVALID_ARGUMENT for a frame over the limit.
Status RecvFrame(int sock, std::string* payload, std::vector<int>* fds);

// Closes every fd in the vector and clears it.
void CloseFds(std::vector<int>* fds);

}  // namespace memoffload

#endif  // MEMOFFLOAD_SHARED_MEM_FD_PASSING_H_
