#include "memoffload/client/client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>
#include <utility>

#include "client_impl.h"
#include "grpc_util.h"
#include "memoffload/client/daemon_trust.h"
#include "memoffload/client/log.h"
#include "memoffload/common/crc32c.h"
#include "memoffload/common/runtime_dir.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/chunk.h"
#include "memoffload/shared_mem/fd_passing.h"
#include "memoffload/v1/memoffload.grpc.pb.h"

namespace memoffload::client {
namespace {

std::string Hex16(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

// One log line (log.h) when this process first attaches to the daemon of a
// runtime directory (info), and when that daemon is another instance than
// last time (a warning: it restarted). Kept per runtime directory: a process
// that talks to two daemons (tests, or two arenas) is not told that either
// restarted.
void LogInstance(const std::string& runtime_dir, uint64_t instance_id, uint64_t session_id,
                 int rank) {
  static absl::Mutex mu;
  static std::map<std::string, uint64_t> last ABSL_GUARDED_BY(mu);
  uint64_t before = 0;
  {
    absl::MutexLock lock(&mu);
    before = std::exchange(last[runtime_dir], instance_id);
  }
  if (before == instance_id) return;
  const std::string session =
      "session " + std::to_string(session_id) + " on memoffloadd instance " + Hex16(instance_id);
  if (before == 0) {
    Log(LogLevel::kInfo, StatusCode::kOk, session + " (" + runtime_dir + ")", rank);
  } else {
    Log(LogLevel::kWarning, StatusCode::kOk,
        session + " (was " + Hex16(before) + ": the daemon of " + runtime_dir + " restarted)",
        rank);
  }
}

}  // namespace

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

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::Attach(const AttachOptions& options) {
  auto impl = std::make_unique<Impl>();
  // The daemon is verified before it is sent a byte (daemon_trust.h): the
  // runtime dir, its broker socket, then who answers on it.
  Result<TrustedRuntimeDir> dir = DiscoverTrustedRuntimeDir(options.runtime_dir, kBrokerSocketName);
  if (!dir.ok()) return dir.status();
  impl->runtime_dir = dir->path;
  impl->rpc_timeout_ms = options.rpc_timeout_ms;
  impl->rank = options.rank;
  Result<int> fd = ConnectVerified(*dir, kBrokerSocketName);
  if (!fd.ok()) return fd.status();
  impl->lifeline_fd = *fd;

  Hello hello;
  hello.job_id = options.job_id;
  hello.rank = options.rank;
  hello.local_rank = options.local_rank;
  hello.max_bytes = options.max_bytes;
  hello.job_max_bytes = options.job_max_bytes;
  hello.kind = options.kind;
  // The daemon refuses some connections before it reads a hello (its
  // connection caps): it sends the reason and closes at once, so the hello
  // may meet a closed socket. The reply below still says why.
  const Status sent = SendFrame(impl->lifeline_fd, EncodeHello(hello));

  // A daemon answers once its arena is built (the broker listens before):
  // the attach waits for that at most the RPC timeout, and so for every
  // frame of the reply (a stopped daemon must not hang its clients).
  const int wait_ms = std::max(options.rpc_timeout_ms, 1);
  pollfd answer{impl->lifeline_fd, POLLIN, 0};
  int polled = 0;
  do {
    polled = poll(&answer, 1, wait_ms);
  } while (polled < 0 && errno == EINTR);
  if (polled == 0) {
    return Unavailable("memoffloadd at " + impl->runtime_dir +
                       " accepted the attach but did not answer within " + std::to_string(wait_ms) +
                       " ms (still building its arena, or stopped)");
  }
  timeval frame_wait{wait_ms / 1000, (wait_ms % 1000) * 1000};
  setsockopt(impl->lifeline_fd, SOL_SOCKET, SO_RCVTIMEO, &frame_wait, sizeof(frame_wait));
  std::string payload;
  std::vector<int> fds;
  if (Status st = RecvFrame(impl->lifeline_fd, &payload, &fds); !st.ok()) {
    CloseFds(&fds);
    if (!sent.ok()) return sent;
    return Unavailable("attach to memoffloadd failed: " + st.message());
  }
  CloseFds(&fds);  // the reply itself carries none
  Result<AttachReply> reply = DecodeAttachReply(payload);
  if (!reply.ok()) return reply.status();
  if (reply->code != StatusCode::kOk) {
    return Status(reply->code, "memoffloadd refused the attach: " + reply->message);
  }
  if (!sent.ok()) return sent;  // a grant for a hello that was never sent
  impl->reply = std::move(reply).value();
  impl->populate = options.populate;
  impl->checksums = options.checksums;
  LogInstance(impl->runtime_dir, impl->reply.instance_id, impl->reply.session_id, options.rank);
  impl->populate_on_first_use = options.populate_on_first_use && !options.populate;
  impl->first_block.reserve(impl->reply.chunks.size());
  uint64_t blocks = 0;
  for (const auto& c : impl->reply.chunks) {
    impl->first_block.push_back(blocks);
    blocks += (c.size_bytes + Impl::kPopulateBlockBytes - 1) / Impl::kPopulateBlockBytes;
  }
  impl->block_state = std::make_unique<std::atomic<uint8_t>[]>(blocks);  // zeroed: unmapped
  impl->bases = std::make_unique<std::atomic<uint8_t*>[]>(impl->reply.chunks.size());
  for (size_t i = 0; i < impl->reply.chunks.size(); ++i) impl->bases[i].store(nullptr);
  absl::MutexLock lock(&impl->map_mu);
  impl->chunks.resize(impl->reply.chunks.size());
  impl->generations.assign(impl->reply.chunks.size(), 0);
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
    MEMOFFLOAD_RETURN_IF_ERROR(impl->MapReceived(batch->chunk_indexes, batch->generations, &fds));
  }
  // Later exchanges on the lifeline wait as long as they need (a chunk
  // request is answered from the daemon's event loop).
  timeval no_wait_limit{0, 0};
  setsockopt(impl->lifeline_fd, SOL_SOCKET, SO_RCVTIMEO, &no_wait_limit, sizeof(no_wait_limit));
  // The gRPC socket of the verified dir, never a path the broker names,
  // reached as the broker was (DaemonChannel).
  Result<std::unique_ptr<DaemonChannel>> channel = DaemonChannel::Open(*dir);
  if (!channel.ok()) return channel.status();
  impl->channel = std::move(channel).value();
  impl->StartWatching();
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Result<Reservation> Client::Reserve(uint64_t group_id, uint64_t size_bytes,
                                    const ReserveOptions& options) {
  v1::ReserveRequest req;
  req.set_group_id(group_id);
  req.set_size_bytes(size_bytes);
  req.set_single_extent(options.single_extent);
  req.set_wait_for_space(options.wait_for_space);
  v1::ReserveResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::Reserve, &req, &resp,
                          options.wait_for_space ? options.wait_timeout_ms : 0);
  if (!st.ok()) return impl_->SessionGoneOr(st);
  Reservation reservation{FromProto(resp.extents()), resp.reserved_bytes()};
  if (Status mapped = impl_->EnsureMapped(Impl::ChunksOf(reservation.extents)); !mapped.ok()) {
    Status ignored = Release(group_id);
    (void)ignored;  // best effort: the mapping error is the answer; the session reclaims the group
    return mapped;
  }
  {
    absl::MutexLock lock(&impl_->groups_mu);
    impl_->reserved[group_id] = reservation.extents;
    impl_->committed.erase(group_id);
  }
  return reservation;
}

Result<CommitInfo> Client::Commit(uint64_t group_id, uint64_t used_bytes, const CopyStats& copy) {
  v1::CommitRequest req;
  req.set_group_id(group_id);
  req.set_used_bytes(used_bytes);
  req.mutable_copy()->set_bytes(copy.bytes);
  req.mutable_copy()->set_seconds(copy.seconds);
  std::vector<Extent> extents;
  {
    absl::MutexLock lock(&impl_->groups_mu);
    // Kept until the Commit succeeds: a refused Commit may be retried.
    auto it = impl_->reserved.find(group_id);
    if (it != impl_->reserved.end()) extents = it->second;
  }
  if (impl_->checksums) {
    Result<std::vector<uint32_t>> crcs = impl_->ExtentChecksums(extents, used_bytes);
    if (!crcs.ok()) {
      return Status(crcs.status().code(),
                    "commit of group " + std::to_string(group_id) + ": " + crcs.status().message());
    }
    for (uint32_t crc : *crcs) req.add_extent_crc32c(crc);
  }
  v1::CommitResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::Commit, &req, &resp);
  if (!st.ok()) return impl_->SessionGoneOr(st);
  {
    absl::MutexLock lock(&impl_->groups_mu);
    impl_->reserved.erase(group_id);
    impl_->committed[group_id] = Placement{
        std::move(extents), used_bytes, {req.extent_crc32c().begin(), req.extent_crc32c().end()}};
  }
  return CommitInfo{resp.committed_bytes(), resp.returned_bytes()};
}

Result<Placement> Client::Prefetch(uint64_t group_id) {
  v1::PrefetchRequest req;
  req.set_group_id(group_id);
  v1::PrefetchResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::Prefetch, &req, &resp);
  Placement placement;
  if (st.ok()) {
    placement = Placement{FromProto(resp.extents()),
                          resp.used_bytes(),
                          {resp.extent_crc32c().begin(), resp.extent_crc32c().end()}};
    MEMOFFLOAD_RETURN_IF_ERROR(impl_->EnsureMapped(Impl::ChunksOf(placement.extents)));
  } else {
    // The daemon that held this session is gone: a group committed in it is
    // still in this process's mapping, which nobody else can reach now (a
    // restarted daemon has new memfds), so it is read from there.
    st = impl_->SessionGoneOr(st);
    if (!impl_->Lost() || !impl_->InstanceGone()) return st;
    absl::MutexLock lock(&impl_->groups_mu);
    auto it = impl_->committed.find(group_id);
    if (it == impl_->committed.end()) return st;
    placement = it->second;
  }
  if (impl_->checksums) {
    MEMOFFLOAD_RETURN_IF_ERROR(
        impl_->Verify(placement, "group " + std::to_string(group_id) + " of session " +
                                     std::to_string(impl_->reply.session_id)));
  }
  return placement;
}

Status Client::Release(uint64_t group_id, const CopyStats& copy) {
  {
    absl::MutexLock lock(&impl_->groups_mu);
    impl_->reserved.erase(group_id);
  }
  v1::ReleaseRequest req;
  req.set_group_id(group_id);
  req.mutable_copy()->set_bytes(copy.bytes);
  req.mutable_copy()->set_seconds(copy.seconds);
  {
    absl::MutexLock lock(&impl_->groups_mu);
    impl_->committed.erase(group_id);
  }
  v1::ReleaseResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::Release, &req, &resp);
  // A session that is gone holds nothing: its groups went with it.
  if (!st.ok() && impl_->SessionGone()) return Status::Ok();
  return st;
}

Status Client::Write(const std::vector<Extent>& extents, uint64_t offset, const void* src,
                     uint64_t length) {
  const uint8_t* in = static_cast<const uint8_t*>(src);
  return ForEachPiece(extents, offset, length, [&](uint8_t* p, uint64_t at, uint64_t n) {
    std::memcpy(p, in + at, n);
    return Status::Ok();
  });
}

Status Client::Read(const std::vector<Extent>& extents, uint64_t offset, void* dst,
                    uint64_t length) const {
  uint8_t* out = static_cast<uint8_t*>(dst);
  return ForEachPiece(extents, offset, length, [&](uint8_t* p, uint64_t at, uint64_t n) {
    std::memcpy(out + at, p, n);
    return Status::Ok();
  });
}

Status Client::ForEachPiece(const std::vector<Extent>& extents, uint64_t offset, uint64_t length,
                            const PieceFn& fn) const {
  uint64_t pos = 0;  // stream position of the current extent's start
  uint64_t done = 0;
  for (const Extent& e : extents) {
    if (done == length) break;
    uint8_t* base = impl_->Locate(e);
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
      impl_->PopulateRange(e.chunk, e.offset + in_extent, n);
      MEMOFFLOAD_RETURN_IF_ERROR(fn(base + in_extent, done, n));
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

uint8_t* Client::Address(const Extent& extent) const {
  uint8_t* p = impl_->Locate(extent);
  if (p != nullptr) impl_->PopulateRange(extent.chunk, extent.offset, extent.length);
  return p;
}

Status Client::MapChunks(const std::vector<uint32_t>& chunks) {
  return impl_->EnsureMapped(chunks);
}
uint64_t Client::session_id() const { return impl_->reply.session_id; }
uint64_t Client::instance_id() const { return impl_->reply.instance_id; }
bool Client::session_lost() const { return impl_->SessionGone(); }
uint64_t Client::resumes() const { return impl_->resumed.load(); }
bool Client::leave_requested() const {
  if (impl_->leave.load()) return true;
  absl::MutexLock lock(&impl_->map_mu);
  impl_->ReadNotices();
  return impl_->leave.load();
}
std::string Client::leave_message() const {
  absl::MutexLock lock(&impl_->map_mu);
  return impl_->leave_message;
}
uint64_t Client::chunk_generation(uint32_t chunk) const {
  absl::MutexLock lock(&impl_->map_mu);
  return chunk < impl_->generations.size() ? impl_->generations[chunk] : 0;
}
uint64_t Client::page_bytes() const { return impl_->reply.page_bytes; }
uint64_t Client::session_limit_bytes() const { return impl_->reply.session_limit_bytes; }
uint32_t Client::chunk_count() const { return static_cast<uint32_t>(impl_->reply.chunks.size()); }
uint64_t Client::chunk_size_bytes(uint32_t chunk) const {
  return chunk < impl_->reply.chunks.size() ? impl_->reply.chunks[chunk].size_bytes : 0;
}
const std::string& Client::runtime_dir() const { return impl_->runtime_dir; }

Result<Client::LinkKeys> Client::ReplicationKeys() {
  absl::MutexLock lock(&impl_->map_mu);  // one exchange on the broker connection at a time
  impl_->ReadNotices();
  MEMOFFLOAD_RETURN_IF_ERROR(SendFrame(impl_->lifeline_fd, EncodeLinkKeyRequest({})));
  std::string payload;
  std::vector<int> fds;
  if (Status st = impl_->RecvReply(&payload, &fds); !st.ok()) {
    CloseFds(&fds);
    return Unavailable("memoffloadd broker connection lost: " + st.message());
  }
  CloseFds(&fds);  // a key reply carries none
  Result<LinkKeyReply> reply = DecodeLinkKeyReply(payload);
  if (!reply.ok()) return reply.status();
  if (reply->code != StatusCode::kOk) return Status(reply->code, reply->message);
  if (reply->keys.empty()) return Internal("memoffloadd sent no replication key");
  for (const std::string& key : reply->keys) {
    if (key.size() != 32) return Internal("memoffloadd sent a replication key of the wrong size");
  }
  return LinkKeys{std::move(reply->key_ids), std::move(reply->keys)};
}

}  // namespace memoffload::client
