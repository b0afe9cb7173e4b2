#include "memoffload/shared_mem/fd_passing.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace memoffload {
namespace {

constexpr int kSendTimeoutMs = 5000;

// Receives exactly `len` bytes into buf, collecting any SCM_RIGHTS fds.
Status RecvExact(int sock, char* buf, size_t len, std::vector<int>* fds) {
  size_t got = 0;
  while (got < len) {
    iovec iov{buf + got, len - got};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 253)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("recvmsg", errno);
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const int* in = reinterpret_cast<const int*>(CMSG_DATA(c));
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, in + i, sizeof(int));
          fds->push_back(fd);
        }
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) {
      return Internal("file descriptors were truncated in transit");
    }
    if (n == 0) return Unavailable("connection closed by peer");
    got += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

std::string EncodeFrameHeader(uint32_t payload_bytes) {
  std::string header(kFrameHeaderBytes, '\0');
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    header[i] = static_cast<char>((payload_bytes >> (8 * i)) & 0xff);
  }
  return header;
}

uint32_t DecodeFrameHeader(const unsigned char* header) {
  uint32_t len = 0;
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) len |= static_cast<uint32_t>(header[i]) << (8 * i);
  return len;
}

Status SendFrame(int sock, const std::string& payload, const std::vector<int>& fds) {
  if (payload.size() > kMaxFrameBytes) {
    return InvalidArgument("frame of " + std::to_string(payload.size()) +
                           " bytes exceeds the limit of " + std::to_string(kMaxFrameBytes));
  }
  if (fds.size() > kMaxFdsPerFrame) {
    return InvalidArgument("frame carries " + std::to_string(fds.size()) + " fds, limit " +
                           std::to_string(kMaxFdsPerFrame));
  }
  std::string frame = EncodeFrameHeader(static_cast<uint32_t>(payload.size())) + payload;

  size_t sent = 0;
  bool fds_sent = fds.empty();
  while (sent < frame.size()) {
    iovec iov{frame.data() + sent, frame.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
    if (!fds_sent) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // Non-blocking socket with a full buffer: wait a bounded time.
        pollfd p{sock, POLLOUT, 0};
        if (poll(&p, 1, kSendTimeoutMs) > 0) continue;
        return Unavailable("peer does not read; send timed out");
      }
      return ErrnoStatus("sendmsg", errno);
    }
    fds_sent = true;
    sent += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status RecvFrame(int sock, std::string* payload, std::vector<int>* fds) {
  unsigned char header[kFrameHeaderBytes];
  MEMOFFLOAD_RETURN_IF_ERROR(
      RecvExact(sock, reinterpret_cast<char*>(header), kFrameHeaderBytes, fds));
  const uint32_t len = DecodeFrameHeader(header);
  if (len > kMaxFrameBytes) {
    return InvalidArgument("frame of " + std::to_string(len) + " bytes exceeds the limit of " +
                           std::to_string(kMaxFrameBytes));
  }
  payload->assign(len, '\0');
  return RecvExact(sock, payload->data(), len, fds);
}

void CloseFds(std::vector<int>* fds) {
  for (int fd : *fds) close(fd);
  fds->clear();
}

}  // namespace memoffload
