// Every malformed or out-of-order request gets its documented code and a
// clear message, and the daemon keeps serving.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/fd_passing.h"
#include "memoffload/v1/memoffload.grpc.pb.h"

namespace memoffload::testing {
namespace {

class ErrorsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string error;
    daemon_ = DaemonProcess::Start({}, &error).release();
    ASSERT_NE(daemon_, nullptr) << error;
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(daemon_, nullptr);
    client::AttachOptions options;
    options.runtime_dir = daemon_->runtime_dir();
    auto c = client::Client::Attach(options);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
    stub_ = v1::Offload::NewStub(grpc::CreateChannel(
        "unix:" + daemon_->runtime_dir() + "/memoffload.sock", grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (!client_) return;  // SetUp failed and said why
    // Whatever happened, the daemon still serves a full cycle.
    auto r = client_->Reserve(9999, 4096);

    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_TRUE(client_->Commit(9999, 4096).ok());
    ASSERT_TRUE(client_->Prefetch(9999).ok());
    ASSERT_TRUE(client_->Release(9999).ok());
  }

  static DaemonProcess* daemon_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<v1::Offload::Stub> stub_;
};
DaemonProcess* ErrorsTest::daemon_ = nullptr;

TEST_F(ErrorsTest, WrongTokenIsUnauthenticated) {
  v1::ReserveRequest req;
  req.mutable_session()->set_session_id(client_->session_id());
  req.mutable_session()->set_session_token("0123456789abcdef0123456789abcdef");
  req.set_group_id(1);
  req.set_size_bytes(4096);
  grpc::ClientContext ctx;
  v1::ReserveResponse resp;
  grpc::Status st = stub_->Reserve(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
  EXPECT_NE(st.error_message().find("token"), std::string::npos);
}

TEST_F(ErrorsTest, UnknownSessionIsNotFound) {
  v1::PrefetchRequest req;
  req.mutable_session()->set_session_id(987654321);
  req.mutable_session()->set_session_token("x");
  req.set_group_id(1);
  grpc::ClientContext ctx;
  v1::PrefetchResponse resp;
  grpc::Status st = stub_->Prefetch(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(st.error_message().find("987654321"), std::string::npos) << st.error_message();
}

TEST_F(ErrorsTest, MissingSessionIsInvalidArgument) {
  v1::ReleaseRequest req;
  req.set_group_id(1);
  grpc::ClientContext ctx;
  v1::ReleaseResponse resp;
  EXPECT_EQ(stub_->Release(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ErrorsTest, UnknownGroupIsNotFound) {
  EXPECT_EQ(client_->Commit(424242, 1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(client_->Prefetch(424242).status().code(), StatusCode::kNotFound);
  Status st = client_->Release(424242);
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("424242"), std::string::npos);
}

TEST_F(ErrorsTest, WrongStateIsFailedPrecondition) {
  ASSERT_TRUE(client_->Reserve(1, 8192).ok());
  Result<client::Placement> early = client_->Prefetch(1);
  EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(early.status().message().find("Commit it before Prefetch"), std::string::npos);
  EXPECT_EQ(client_->Reserve(1, 8192).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(client_->Commit(1, 8192).ok());
  EXPECT_EQ(client_->Commit(1, 8192).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(client_->Release(1).ok());
}

TEST_F(ErrorsTest, MoreThanTheArenaIsResourceExhaustedNamingSizes) {
  Result<client::Reservation> r = client_->Reserve(2, uint64_t{1} << 40);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("1.00 TiB"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("256.00 MiB"), std::string::npos) << r.status().message();
  // Fits the arena but not what is free.
  ASSERT_TRUE(client_->Reserve(3, 200 << 20).ok());
  r = client_->Reserve(4, 100 << 20);
  ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("100.00 MiB"), std::string::npos) << r.status().message();
  ASSERT_TRUE(client_->Release(3).ok());
}

TEST_F(ErrorsTest, BadArgumentsAreInvalidArgument) {
  EXPECT_EQ(client_->Reserve(5, 0).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(client_->Reserve(5, 4096).ok());
  EXPECT_EQ(client_->Commit(5, 8193).status().code(), StatusCode::kInvalidArgument);
  // The client refuses ranges outside its extents before touching memory.
  auto r = client_->Reserve(6, 4096);
  ASSERT_TRUE(r.ok());
  char buf[16] = {};
  EXPECT_EQ(client_->Write(r->extents, 4090, buf, 16).code(), StatusCode::kInvalidArgument);
  std::vector<Extent> forged = {{999, 0, 4096}};
  EXPECT_EQ(client_->Write(forged, 0, buf, 16).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(client_->Release(5).ok());
  ASSERT_TRUE(client_->Release(6).ok());
}

// Raw bytes on the broker socket: garbage and a wrong protocol version are
// refused with a reason, and the daemon keeps serving.
int ConnectBroker(const std::string& dir) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, (dir + "/broker.sock").c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return -1;
  return fd;
}

TEST_F(ErrorsTest, MalformedHelloIsRefusedWithReason) {
  int fd = ConnectBroker(daemon_->runtime_dir());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendFrame(fd, "definitely not a hello").ok());
  std::string payload;
  std::vector<int> fds;
  ASSERT_TRUE(RecvFrame(fd, &payload, &fds).ok());
  Result<AttachReply> reply = DecodeAttachReply(payload);
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(reply->code, StatusCode::kInvalidArgument);
  EXPECT_NE(reply->message.find("magic"), std::string::npos) << reply->message;
  EXPECT_TRUE(fds.empty());
  close(fd);

  fd = ConnectBroker(daemon_->runtime_dir());
  Hello hello;
  std::string bytes = EncodeHello(hello);
  bytes[4] = 7;  // protocol version 7
  ASSERT_TRUE(SendFrame(fd, bytes).ok());
  ASSERT_TRUE(RecvFrame(fd, &payload, &fds).ok());
  reply = DecodeAttachReply(payload);
  ASSERT_TRUE(reply.ok());
  EXPECT_NE(reply->message.find("version 7"), std::string::npos) << reply->message;
  close(fd);

  // A client that connects and hangs up without a word.
  fd = ConnectBroker(daemon_->runtime_dir());
  close(fd);
  // A huge length prefix.
  fd = ConnectBroker(daemon_->runtime_dir());
  const unsigned char huge[4] = {0xff, 0xff, 0xff, 0xff};
  ASSERT_EQ(write(fd, huge, 4), 4);
  ASSERT_TRUE(RecvFrame(fd, &payload, &fds).ok());
  EXPECT_EQ(DecodeAttachReply(payload)->code, StatusCode::kInvalidArgument);
  close(fd);
}

}  // namespace
}  // namespace memoffload::testing
