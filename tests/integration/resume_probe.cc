// resume_probe: a session's resume over the broker by hand (attach_wire.h,
// "Resume"), for tests/python/test_takeover.py: what the client library
// does after a take-over, and what another process that learned the token
// would try.
//
//   resume_probe hold DIR         attaches (RawAttach), prints
//                                 "SESSION <id> <token>", keeps the lifeline;
//                                 each "resume" line on stdin then resumes the
//                                 session as this process and prints the answer
//   resume_probe resume DIR ID TOKEN [UID]
//                                 resumes session ID with TOKEN (as UID when
//                                 given) and prints the answer
// An answer: "ANSWER <code> <message>".
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "memoffload/common/runtime_dir.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/fd_passing.h"
#include "raw_attach.h"

namespace {

using namespace memoffload;

// Sends the Resume on a new broker connection; prints the answer. The
// connection, when resumed, is the session's lifeline: kept in *kept.
void ResumeAndPrint(const std::string& dir, uint64_t id, const std::string& token, int* kept) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = BrokerSocketPath(dir);
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::printf("ANSWER connect %s\n", std::strerror(errno));
    std::fflush(stdout);
    return;
  }
  std::string payload;
  std::vector<int> fds;
  Status st = SendFrame(fd, EncodeResume({id, token}));
  if (st.ok()) st = RecvFrame(fd, &payload, &fds);
  CloseFds(&fds);
  Result<AttachReply> reply = st.ok() ? DecodeAttachReply(payload) : Result<AttachReply>(st);
  if (!reply.ok()) {
    std::printf("ANSWER error %s\n", reply.status().ToString().c_str());
  } else {
    for (uint32_t i = 0; reply->code == StatusCode::kOk && i < reply->fd_frames; ++i) {
      if (RecvFrame(fd, &payload, &fds).ok()) CloseFds(&fds);
    }
    std::printf("ANSWER %s %s\n", StatusCodeName(reply->code), reply->message.c_str());
  }
  std::fflush(stdout);
  if (reply.ok() && reply->code == StatusCode::kOk && kept != nullptr) {
    *kept = fd;
  } else {
    close(fd);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "hold") == 0) {
    int lifeline = -1;
    Result<AttachReply> reply = testing::RawAttach(argv[2], "resume-probe", &lifeline);
    if (!reply.ok()) {
      std::printf("ERR %s\n", reply.status().ToString().c_str());
      return 1;
    }
    std::printf("SESSION %lu %s\n", static_cast<unsigned long>(reply->session_id),
                reply->session_token.c_str());
    std::fflush(stdout);
    std::vector<int> kept;
    for (std::string line; std::getline(std::cin, line);) {
      if (line != "resume") continue;
      int fd = -1;
      ResumeAndPrint(argv[2], reply->session_id, reply->session_token, &fd);
      if (fd >= 0) kept.push_back(fd);
    }
    return 0;
  }
  if ((argc == 5 || argc == 6) && std::strcmp(argv[1], "resume") == 0) {
    if (argc == 6) {
      const uid_t uid = static_cast<uid_t>(std::stoul(argv[5]));
      if (setgid(uid) != 0 || setuid(uid) != 0) {
        std::printf("ERR cannot become uid %u\n", uid);
        return 1;
      }
    }
    ResumeAndPrint(argv[2], std::stoull(argv[3]), argv[4], nullptr);
    return 0;
  }
  std::fprintf(stderr, "usage: resume_probe hold DIR | resume DIR ID TOKEN [UID]\n");
  return 2;
}
