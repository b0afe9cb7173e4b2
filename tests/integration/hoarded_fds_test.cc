// Chunk fds that a peer has not read yet count against the daemon's uid
// (RLIMIT_NOFILE) until it reads or closes them. Stop 28's adversarial run
// pipelined chunk requests naming one chunk 240 times and never read: about
// 11,800 fds in flight per connection. Past the daemon's limit the kernel
// refused every later fd pass (ETOOMANYREFS), the broker took that for a
// dead peer, and other tenants could no longer attach, nor map a new chunk:
// their sessions were closed and their groups reclaimed. Now a chunk request
// names each chunk once, a request while the last reply is unread ends the
// connection, and a closed connection whose replies are unread keeps its
// connection slot until they are read or closed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/fd_passing.h"

namespace memoffload::testing {
namespace {

using Clock = std::chrono::steady_clock;

// A raw attach: the hello, the reply and its fd frames read (and the fds
// closed). Returns the connection, or -1.
int RawAttach(const std::string& runtime_dir) {
  const int fd = ConnectUnix(runtime_dir + "/broker.sock");
  if (fd < 0) return -1;
  Hello hello;
  hello.job_id = "hoarder";
  std::string payload;
  std::vector<int> fds;
  bool ok = SendFrame(fd, EncodeHello(hello)).ok() && RecvFrame(fd, &payload, &fds).ok();
  Result<AttachReply> reply = DecodeAttachReply(payload);
  ok = ok && reply.ok() && reply->code == StatusCode::kOk;
  for (uint32_t i = 0; ok && i < reply->fd_frames; ++i) ok = RecvFrame(fd, &payload, &fds).ok();
  CloseFds(&fds);
  if (!ok) close(fd);
  return ok ? fd : -1;
}

// Writes `count` chunk requests for `chunks` without reading; returns how
// many went out before the daemon closed the connection.
int Pipeline(int fd, const std::vector<uint32_t>& chunks, int count) {
  ChunkRequest request;
  request.chunk_indexes = chunks;
  const std::string payload = EncodeChunkRequest(request);
  std::string frame(4, '\0');
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>(payload.size() >> (8 * i));
  frame += payload;
  int sent = 0;
  for (; sent < count; ++sent) {
    if (send(fd, frame.data(), frame.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(frame.size())) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // one request at a time
  }
  return sent;
}

DaemonProcess::Options WithoutFdCaps() {
  DaemonProcess::Options options;
  options.nofile_limit = 256;
  options.drop_fd_caps = true;
  return options;
}

TEST(HoardedFds, APeerThatDoesNotReadItsRepliesLeavesOthersTheirChunks) {
  std::string error;
  auto daemon = DaemonProcess::Start(WithoutFdCaps(), &error);
  ASSERT_NE(daemon, nullptr) << error;
  // A session of root's tenant (the hoarder's too) owns chunk 0.
  client::AttachOptions options;
  options.runtime_dir = daemon->runtime_dir();
  auto holder = client::Client::Attach(options);
  ASSERT_TRUE(holder.ok()) << holder.status().ToString();
  Result<client::Reservation> r = (*holder)->Reserve(1, 1 << 20);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const uint32_t chunk = r->extents.at(0).chunk;

  // 200 fds a request (which the daemon now refuses: one chunk, named 200
  // times), then the same requests again and again without reading.
  const int hoarder = RawAttach(daemon->runtime_dir());
  ASSERT_GE(hoarder, 0);
  Pipeline(hoarder, std::vector<uint32_t>(200, chunk), 20);

  // Others attach, map chunks and offload as usual, and the holder's
  // session lives on.
  for (int i = 0; i < 3; ++i) {
    auto c = client::Client::Attach(options);
    ASSERT_TRUE(c.ok()) << "attach " << i << ": " << c.status().ToString() << daemon->Log();
    Result<client::Reservation> big = (*c)->Reserve(1, 96u << 20);  // spans two chunks
    ASSERT_TRUE(big.ok()) << big.status().ToString() << daemon->Log();
    std::vector<uint8_t> bytes(96u << 20, static_cast<uint8_t>(i + 1));
    ASSERT_TRUE((*c)->Write(big->extents, 0, bytes.data(), bytes.size()).ok());
    ASSERT_TRUE((*c)->Commit(1, bytes.size()).ok());
    ASSERT_TRUE((*c)->Release(1).ok());
  }
  EXPECT_TRUE((*holder)->Commit(1, 1 << 20).ok());
  EXPECT_FALSE((*holder)->session_lost());
  EXPECT_NE(daemon->Log().find("chunk " + std::to_string(chunk) + " asked for twice"),
            std::string::npos)
      << daemon->Log();
  EXPECT_NE(daemon->Log().find("asked for chunks before reading its last reply; closing it"),
            std::string::npos)
      << daemon->Log();
  EXPECT_EQ(daemon->Log().find("ETOOMANYREFS"), std::string::npos);
  EXPECT_EQ(daemon->Log().find("more descriptors in flight"), std::string::npos) << daemon->Log();
  close(hoarder);
}

// The slot of a closed connection whose peer holds unread replies stays
// taken until the peer closes them; then it is free again.
TEST(HoardedFds, AClosedConnectionWithUnreadRepliesKeepsItsSlotUntilThePeerLetsGo) {
  std::string error;
  DaemonProcess::Options options = WithoutFdCaps();
  options.extra_args = {"--max-connections-per-uid=2"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const int hoarder = RawAttach(daemon->runtime_dir());
  ASSERT_GE(hoarder, 0);
  // Two requests without reading the first reply: the connection ends.
  Pipeline(hoarder, {0}, 2);
  const auto closed_by = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < closed_by && daemon->Status().sessions() != 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(daemon->Status().sessions(), 0u) << daemon->Log();

  client::AttachOptions attach;
  attach.runtime_dir = daemon->runtime_dir();
  auto second = client::Client::Attach(attach);  // the uid's other slot
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  auto third = client::Client::Attach(attach);
  ASSERT_FALSE(third.ok()) << "the hoarder's slot was given back while it held unread replies";
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted) << third.status().ToString();
  // Told once, after a sweep (an ordinary client would have read by then).
  const auto told_by = Clock::now() + std::chrono::seconds(5);
  const std::string told = "has not read what the daemon sent before its connection ended";
  while (Clock::now() < told_by && daemon->Log().find(told) == std::string::npos) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // more sweeps
  const std::string log = daemon->Log();
  const size_t first = log.find(told);
  EXPECT_NE(first, std::string::npos) << log;
  EXPECT_EQ(log.find(told, first + 1), std::string::npos) << "told more than once:\n" << log;

  close(hoarder);  // its unread replies go with it
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  bool attached = false;
  while (Clock::now() < deadline && !attached) {
    attached = client::Client::Attach(attach).ok();
    if (!attached) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(attached) << daemon->Log();
}

}  // namespace
}  // namespace memoffload::testing
