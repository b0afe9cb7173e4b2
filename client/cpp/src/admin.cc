#include "memoffload/client/admin.h"

#include <fcntl.h>
#include <unistd.h>

#include "daemon_channel.h"
#include "grpc_util.h"
#include "memoffload/client/daemon_status.h"
#include "memoffload/client/daemon_trust.h"
#include "memoffload/common/runtime_dir.h"
#include "memoffload/v1/memoffload.grpc.pb.h"

namespace memoffload::client {

class AdminClient::Impl {
 public:
  std::string runtime_dir;  // as discovered
  int timeout_ms = 5000;
  std::unique_ptr<DaemonChannel> channel;

  // One unary call with the admin deadline; gRPC's status as ours.
  template <typename Request, typename Response>
  Status Call(grpc::Status (v1::Offload::Stub::*method)(grpc::ClientContext*, const Request&,
                                                        Response*),
              const Request& req, Response* resp) {
    Result<std::shared_ptr<v1::Offload::Stub>> stub = channel->Stub();
    if (!stub.ok()) return stub.status();
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_ms);
    const grpc::Status st = ((**stub).*method)(&ctx, req, resp);
    if (TransportFailed(st)) channel->Failed(*stub);
    return FromGrpc(st, channel->socket_path());
  }
};

AdminClient::AdminClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AdminClient::~AdminClient() = default;

Result<std::unique_ptr<AdminClient>> AdminClient::Connect(const std::string& runtime_dir,
                                                          int timeout_ms) {
  auto impl = std::make_unique<Impl>();
  Result<TrustedRuntimeDir> dir = DiscoverTrustedRuntimeDir(runtime_dir, kGrpcSocketName);
  if (!dir.ok()) return dir.status();
  impl->runtime_dir = dir->path;
  impl->timeout_ms = timeout_ms;
  Result<std::unique_ptr<DaemonChannel>> channel = DaemonChannel::Open(*dir);
  if (!channel.ok()) return channel.status();
  impl->channel = std::move(channel).value();
  return std::unique_ptr<AdminClient>(new AdminClient(std::move(impl)));
}

Result<v1::GetStatusResponse> AdminClient::GetStatus() {
  v1::GetStatusResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::GetStatus, v1::GetStatusRequest(), &resp);
  if (!st.ok()) return st;
  return resp;
}

Result<v1::ListSessionsResponse> AdminClient::ListSessions() {
  v1::ListSessionsResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::ListSessions, v1::ListSessionsRequest(), &resp);
  if (!st.ok()) return st;
  return resp;
}

Result<v1::GetConfigResponse> AdminClient::GetConfig() {
  v1::GetConfigResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::GetConfig, v1::GetConfigRequest(), &resp);
  if (!st.ok()) return st;
  return resp;
}

Result<std::string> AdminClient::ReadAdminToken() {
  // Read from the dir as verified, by its resolved path, never through a
  // symlink in it.
  const std::string token_path = impl_->channel->dir().resolved + "/admin.token";
  std::string token;
  const int fd = open(token_path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) {
    char buf[256];
    const ssize_t n = read(fd, buf, sizeof(buf));
    close(fd);
    if (n > 0) token.assign(buf, static_cast<size_t>(n));
    token = token.substr(0, token.find('\n'));
  }
  if (token.empty()) {
    // A clean stop deletes the token: tell "not running" from "not allowed".
    Result<v1::GetStatusResponse> probe = GetStatus();
    if (!probe.ok() && (probe.status().code() == StatusCode::kUnavailable ||
                        probe.status().code() == StatusCode::kDeadlineExceeded)) {
      return Unavailable(probe.status().message() + " (no readable admin token at " + token_path +
                         " either)");
    }
    return PermissionDenied("cannot read the admin token " + token_path +
                            " (run as root or as the daemon's user)");
  }
  return token;
}

Result<v1::DrainResponse> AdminClient::Drain(bool drain) {
  Result<std::string> token = ReadAdminToken();
  if (!token.ok()) return token.status();
  v1::DrainRequest req;
  req.set_admin_token(*token);
  req.set_drain(drain);
  v1::DrainResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::Drain, req, &resp);
  if (!st.ok()) return st;
  return resp;
}

Result<v1::ListRegionsResponse> AdminClient::ListRegions(const std::string& prefix) {
  v1::ListRegionsRequest req;
  req.set_prefix(prefix);
  v1::ListRegionsResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::ListRegions, req, &resp);
  if (!st.ok()) return st;
  return resp;
}

Result<v1::DeleteRegionResponse> AdminClient::DeleteRegion(uint32_t uid, const std::string& job_id,
                                                           const std::string& name) {
  Result<std::string> token = ReadAdminToken();
  if (!token.ok()) return token.status();
  v1::DeleteRegionRequest req;
  req.set_admin_token(*token);
  req.set_uid(uid);
  req.set_job_id(job_id);
  req.set_name(name);
  v1::DeleteRegionResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::DeleteRegion, req, &resp);
  if (!st.ok()) return st;
  return resp;
}

const std::string& AdminClient::socket_path() const { return impl_->channel->socket_path(); }

}  // namespace memoffload::client

namespace memoffload::client {

Result<DaemonStatus> QueryDaemonStatus(const std::string& runtime_dir, int timeout_ms) {
  Result<std::unique_ptr<AdminClient>> admin = AdminClient::Connect(runtime_dir, timeout_ms);
  if (!admin.ok()) return admin.status();
  Result<v1::GetStatusResponse> r = (*admin)->GetStatus();
  if (!r.ok()) return r.status();
  DaemonStatus s;
  s.version = r->version();
  s.runtime_dir = r->runtime_dir();
  s.capacity_bytes = r->capacity_bytes();
  s.used_bytes = r->used_bytes();
  s.free_bytes = r->free_bytes();
  s.reserved_bytes = r->reserved_bytes();
  s.committed_bytes = r->committed_bytes();
  s.read_bytes = r->read_bytes();
  s.largest_free_extent_bytes = r->largest_free_extent_bytes();
  s.chunks = r->chunks();
  s.chunk_size_bytes = r->chunk_size_bytes();
  s.sessions = r->sessions();
  s.groups = r->groups();
  s.draining = r->draining();
  s.state_blocks = r->state_blocks();
  s.state_bytes = r->state_bytes();
  s.hugetlb_bytes = r->hugetlb_bytes();
  s.thp_bytes = r->thp_bytes();
  s.pages = r->pages();
  return s;
}

Result<NodeRegions> QueryNodeRegions(const std::string& runtime_dir, const std::string& prefix,
                                     int timeout_ms) {
  Result<std::unique_ptr<AdminClient>> admin = AdminClient::Connect(runtime_dir, timeout_ms);
  if (!admin.ok()) return admin.status();
  Result<v1::ListRegionsResponse> r = (*admin)->ListRegions(prefix);
  if (!r.ok()) return r.status();
  NodeRegions out;
  out.omitted = r->omitted();
  out.regions.reserve(static_cast<size_t>(r->regions_size()));
  for (const v1::RegionInfo& info : r->regions()) {
    out.regions.push_back(NodeRegion{info.name(), info.uid(), info.job_id(),
                                     info.state() == "committed", info.committed_unix()});
  }
  return out;
}

}  // namespace memoffload::client
