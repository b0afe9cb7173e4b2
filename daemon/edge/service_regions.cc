// OffloadService's checkpoint-region methods: request shape checks, then
// SessionTable (session_table_regions.cc) decides. gRPC calls the callback
// versions, which answer at once with the synchronous ones (service.h).
#include <cmath>

#include "edge/service.h"

namespace memoffload::daemon {
namespace {

using Clock = std::chrono::steady_clock;

// ttl_seconds from the wire: finite, not negative, at most 30 days.
Result<std::chrono::milliseconds> TtlOf(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0 ||
      seconds > static_cast<double>(kMaxRegionTtlMs) / 1000) {
    return InvalidArgument("ttl_seconds must be between 0 (the daemon's regions.ttl) and " +
                           std::to_string(kMaxRegionTtlMs / 1000) + " seconds");
  }
  const auto ms = static_cast<int64_t>(std::ceil(seconds * 1000));
  return std::chrono::milliseconds(seconds > 0 && ms == 0 ? 1 : ms);
}

void FillInfo(const RegionSnapshot& r, v1::RegionInfo* out) {
  out->set_name(r.name);
  out->set_uid(r.uid);
  out->set_job_id(r.job_id);
  out->set_state(RegionStateName(r.state));
  out->set_used_bytes(r.used_bytes);
  out->set_held_bytes(r.held_bytes);
  out->set_committed_unix(r.committed_unix);
  out->set_expires_in_seconds(r.expires_in_seconds);
  out->set_ttl_seconds(r.ttl_seconds);
  out->set_checksummed(r.checksummed);
  out->set_readers(r.readers);
}

}  // namespace

grpc::ServerUnaryReactor* OffloadService::CreateRegion(grpc::CallbackServerContext* ctx,
                                                       const v1::CreateRegionRequest* req,
                                                       v1::CreateRegionResponse* resp) {
  return Answered(ctx, CreateRegion(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

grpc::ServerUnaryReactor* OffloadService::CommitRegion(grpc::CallbackServerContext* ctx,
                                                       const v1::CommitRegionRequest* req,
                                                       v1::CommitRegionResponse* resp) {
  return Answered(ctx, CommitRegion(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

grpc::ServerUnaryReactor* OffloadService::OpenRegion(grpc::CallbackServerContext* ctx,
                                                     const v1::OpenRegionRequest* req,
                                                     v1::OpenRegionResponse* resp) {
  return Answered(ctx, OpenRegion(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

grpc::ServerUnaryReactor* OffloadService::CloseRegion(grpc::CallbackServerContext* ctx,
                                                      const v1::CloseRegionRequest* req,
                                                      v1::CloseRegionResponse* resp) {
  return Answered(ctx, CloseRegion(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

grpc::ServerUnaryReactor* OffloadService::DeleteRegion(grpc::CallbackServerContext* ctx,
                                                       const v1::DeleteRegionRequest* req,
                                                       v1::DeleteRegionResponse* resp) {
  return Answered(ctx, DeleteRegion(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

grpc::ServerUnaryReactor* OffloadService::ListRegions(grpc::CallbackServerContext* ctx,
                                                      const v1::ListRegionsRequest* req,
                                                      v1::ListRegionsResponse* resp) {
  return Answered(ctx, ListRegions(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

grpc::Status OffloadService::CreateRegion(grpc::ServerContext*, const v1::CreateRegionRequest* req,
                                          v1::CreateRegionResponse* resp) {
  const auto start = Clock::now();
  Status st = CheckCredentials(req->session(), req->has_session());
  Result<std::chrono::milliseconds> ttl = TtlOf(req->ttl_seconds());
  if (st.ok() && !ttl.ok()) st = ttl.status();
  if (st.ok()) {
    Result<ReserveResult> r =
        table_->CreateRegion(req->session().session_id(), req->session().session_token(),
                             req->name(), req->size_bytes(), *ttl);
    if (r.ok()) {
      CopyExtents(r->extents, resp->mutable_extents());
      resp->set_reserved_bytes(r->reserved_bytes);
    } else {
      st = r.status();
    }
  }
  return Finish(Method::kCreateRegion, start, st);
}

grpc::Status OffloadService::CommitRegion(grpc::ServerContext*, const v1::CommitRegionRequest* req,
                                          v1::CommitRegionResponse* resp) {
  const auto start = Clock::now();
  Status st = CheckCredentials(req->session(), req->has_session());
  if (st.ok()) {
    Result<CommitResult> r = table_->CommitRegion(
        req->session().session_id(), req->session().session_token(), req->name(), req->used_bytes(),
        {req->extent_crc32c().begin(), req->extent_crc32c().end()}, req->rename_to());
    if (r.ok()) {
      resp->set_committed_bytes(r->committed_bytes);
      resp->set_returned_bytes(r->returned_bytes);
    } else {
      st = r.status();
    }
  }
  return Finish(Method::kCommitRegion, start, st);
}

grpc::Status OffloadService::OpenRegion(grpc::ServerContext*, const v1::OpenRegionRequest* req,
                                        v1::OpenRegionResponse* resp) {
  const auto start = Clock::now();
  Status st = CheckCredentials(req->session(), req->has_session());
  if (st.ok()) {
    Result<PrefetchResult> r = table_->OpenRegion(req->session().session_id(),
                                                  req->session().session_token(), req->name());
    if (r.ok()) {
      CopyExtents(r->extents, resp->mutable_extents());
      resp->set_used_bytes(r->used_bytes);
      for (uint32_t crc : r->extent_crc32c) resp->add_extent_crc32c(crc);
    } else {
      st = r.status();
    }
  }
  return Finish(Method::kOpenRegion, start, st);
}

grpc::Status OffloadService::CloseRegion(grpc::ServerContext*, const v1::CloseRegionRequest* req,
                                         v1::CloseRegionResponse*) {
  const auto start = Clock::now();
  Status st = CheckCredentials(req->session(), req->has_session());
  if (st.ok()) {
    st = table_->CloseRegion(req->session().session_id(), req->session().session_token(),
                             req->name());
  }
  return Finish(Method::kCloseRegion, start, st);
}

grpc::Status OffloadService::DeleteRegion(grpc::ServerContext*, const v1::DeleteRegionRequest* req,
                                          v1::DeleteRegionResponse* resp) {
  const auto start = Clock::now();
  Result<uint64_t> freed = InvalidArgument("");
  if (req->has_session()) {
    Status st = CheckCredentials(req->session(), true);
    if (!st.ok()) return Finish(Method::kDeleteRegion, start, st);
    freed = table_->DeleteRegion(req->session().session_id(), req->session().session_token(),
                                 req->name());
  } else if (!req->admin_token().empty()) {
    if (!ConstantTimeEquals(req->admin_token(), info_.admin_token)) {
      return Finish(
          Method::kDeleteRegion, start,
          PermissionDenied("admin token does not match; read it from " + info_.runtime_dir +
                           "/admin.token (root or the daemon's user only)"));
    }
    freed = table_->DeleteRegionOf(req->uid(), req->job_id(), req->name());
  } else {
    return Finish(Method::kDeleteRegion, start,
                  InvalidArgument("DeleteRegion needs a session, or the admin token with uid and "
                                  "job_id"));
  }
  if (freed.ok()) resp->set_freed_bytes(*freed);
  return Finish(Method::kDeleteRegion, start, freed.status());
}

grpc::Status OffloadService::ListRegions(grpc::ServerContext*, const v1::ListRegionsRequest* req,
                                         v1::ListRegionsResponse* resp) {
  const auto start = Clock::now();
  std::vector<RegionSnapshot> regions;
  if (req->has_session()) {
    Status st = CheckCredentials(req->session(), true);
    if (!st.ok()) return Finish(Method::kListRegions, start, st);
    Result<std::vector<RegionSnapshot>> r = table_->ListRegions(
        req->session().session_id(), req->session().session_token(), req->prefix());
    if (!r.ok()) return Finish(Method::kListRegions, start, r.status());
    regions = std::move(r).value();
  } else {
    regions = table_->ListAllRegions(req->prefix());
  }
  constexpr size_t kMaxListed = 512;  // 255-byte names: about 160 KiB
  for (size_t i = 0; i < regions.size() && i < kMaxListed; ++i) {
    FillInfo(regions[i], resp->add_regions());
  }
  if (regions.size() > kMaxListed) {
    resp->set_omitted(static_cast<uint32_t>(regions.size() - kMaxListed));
  }
  return Finish(Method::kListRegions, start, Status::Ok());
}

}  // namespace memoffload::daemon
