// RawAttach: an attach over the broker socket by hand, for tests that need
// what the client library keeps to itself (the session's token, so that
// they can make gRPC calls of their own: forged, or cancelled mid-wait).
#ifndef MEMOFFLOAD_TESTS_INTEGRATION_RAW_ATTACH_H_
#define MEMOFFLOAD_TESTS_INTEGRATION_RAW_ATTACH_H_

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "memoffload/common/runtime_dir.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/fd_passing.h"

namespace memoffload::testing {

// Attaches to the daemon of `dir` as job `job_id`; returns the reply (with
// this session's token) and keeps the connection, the session's lifeline,
// in *fd (the caller closes it; -1 when the connect failed). The chunk fds
// the daemon sends are closed.
inline Result<AttachReply> RawAttach(const std::string& dir, const std::string& job_id, int* fd) {
  *fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = BrokerSocketPath(dir);
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (*fd < 0 || connect(*fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus("connect " + path, errno);
  }
  Hello hello;
  hello.job_id = job_id;
  if (Status st = SendFrame(*fd, EncodeHello(hello)); !st.ok()) return st;
  std::string payload;
  std::vector<int> fds;
  if (Status st = RecvFrame(*fd, &payload, &fds); !st.ok()) return st;
  CloseFds(&fds);
  Result<AttachReply> reply = DecodeAttachReply(payload);
  if (!reply.ok()) return reply.status();
  if (reply->code != StatusCode::kOk)
    return Status(reply->code, "attach refused: " + reply->message);
  for (uint32_t i = 0; i < reply->fd_frames; ++i) {
    if (Status st = RecvFrame(*fd, &payload, &fds); !st.ok()) return st;
    CloseFds(&fds);
  }
  return reply;
}

}  // namespace memoffload::testing

#endif  // MEMOFFLOAD_TESTS_INTEGRATION_RAW_ATTACH_H_
