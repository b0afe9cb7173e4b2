#include "memoffload/shared_mem/fd_passing.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

namespace memoffload {
namespace {

class SocketPair : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  void TearDown() override {
    close(fds_[0]);
    if (fds_[1] >= 0) close(fds_[1]);
  }
  int fds_[2] = {-1, -1};
};

// The header the daemon's broker writes and parses on its own (without
// SendFrame/RecvFrame) is the one SendFrame puts on the wire.
TEST(FrameHeader, IsTheLittleEndianLengthThatSendFrameWrites) {
  for (uint32_t len : {0u, 1u, 0x01020304u, static_cast<uint32_t>(kMaxFrameBytes)}) {
    const std::string header = EncodeFrameHeader(len);
    ASSERT_EQ(header.size(), kFrameHeaderBytes);
    EXPECT_EQ(static_cast<unsigned char>(header[0]), len & 0xff);
    EXPECT_EQ(static_cast<unsigned char>(header[3]), len >> 24);
    EXPECT_EQ(DecodeFrameHeader(reinterpret_cast<const unsigned char*>(header.data())), len);
  }
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  ASSERT_TRUE(SendFrame(pair[0], "hello").ok());
  char wire[16];
  ASSERT_EQ(read(pair[1], wire, sizeof(wire)), 9);
  EXPECT_EQ(std::string(wire, 9), EncodeFrameHeader(5) + "hello");
  close(pair[0]);
  close(pair[1]);
}

TEST_F(SocketPair, FrameWithoutFds) {
  ASSERT_TRUE(SendFrame(fds_[0], "hello").ok());
  std::string payload;
  std::vector<int> fds;
  ASSERT_TRUE(RecvFrame(fds_[1], &payload, &fds).ok());
  EXPECT_EQ(payload, "hello");
  EXPECT_TRUE(fds.empty());
}

TEST_F(SocketPair, PassedFdRefersToSameFile) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  ASSERT_TRUE(SendFrame(fds_[0], "x", {pipe_fds[1]}).ok());
  close(pipe_fds[1]);
  std::string payload;
  std::vector<int> fds;
  ASSERT_TRUE(RecvFrame(fds_[1], &payload, &fds).ok());
  ASSERT_EQ(fds.size(), 1u);
  EXPECT_TRUE(fcntl(fds[0], F_GETFD) & FD_CLOEXEC);
  ASSERT_EQ(write(fds[0], "z", 1), 1);
  char c = 0;
  ASSERT_EQ(read(pipe_fds[0], &c, 1), 1);
  EXPECT_EQ(c, 'z');
  CloseFds(&fds);
  close(pipe_fds[0]);
}

TEST_F(SocketPair, ManyFdsInOneFrameAndSeveralFrames) {
  std::vector<int> sent;
  for (size_t i = 0; i < kMaxFdsPerFrame; ++i) sent.push_back(open("/dev/null", O_RDONLY));
  ASSERT_TRUE(SendFrame(fds_[0], "batch1", sent).ok());
  ASSERT_TRUE(SendFrame(fds_[0], "batch2", {sent[0], sent[1]}).ok());
  std::string payload;
  std::vector<int> got;
  ASSERT_TRUE(RecvFrame(fds_[1], &payload, &got).ok());
  EXPECT_EQ(payload, "batch1");
  EXPECT_EQ(got.size(), kMaxFdsPerFrame);
  CloseFds(&got);
  ASSERT_TRUE(RecvFrame(fds_[1], &payload, &got).ok());
  EXPECT_EQ(payload, "batch2");
  EXPECT_EQ(got.size(), 2u);
  CloseFds(&got);
  for (int fd : sent) close(fd);
}

TEST_F(SocketPair, LimitsAreEnforced) {
  std::vector<int> too_many(kMaxFdsPerFrame + 1, 0);
  EXPECT_EQ(SendFrame(fds_[0], "x", too_many).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SendFrame(fds_[0], std::string(kMaxFrameBytes + 1, 'a')).code(),
            StatusCode::kInvalidArgument);
  // A peer announcing an oversized frame is refused without allocating it.
  const unsigned char header[4] = {0xff, 0xff, 0xff, 0x7f};
  ASSERT_EQ(write(fds_[0], header, 4), 4);
  std::string payload;
  std::vector<int> fds;
  EXPECT_EQ(RecvFrame(fds_[1], &payload, &fds).code(), StatusCode::kInvalidArgument);
}

TEST_F(SocketPair, PeerCloseMidFrameIsUnavailable) {
  const unsigned char header[4] = {10, 0, 0, 0};
  ASSERT_EQ(write(fds_[0], header, 4), 4);
  ASSERT_EQ(write(fds_[0], "abc", 3), 3);
  close(fds_[0]);
  fds_[0] = open("/dev/null", O_RDONLY);
  std::string payload;
  std::vector<int> fds;
  EXPECT_EQ(RecvFrame(fds_[1], &payload, &fds).code(), StatusCode::kUnavailable);
}

TEST_F(SocketPair, LargeFrameAcrossShortWrites) {
  const std::string big(kMaxFrameBytes, 'q');
  std::thread writer([&] { ASSERT_TRUE(SendFrame(fds_[0], big).ok()); });
  std::string payload;
  std::vector<int> fds;
  ASSERT_TRUE(RecvFrame(fds_[1], &payload, &fds).ok());
  writer.join();
  EXPECT_EQ(payload, big);
}

}  // namespace
}  // namespace memoffload
