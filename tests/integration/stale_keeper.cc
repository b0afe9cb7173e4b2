// stale_keeper: a process of an old tenant that keeps what it was handed
// after its session ended, driven by tests/integration/fresh_backing_test.cc.
//
//   stale_keeper RUNTIME_DIR UID MODE BYTES GO_FILE
//
// Drops to UID, attaches over the raw broker protocol, reserves BYTES as
// group 1, asks for the fds of the chunks it landed in and maps them
// (MAP_SHARED), fills every mapped byte with 0xA1 and releases the group, so
// the chunks are empty and may change tenant once the session ends. Then,
// by MODE, the session ends while some process keeps the mapping:
//   close       this process closes its broker connection on purpose;
//   parent-dies it forks a child (which inherits the mapping and the broker
//               connection) and exits: the daemon's pidfd watch reclaims the
//               session while the child keeps everything;
//   pass-fd     a child forked before attaching receives the chunk fds by
//               SCM_RIGHTS and maps them; this process unmaps, closes all and
//               exits.
// The keeper (this process or the child) prints "KEEPER <pid>", waits until
// GO_FILE exists, then reads what it maps and prints
// "RESULT OWN <yes|no> SAW_B <yes|no>" (OWN: every byte is still its 0xA1;
// SAW_B: some byte is 0x5B, the new tenant's pattern), overwrites everything
// with 0xEE, prints "WROTE" and sleeps until killed.
#include <grp.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "memoffload/common/runtime_dir.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/fd_passing.h"
#include "memoffload/v1/memoffload.grpc.pb.h"

namespace {

namespace v1 = memoffload::v1;
using memoffload::Status;

int Die(const std::string& what, const Status& st) {
  std::fprintf(stderr, "stale_keeper: %s: %s\n", what.c_str(), st.ToString().c_str());
  return 1;
}

struct Mapping {
  uint8_t* data = nullptr;
  uint64_t size = 0;
};

Status Connect(const std::string& dir, int* fd) {
  *fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = memoffload::BrokerSocketPath(dir);
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (*fd < 0 || connect(*fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return memoffload::ErrnoStatus("connect " + path, errno);
  }
  return Status::Ok();
}

// Waits for GO_FILE, checks and overwrites the mappings, then sleeps.
int Keep(const std::vector<Mapping>& maps, const std::string& go_file) {
  std::printf("KEEPER %d\n", getpid());
  std::fflush(stdout);
  struct stat st {};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (stat(go_file.c_str(), &st) != 0) {
    if (std::chrono::steady_clock::now() > deadline) return 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  bool own = true, saw_b = false;
  for (const Mapping& m : maps) {
    for (uint64_t i = 0; i < m.size; ++i) {
      own = own && m.data[i] == 0xA1;
      saw_b = saw_b || m.data[i] == 0x5B;
    }
  }
  std::printf("RESULT OWN %s SAW_B %s\n", own ? "yes" : "no", saw_b ? "yes" : "no");
  std::fflush(stdout);
  for (const Mapping& m : maps) std::memset(m.data, 0xEE, m.size);
  std::printf("WROTE\n");
  std::fflush(stdout);
  while (true) pause();
}

int Run(const std::string& dir, uid_t uid, const std::string& mode, uint64_t bytes,
        const std::string& go_file) {
  if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0) {
    std::fprintf(stderr, "stale_keeper: cannot drop to uid %u\n", uid);
    return 1;
  }
  int pass[2] = {-1, -1};
  if (mode == "pass-fd") {
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, pass) != 0) return 1;
    const pid_t child = fork();
    if (child < 0) return 1;
    if (child == 0) {
      close(pass[0]);
      std::string payload;
      std::vector<int> fds;
      if (Status st = memoffload::RecvFrame(pass[1], &payload, &fds); !st.ok()) {
        return Die("receive fds", st);
      }
      std::vector<Mapping> maps;
      for (int fd : fds) {
        struct stat s {};
        if (fstat(fd, &s) != 0) return 1;
        void* p = mmap(nullptr, s.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) return 1;
        maps.push_back({static_cast<uint8_t*>(p), static_cast<uint64_t>(s.st_size)});
        // The fds stay open too: holding an fd is keeping the backing.
      }
      return Keep(maps, go_file);
    }
    close(pass[1]);
  }

  int lifeline = -1;
  if (Status st = Connect(dir, &lifeline); !st.ok()) return Die("connect", st);
  memoffload::Hello hello;
  hello.job_id = "stale-keeper";
  if (Status st = memoffload::SendFrame(lifeline, memoffload::EncodeHello(hello)); !st.ok()) {
    return Die("hello", st);
  }
  std::string payload;
  std::vector<int> fds;
  if (Status st = memoffload::RecvFrame(lifeline, &payload, &fds); !st.ok()) {
    return Die("attach reply", st);
  }
  auto reply = memoffload::DecodeAttachReply(payload);
  if (!reply.ok() || reply->code != memoffload::StatusCode::kOk) {
    return Die("attach", reply.ok() ? Status(reply->code, reply->message) : reply.status());
  }
  for (uint32_t i = 0; i < reply->fd_frames; ++i) {
    if (Status st = memoffload::RecvFrame(lifeline, &payload, &fds); !st.ok()) return 1;
    memoffload::CloseFds(&fds);
  }
  auto stub = v1::Offload::NewStub(
      grpc::CreateChannel("unix:" + reply->grpc_socket, grpc::InsecureChannelCredentials()));
  v1::ReserveRequest req;
  req.mutable_session()->set_session_id(reply->session_id);
  req.mutable_session()->set_session_token(reply->session_token);
  req.set_group_id(1);
  req.set_size_bytes(bytes);
  v1::ReserveResponse resp;
  {
    grpc::ClientContext ctx;
    grpc::Status st = stub->Reserve(&ctx, req, &resp);
    if (!st.ok()) {
      std::fprintf(stderr, "stale_keeper: reserve: %s\n", st.error_message().c_str());
      return 1;
    }
  }
  std::set<uint32_t> chunks;
  for (const v1::Extent& e : resp.extents()) chunks.insert(e.chunk());
  memoffload::ChunkRequest creq{{chunks.begin(), chunks.end()}};
  if (Status st = memoffload::SendFrame(lifeline, memoffload::EncodeChunkRequest(creq)); !st.ok()) {
    return Die("chunk request", st);
  }
  if (Status st = memoffload::RecvFrame(lifeline, &payload, &fds); !st.ok()) {
    return Die("chunk reply", st);
  }
  auto creply = memoffload::DecodeChunkReply(payload);
  if (!creply.ok() || creply->code != memoffload::StatusCode::kOk) return 1;
  std::vector<Mapping> maps;
  for (size_t i = 0; i < fds.size(); ++i) {
    const uint64_t size = reply->chunks[creply->chunk_indexes[i]].size_bytes;
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], 0);
    if (p == MAP_FAILED) return 1;
    maps.push_back({static_cast<uint8_t*>(p), size});
    std::memset(p, 0xA1, size);
  }
  {
    v1::ReleaseRequest rel;
    *rel.mutable_session() = req.session();
    rel.set_group_id(1);
    v1::ReleaseResponse rel_resp;
    grpc::ClientContext ctx;
    if (!stub->Release(&ctx, rel, &rel_resp).ok()) return 1;
  }
  stub.reset();
  if (mode == "close") {
    memoffload::CloseFds(&fds);
    close(lifeline);  // on purpose: the session ends, the mapping stays
    return Keep(maps, go_file);
  }
  if (mode == "parent-dies") {
    const pid_t child = fork();
    if (child < 0) return 1;
    if (child == 0) return Keep(maps, go_file);  // inherits mapping and lifeline
    _exit(0);
  }
  if (mode == "pass-fd") {
    if (Status st = memoffload::SendFrame(pass[0], "fds", fds); !st.ok()) {
      return Die("pass fds", st);
    }
    for (const Mapping& m : maps) munmap(m.data, m.size);
    memoffload::CloseFds(&fds);
    _exit(0);
  }
  std::fprintf(stderr, "stale_keeper: unknown mode %s\n", mode.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr,
                 "usage: stale_keeper RUNTIME_DIR UID close|parent-dies|pass-fd BYTES GO_FILE\n");
    return 2;
  }
  return Run(argv[1], static_cast<uid_t>(std::stoul(argv[2])), argv[3], std::stoull(argv[4]),
             argv[5]);
}
