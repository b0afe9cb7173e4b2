// Framed messages with file descriptors over a Unix stream socket.
//
// A frame is a 4-byte little-endian payload length followed by the payload.
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
inline constexpr size_t kMaxFrameBytes = 1 << 20;

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
