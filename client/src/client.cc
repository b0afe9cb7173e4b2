#include "memoffload/client/client.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "grpc_util.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/chunk.h"
#include "memoffload/shared_mem/fd_passing.h"
#include "memoffload/shared_mem/runtime_dir.h"
#include "memoffload/v1/memoffload.grpc.pb.h"

namespace memoffload::client {
namespace {

Result<int> ConnectUnix(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return InvalidArgument("socket path " + path + " is too long");
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket", errno);
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    return Unavailable("cannot reach memoffloadd at " + path + ": " + std::strerror(err) +
                       " (is the daemon running? set MEMOFFLOAD_RUNTIME_DIR to its "
                       "runtime dir)");
  }
  return fd;
}

void FillCredentials(v1::SessionCredentials* creds, uint64_t id, const std::string& token) {
  creds->set_session_id(id);
  creds->set_session_token(token);
}

std::vector<Extent> FromProto(const google::protobuf::RepeatedPtrField<v1::Extent>& in) {
  std::vector<Extent> out;
  out.reserve(in.size());
  for (const v1::Extent& e : in) out.push_back({e.chunk(), e.offset(), e.length()});
  return out;
}

}  // namespace

class Client::Impl {
 public:
  ~Impl() {
    if (lifeline_fd >= 0) close(lifeline_fd);
  }

  std::string runtime_dir;
  std::string grpc_socket;
  int lifeline_fd = -1;
  int rpc_timeout_ms = 30000;
  AttachReply reply;
  std::vector<Chunk> chunks;  // indexed by chunk index
  std::unique_ptr<v1::Offload::Stub> stub;

  // Runs `fn` over the pieces of [offset, offset+length) of the extent stream.
  template <typename Fn>
  Status ForEachPiece(const std::vector<Extent>& extents, uint64_t offset, uint64_t length,
                      Fn fn) const {
    uint64_t pos = 0;  // stream position of the current extent's start
    uint64_t done = 0;
    for (const Extent& e : extents) {
      if (done == length) break;
      uint8_t* base = Locate(e);
      if (base == nullptr) {
        return InvalidArgument("extent (chunk " + std::to_string(e.chunk) + ", offset " +
                               std::to_string(e.offset) + ", length " + std::to_string(e.length) +
                               ") is outside the mapped arena");
      }
      const uint64_t end = pos + e.length;
      const uint64_t want = offset + done;
      if (want < end) {
        const uint64_t in_extent = want - pos;
        const uint64_t n = std::min(e.length - in_extent, length - done);
        fn(base + in_extent, done, n);
        done += n;
      }
      pos = end;
    }
    if (done != length) {
      return InvalidArgument("range [" + std::to_string(offset) + ", " +
                             std::to_string(offset + length) + ") exceeds the extents' " +
                             std::to_string(pos) + " bytes");
    }
    return Status::Ok();
  }

  uint8_t* Locate(const Extent& e) const {
    if (e.chunk >= chunks.size() || !chunks[e.chunk].valid()) return nullptr;
    const Chunk& c = chunks[e.chunk];
    if (e.offset > c.size_bytes() || e.length > c.size_bytes() - e.offset) return nullptr;
    return c.data() + e.offset;
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::Attach(const AttachOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->runtime_dir = ResolveRuntimeDir(options.runtime_dir);
  impl->rpc_timeout_ms = options.rpc_timeout_ms;
  Result<int> fd = ConnectUnix(BrokerSocketPath(impl->runtime_dir));
  if (!fd.ok()) return fd.status();
  impl->lifeline_fd = *fd;

  Hello hello;
  hello.job_id = options.job_id;
  hello.rank = options.rank;
  hello.local_rank = options.local_rank;
  hello.max_bytes = options.max_bytes;
  hello.job_max_bytes = options.job_max_bytes;
  MEMOFFLOAD_RETURN_IF_ERROR(SendFrame(impl->lifeline_fd, EncodeHello(hello)));

  std::string payload;
  std::vector<int> fds;
  if (Status st = RecvFrame(impl->lifeline_fd, &payload, &fds); !st.ok()) {
    CloseFds(&fds);
    return Unavailable("attach to memoffloadd failed: " + st.message());
  }
  CloseFds(&fds);  // the reply itself carries none
  Result<AttachReply> reply = DecodeAttachReply(payload);
  if (!reply.ok()) return reply.status();
  if (reply->code != StatusCode::kOk) {
    return Status(reply->code, "memoffloadd refused the attach: " + reply->message);
  }
  impl->reply = std::move(reply).value();
  impl->chunks.resize(impl->reply.chunks.size());
  for (uint32_t frame = 0; frame < impl->reply.fd_frames; ++frame) {
    if (Status st = RecvFrame(impl->lifeline_fd, &payload, &fds); !st.ok()) {
      CloseFds(&fds);
      return Unavailable("attach: receiving chunk fds failed: " + st.message());
    }
    Result<ChunkFdBatch> batch = DecodeChunkFdBatch(payload);
    if (!batch.ok() || batch->chunk_indexes.size() != fds.size()) {
      CloseFds(&fds);
      return Internal("attach: malformed chunk fd batch from the daemon");
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      const uint32_t index = batch->chunk_indexes[i];
      if (index >= impl->chunks.size()) {
        for (size_t j = i; j < fds.size(); ++j) close(fds[j]);
        fds.clear();
        return Internal("attach: chunk index " + std::to_string(index) + " out of range");
      }
      Result<Chunk> chunk =
          Chunk::Map(fds[i], impl->reply.chunks[index].size_bytes, options.populate);
      if (!chunk.ok()) {
        for (size_t j = i + 1; j < fds.size(); ++j) close(fds[j]);
        fds.clear();
        return chunk.status();
      }
      impl->chunks[index] = std::move(chunk).value();
    }
    fds.clear();
  }
  impl->grpc_socket = impl->reply.grpc_socket;
  impl->stub = v1::Offload::NewStub(MakeChannel(impl->grpc_socket));
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Result<Reservation> Client::Reserve(uint64_t group_id, uint64_t size_bytes,
                                    const ReserveOptions& options) {
  v1::ReserveRequest req;
  FillCredentials(req.mutable_session(), impl_->reply.session_id, impl_->reply.session_token);
  req.set_group_id(group_id);
  req.set_size_bytes(size_bytes);
  req.set_single_extent(options.single_extent);
  req.set_wait_for_space(options.wait_for_space);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options.wait_for_space && options.wait_timeout_ms > 0 ? options.wait_timeout_ms
                                                                          : impl_->rpc_timeout_ms);

  v1::ReserveResponse resp;
  Status st = FromGrpc(impl_->stub->Reserve(&ctx, req, &resp), impl_->grpc_socket);
  if (!st.ok()) return st;
  return Reservation{FromProto(resp.extents()), resp.reserved_bytes()};
}

Result<CommitInfo> Client::Commit(uint64_t group_id, uint64_t used_bytes, const CopyStats& copy) {
  v1::CommitRequest req;
  FillCredentials(req.mutable_session(), impl_->reply.session_id, impl_->reply.session_token);
  req.set_group_id(group_id);
  req.set_used_bytes(used_bytes);
  req.mutable_copy()->set_bytes(copy.bytes);
  req.mutable_copy()->set_seconds(copy.seconds);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, impl_->rpc_timeout_ms);
  v1::CommitResponse resp;
  Status st = FromGrpc(impl_->stub->Commit(&ctx, req, &resp), impl_->grpc_socket);
  if (!st.ok()) return st;
  return CommitInfo{resp.committed_bytes(), resp.returned_bytes()};
}

Result<Placement> Client::Prefetch(uint64_t group_id) {
  v1::PrefetchRequest req;
  FillCredentials(req.mutable_session(), impl_->reply.session_id, impl_->reply.session_token);
  req.set_group_id(group_id);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, impl_->rpc_timeout_ms);
  v1::PrefetchResponse resp;
  Status st = FromGrpc(impl_->stub->Prefetch(&ctx, req, &resp), impl_->grpc_socket);
  if (!st.ok()) return st;
  return Placement{FromProto(resp.extents()), resp.used_bytes()};
}

Status Client::Release(uint64_t group_id, const CopyStats& copy) {
  v1::ReleaseRequest req;
  FillCredentials(req.mutable_session(), impl_->reply.session_id, impl_->reply.session_token);
  req.set_group_id(group_id);
  req.mutable_copy()->set_bytes(copy.bytes);
  req.mutable_copy()->set_seconds(copy.seconds);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, impl_->rpc_timeout_ms);
  v1::ReleaseResponse resp;
  return FromGrpc(impl_->stub->Release(&ctx, req, &resp), impl_->grpc_socket);
}

Status Client::Write(const std::vector<Extent>& extents, uint64_t offset, const void* src,
                     uint64_t length) {
  const uint8_t* in = static_cast<const uint8_t*>(src);
  return impl_->ForEachPiece(extents, offset, length, [&](uint8_t* p, uint64_t at, uint64_t n) {
    std::memcpy(p, in + at, n);
  });
}

Status Client::Read(const std::vector<Extent>& extents, uint64_t offset, void* dst,
                    uint64_t length) const {
  uint8_t* out = static_cast<uint8_t*>(dst);
  return impl_->ForEachPiece(extents, offset, length, [&](uint8_t* p, uint64_t at, uint64_t n) {
    std::memcpy(out + at, p, n);
  });
}

uint8_t* Client::Address(const Extent& extent) const { return impl_->Locate(extent); }
uint64_t Client::session_id() const { return impl_->reply.session_id; }
uint64_t Client::page_bytes() const { return impl_->reply.page_bytes; }
uint64_t Client::session_limit_bytes() const { return impl_->reply.session_limit_bytes; }
uint32_t Client::chunk_count() const { return static_cast<uint32_t>(impl_->chunks.size()); }
const std::string& Client::runtime_dir() const { return impl_->runtime_dir; }

}  // namespace memoffload::client
