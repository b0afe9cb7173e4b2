// The standard gRPC services on the daemon's socket: health
// (grpc.health.v1.Health/Check answers SERVING) and server reflection
// (grpc.reflection.v1alpha.ServerReflection lists memoffload.v1.Offload),
// called as any grpc tool would, through a generic stub with hand-encoded
// protobuf (Debian ships neither proto's generated C++). Also SIGINT stops
// the daemon like SIGTERM.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "memoffload/common/runtime_dir.h"

namespace memoffload::testing {
namespace {

using Clock = std::chrono::steady_clock;

// --- minimal protobuf wire format -----------------------------------------

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Length-delimited field `field` (wire type 2) holding `bytes`.
std::string LengthField(int field, const std::string& bytes) {
  std::string out;
  PutVarint(static_cast<uint64_t>(field) << 3 | 2, &out);
  PutVarint(bytes.size(), &out);
  return out + bytes;
}

struct Field {
  int number = 0;
  int wire_type = 0;
  uint64_t varint = 0;  // wire type 0
  std::string bytes;    // wire type 2
};

// Top-level fields of a message; false on malformed input or wire types
// other than varint and length-delimited (not used by these messages).
bool ParseFields(const std::string& msg, std::vector<Field>* fields) {
  size_t i = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64 && i < msg.size(); shift += 7) {
      const uint8_t b = static_cast<uint8_t>(msg[i++]);
      *v |= uint64_t{b & 0x7Fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  while (i < msg.size()) {
    uint64_t key;
    if (!varint(&key)) return false;
    Field f;
    f.number = static_cast<int>(key >> 3);
    f.wire_type = static_cast<int>(key & 7);
    if (f.wire_type == 0) {
      if (!varint(&f.varint)) return false;
    } else if (f.wire_type == 2) {
      uint64_t len;
      if (!varint(&len) || len > msg.size() - i) return false;
      f.bytes = msg.substr(i, len);
      i += len;
    } else {
      return false;
    }
    fields->push_back(std::move(f));
  }
  return true;
}

grpc::ByteBuffer ToBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string FromBuffer(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

// --- calls through a generic stub ----------------------------------------

class GenericCaller {
 public:
  explicit GenericCaller(const std::string& runtime_dir)
      : stub_(grpc::CreateChannel("unix:" + GrpcSocketPath(runtime_dir),
                                  grpc::InsecureChannelCredentials())) {}

  // One unary call; returns its status and fills *response.
  grpc::Status Unary(const std::string& method, const std::string& request, std::string* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::CompletionQueue cq;
    auto call = stub_.PrepareUnaryCall(&ctx, method, ToBuffer(request), &cq);
    call->StartCall();
    grpc::ByteBuffer reply;
    grpc::Status status;
    call->Finish(&reply, &status, Tag(1));
    if (!Await(&cq, 1)) return grpc::Status(grpc::StatusCode::INTERNAL, "no completion");
    if (status.ok()) *response = FromBuffer(reply);
    return status;
  }

  // A bidirectional stream with one request: writes it, half-closes, and
  // reads every response until the server finishes.
  grpc::Status StreamOne(const std::string& method, const std::string& request,
                         std::vector<std::string>* responses) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::CompletionQueue cq;
    auto call = stub_.PrepareCall(&ctx, method, &cq);
    const grpc::Status broken(grpc::StatusCode::INTERNAL, "stream step failed");
    call->StartCall(Tag(1));
    if (!Await(&cq, 1)) return broken;
    call->Write(ToBuffer(request), Tag(2));
    if (!Await(&cq, 2)) return broken;
    call->WritesDone(Tag(3));
    if (!Await(&cq, 3)) return broken;
    while (true) {
      grpc::ByteBuffer reply;
      call->Read(&reply, Tag(4));
      if (!Await(&cq, 4)) break;  // no more messages
      responses->push_back(FromBuffer(reply));
    }
    grpc::Status status;
    call->Finish(&status, Tag(5));
    if (!Await(&cq, 5)) return broken;
    return status;
  }

 private:
  static void* Tag(intptr_t n) { return reinterpret_cast<void*>(n); }
  // Waits for the completion of `tag`; returns its ok flag.
  static bool Await(grpc::CompletionQueue* cq, intptr_t tag) {
    void* got = nullptr;
    bool ok = false;
    while (cq->Next(&got, &ok)) {
      if (got == Tag(tag)) return ok;
    }
    return false;
  }

  grpc::GenericStub stub_;
};

TEST(GrpcServices, HealthCheckAnswersServing) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  GenericCaller caller(daemon->runtime_dir());
  // HealthCheckRequest{service = ""}: the server as a whole (an empty
  // message) is SERVING (HealthCheckResponse.status = 1).
  {
    std::string response;
    const grpc::Status st = caller.Unary("/grpc.health.v1.Health/Check", "", &response);
    ASSERT_TRUE(st.ok()) << st.error_code() << " " << st.error_message();
    std::vector<Field> fields;
    ASSERT_TRUE(ParseFields(response, &fields));
    ASSERT_EQ(fields.size(), 1u);
    EXPECT_EQ(fields[0].number, 1);
    EXPECT_EQ(fields[0].wire_type, 0);
    EXPECT_EQ(fields[0].varint, 1u) << "HealthCheckResponse.status is not SERVING";
  }
  // An unknown service is NOT_FOUND, as the health protocol specifies.
  std::string response;
  const grpc::Status st =
      caller.Unary("/grpc.health.v1.Health/Check", LengthField(1, "no.such.Service"), &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
}

TEST(GrpcServices, ReflectionListsTheOffloadService) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  GenericCaller caller(daemon->runtime_dir());
  // ServerReflectionRequest{list_services = ""} (field 7).
  std::vector<std::string> responses;
  const grpc::Status st =
      caller.StreamOne("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                       LengthField(7, ""), &responses);
  ASSERT_TRUE(st.ok()) << st.error_code() << " " << st.error_message();
  ASSERT_EQ(responses.size(), 1u);
  // ServerReflectionResponse.list_services_response (6) holds repeated
  // ServiceResponse service (1), each with name (1).
  std::vector<Field> fields;
  ASSERT_TRUE(ParseFields(responses[0], &fields));
  std::vector<std::string> names;
  for (const Field& f : fields) {
    if (f.number != 6 || f.wire_type != 2) continue;
    std::vector<Field> services;
    ASSERT_TRUE(ParseFields(f.bytes, &services));
    for (const Field& service : services) {
      std::vector<Field> name;
      ASSERT_TRUE(ParseFields(service.bytes, &name));
      ASSERT_FALSE(name.empty());
      names.push_back(name[0].bytes);
    }
  }
  std::string all;
  for (const std::string& n : names) all += n + " ";
  EXPECT_NE(std::find(names.begin(), names.end(), "memoffload.v1.Offload"), names.end()) << all;
  EXPECT_NE(std::find(names.begin(), names.end(), "grpc.health.v1.Health"), names.end()) << all;
}

TEST(GrpcServices, SigintExitsZeroAndRemovesSockets) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string dir = daemon->runtime_dir();
  const auto start = Clock::now();
  const int status = daemon->Stop(SIGINT, 20000);
  ASSERT_NE(status, -1) << "daemon did not stop on SIGINT";
  // At once, not after the drain deadline (30 s); generous for a loaded
  // machine under ASan (it failed at 2 s with both cores busy).
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10)) << "SIGINT waited as SIGTERM does";
  ASSERT_TRUE(WIFEXITED(status)) << "wait status " << status << "\n" << daemon->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0) << daemon->Log();
  EXPECT_FALSE(std::filesystem::exists(dir + "/broker.sock"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/memoffload.sock"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/admin.token"));
  EXPECT_NE(daemon->Log().find("stopped cleanly"), std::string::npos) << daemon->Log();
}

}  // namespace
}  // namespace memoffload::testing
