#include "edge/service.h"

#include <algorithm>
#include <future>
#include <optional>
#include <string>

#include "base/log.h"
#include "memoffload/common/runtime_dir.h"

namespace memoffload::daemon {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

grpc::ServerUnaryReactor* Answered(grpc::CallbackServerContext* ctx, const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

Status CheckCredentials(const v1::SessionCredentials& creds, bool has_session) {
  if (!has_session || creds.session_id() == 0) {
    return InvalidArgument("request carries no session id; attach first");
  }
  if (creds.session_token().empty()) {
    return Unauthenticated("request carries no session token");
  }
  return Status::Ok();
}

void CopyExtents(const Extent* in, size_t count,
                 google::protobuf::RepeatedPtrField<v1::Extent>* out) {
  out->Reserve(static_cast<int>(count));
  for (const Extent* e = in; e != in + count; ++e) {
    v1::Extent* x = out->Add();
    x->set_chunk(e->chunk);
    x->set_offset(e->offset);
    x->set_length(e->length);
  }
}

grpc::Status ToGrpc(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message(),
                      kDaemonStatusDetails);
}

OffloadService::OffloadService(const Arena* arena, SessionTable* table, Metrics* metrics,
                               ServiceInfo info, const DaemonConfig& config)
    : arena_(arena),
      table_(table),
      metrics_(metrics),
      info_(std::move(info)),
      metrics_address_(info_.metrics_address),
      started_(Clock::now()),
      config_(config) {}

void OffloadService::SetConfig(const DaemonConfig& config) {
  absl::MutexLock lock(&config_mu_);
  config_ = config;
}

grpc::Status OffloadService::Finish(Method method, Clock::time_point start, const Status& status) {
  metrics_->RecordRequest(method, status.code(),
                          std::chrono::duration<double>(Clock::now() - start).count());
  return ToGrpc(status);
}

namespace {

// A Reserve that may wait (wait_for_space). gRPC calls OnCancel when its
// caller cancels or goes away, or its deadline passes: the waiter then
// leaves the queue at once (SessionTable::CancelReserve answers it
// CANCELLED) instead of staying queued until its deadline or
// quotas.max_wait, and, once aged, keeping its bytes free from other
// tenants all that time. gRPC calls OnCancel and OnDone only after the
// handler returned the reactor, and OnDone last; ticket_ has a mutex all the
// same (ThreadSanitizer does not see gRPC's own ordering, tests/sanitizers/
// tsan.supp).
class WaitingReserve final : public grpc::ServerUnaryReactor {
 public:
  explicit WaitingReserve(SessionTable* table) : table_(table) {}

  // The handler's: the table's ticket while the reserve waits, 0 once
  // answered.
  void Started(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    ticket_ = ticket;
  }

  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_) {
    uint64_t ticket;
    {
      absl::MutexLock lock(&mu_);
      ticket = ticket_;
    }
    if (ticket != 0) table_->CancelReserve(ticket);  // a no-op once it was answered
  }

  void OnDone() override { delete this; }

 private:
  SessionTable* const table_;
  absl::Mutex mu_;
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

grpc::ServerUnaryReactor* OffloadService::Reserve(grpc::CallbackServerContext* ctx,
                                                  const v1::ReserveRequest* req,
                                                  v1::ReserveResponse* resp) {
  // A caller that goes away is also noticed through IsCancelled before its
  // waiter would be granted (the context lives until Finish).
  auto cancelled = [ctx] { return ctx->IsCancelled(); };
  if (!req->wait_for_space()) {
    // Answered before the handler returns: gRPC's own reactor (no
    // allocation, nothing of ours crosses threads).
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    StartReserve(
        *req, resp, ctx->deadline(), [reactor](grpc::Status st) { reactor->Finish(st); },
        cancelled);
    return reactor;
  }
  auto* call = new WaitingReserve(table_);
  call->Started(StartReserve(
      *req, resp, ctx->deadline(), [call](grpc::Status st) { call->Finish(st); }, cancelled));
  return call;
}

grpc::Status OffloadService::ReserveAndWait(const v1::ReserveRequest& req,
                                            v1::ReserveResponse* resp,
                                            std::chrono::system_clock::time_point deadline) {
  std::promise<grpc::Status> answer;
  std::future<grpc::Status> future = answer.get_future();
  StartReserve(req, resp, deadline, [&answer](grpc::Status st) { answer.set_value(st); });
  return future.get();
}

uint64_t OffloadService::StartReserve(const v1::ReserveRequest& req, v1::ReserveResponse* resp,
                                      std::chrono::system_clock::time_point deadline,
                                      std::function<void(grpc::Status)> done,
                                      std::function<bool()> cancelled) {
  const auto start = Clock::now();
  Status st = CheckCredentials(req.session(), req.has_session());
  if (!st.ok()) {
    done(Finish(Method::kReserve, start, st));
    return 0;
  }
  std::optional<Clock::time_point> wait_until;
  if (req.wait_for_space()) {
    // The call's deadline, capped by quotas.max_wait: nothing waits forever.
    uint64_t max_wait_ms;
    {
      absl::MutexLock lock(&config_mu_);
      max_wait_ms = config_.policy.max_wait_ms;
    }
    wait_until = start + std::chrono::milliseconds(max_wait_ms);
    if (deadline != std::chrono::system_clock::time_point::max()) {
      // Answer a margin before the caller's deadline so it sees why:
      // a tenth of the time left, within 20 ms..1 s (room to answer
      // many waiters that expire together).
      const auto left =
          std::chrono::duration_cast<Clock::duration>(deadline - std::chrono::system_clock::now());
      const Clock::duration margin = std::clamp<Clock::duration>(
          left / 10, std::chrono::milliseconds(20), std::chrono::seconds(1));
      wait_until = std::min(*wait_until, start + left - margin);
    }
  }
  const uint64_t session_id = req.session().session_id();
  return table_->ReserveAsync(
      session_id, req.session().session_token(), req.group_id(), req.size_bytes(),
      req.single_extent(), wait_until,
      [this, start, resp, session_id, done = std::move(done)](Result<ReserveResult>&& r,
                                                              RejectReason reject) {
        metrics_->RecordRejection(reject);
        if (!r.ok() &&
            (reject == RejectReason::kArenaFull || reject == RejectReason::kWaitTimeout)) {
          LogRefusal(session_id, r.status(), reject);
        }
        if (r.ok()) {
          CopyExtents(r->extents, resp->mutable_extents());
          resp->set_reserved_bytes(r->reserved_bytes);
        }
        done(Finish(Method::kReserve, start, r.ok() ? Status::Ok() : r.status()));
      },
      std::move(cancelled));
}

void OffloadService::LogRefusal(uint64_t session_id, const Status& refusal, RejectReason reason) {
  const std::optional<SessionSnapshot> s = table_->FindSession(session_id);
  if (!s.has_value()) return;  // ended meanwhile: its refusal no longer matters
  const std::optional<uint64_t> left_out =
      refusals_.Admit(std::to_string(s->peer.uid) + ":" + s->job_id, Clock::now());
  if (!left_out.has_value()) return;
  const std::string rank = s->rank >= 0 ? ", rank " + std::to_string(s->rank) : "";
  const std::string more =
      *left_out == 0 ? ""
                     : " (" + std::to_string(*left_out) +
                           " more refusals of this job since its last such line were not logged)";
  MO_LOG_WARN("Reserve refused (%s) to session %lu (pid %d, uid %u, job '%s'%s): %s%s",
              RejectReasonName(reason), static_cast<unsigned long>(session_id), s->peer.pid,
              static_cast<unsigned>(s->peer.uid), s->job_id.c_str(), rank.c_str(),
              refusal.message().c_str(), more.c_str());
}

grpc::ServerUnaryReactor* OffloadService::Commit(grpc::CallbackServerContext* ctx,
                                                 const v1::CommitRequest* req,
                                                 v1::CommitResponse* resp) {
  return Answered(ctx, DoCommit(*req, resp));
}

grpc::Status OffloadService::Commit(grpc::ServerContext*, const v1::CommitRequest* req,
                                    v1::CommitResponse* resp) {
  return DoCommit(*req, resp);
}

grpc::Status OffloadService::DoCommit(const v1::CommitRequest& request, v1::CommitResponse* resp) {
  const auto start = Clock::now();
  Status st = CheckCredentials(request.session(), request.has_session());
  if (st.ok()) {
    Result<CommitResult> r = table_->Commit(
        request.session().session_id(), request.session().session_token(), request.group_id(),
        request.used_bytes(), {request.extent_crc32c().begin(), request.extent_crc32c().end()});
    if (r.ok()) {
      resp->set_committed_bytes(r->committed_bytes);
      resp->set_returned_bytes(r->returned_bytes);
      metrics_->RecordOffload(r->series.get(), request.used_bytes());
      metrics_->RecordClientCopy(Metrics::CopyDirection::kOffload, request.copy().bytes(),
                                 request.copy().seconds());
    } else {
      st = r.status();
    }
  }
  return Finish(Method::kCommit, start, st);
}

grpc::ServerUnaryReactor* OffloadService::Prefetch(grpc::CallbackServerContext* ctx,
                                                   const v1::PrefetchRequest* req,
                                                   v1::PrefetchResponse* resp) {
  return Answered(ctx, DoPrefetch(*req, resp));
}

grpc::Status OffloadService::Prefetch(grpc::ServerContext*, const v1::PrefetchRequest* req,
                                      v1::PrefetchResponse* resp) {
  return DoPrefetch(*req, resp);
}

grpc::Status OffloadService::DoPrefetch(const v1::PrefetchRequest& request,
                                        v1::PrefetchResponse* resp) {
  const auto start = Clock::now();
  Status st = CheckCredentials(request.session(), request.has_session());
  if (st.ok()) {
    Result<PrefetchResult> r = table_->Prefetch(
        request.session().session_id(), request.session().session_token(), request.group_id());
    if (r.ok()) {
      CopyExtents(r->extents, resp->mutable_extents());
      resp->set_used_bytes(r->used_bytes);
      for (uint32_t crc : r->extent_crc32c) resp->add_extent_crc32c(crc);

      metrics_->RecordPrefetch(r->series.get(), r->used_bytes);
    } else {
      st = r.status();
    }
  }
  return Finish(Method::kPrefetch, start, st);
}

grpc::ServerUnaryReactor* OffloadService::Release(grpc::CallbackServerContext* ctx,
                                                  const v1::ReleaseRequest* req,
                                                  v1::ReleaseResponse* resp) {
  return Answered(ctx, DoRelease(*req, resp));
}

grpc::Status OffloadService::Release(grpc::ServerContext*, const v1::ReleaseRequest* req,
                                     v1::ReleaseResponse* resp) {
  return DoRelease(*req, resp);
}

grpc::Status OffloadService::DoRelease(const v1::ReleaseRequest& request,
                                       v1::ReleaseResponse* resp) {
  const auto start = Clock::now();
  Status st = CheckCredentials(request.session(), request.has_session());
  if (st.ok()) {
    Result<ReleaseResult> r = table_->Release(
        request.session().session_id(), request.session().session_token(), request.group_id());
    if (r.ok()) {
      resp->set_released_bytes(r->released_bytes);
      metrics_->RecordResidency(r->resident_seconds);
      metrics_->RecordClientCopy(Metrics::CopyDirection::kPrefetch, request.copy().bytes(),
                                 request.copy().seconds());
    } else {
      st = r.status();
    }
  }
  return Finish(Method::kRelease, start, st);
}

grpc::ServerUnaryReactor* OffloadService::GetStatus(grpc::CallbackServerContext* ctx,
                                                    const v1::GetStatusRequest* req,
                                                    v1::GetStatusResponse* resp) {
  return Answered(ctx, GetStatus(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

grpc::ServerUnaryReactor* OffloadService::ListSessions(grpc::CallbackServerContext* ctx,
                                                       const v1::ListSessionsRequest* req,
                                                       v1::ListSessionsResponse* resp) {
  return Answered(ctx, ListSessions(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

grpc::ServerUnaryReactor* OffloadService::GetConfig(grpc::CallbackServerContext* ctx,
                                                    const v1::GetConfigRequest* req,
                                                    v1::GetConfigResponse* resp) {
  return Answered(ctx, GetConfig(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

grpc::ServerUnaryReactor* OffloadService::Drain(grpc::CallbackServerContext* ctx,
                                                const v1::DrainRequest* req,
                                                v1::DrainResponse* resp) {
  return Answered(ctx, Drain(static_cast<grpc::ServerContext*>(nullptr), req, resp));
}

void OffloadService::SetMetricsAddress(const std::string& address) {
  absl::MutexLock lock(&metrics_address_mu_);
  metrics_address_ = address;
}

grpc::Status OffloadService::GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                                       v1::GetStatusResponse* resp) {
  const auto start = Clock::now();
  const ArenaSnapshot s = table_->Snapshot();
  resp->set_version(info_.version);
  resp->set_runtime_dir(info_.runtime_dir);
  {
    absl::MutexLock lock(&metrics_address_mu_);
    resp->set_metrics_address(metrics_address_);
  }
  resp->set_capacity_bytes(s.capacity_bytes);
  resp->set_used_bytes(s.capacity_bytes - s.free_bytes);
  resp->set_free_bytes(s.free_bytes);
  resp->set_reserved_bytes(s.reserved_bytes);
  resp->set_committed_bytes(s.committed_bytes);
  resp->set_read_bytes(s.read_bytes);
  resp->set_largest_free_extent_bytes(s.largest_free_extent_bytes);
  resp->set_chunks(arena_->chunk_count());
  resp->set_chunk_size_bytes(arena_->chunk_size_bytes());
  resp->set_page_bytes(arena_->page_bytes());
  resp->set_mlocked(arena_->mlocked());
  resp->set_hugetlb_bytes(arena_->hugetlb_bytes());
  resp->set_thp_bytes(arena_->thp_bytes());
  resp->set_pages(DescribeArenaPages(*arena_));
  resp->set_sessions(s.sessions);
  resp->set_groups(s.groups);
  resp->set_draining(s.draining);
  resp->set_waiting_reserves(s.waiting_reserves);
  resp->set_node_reserve_bytes(s.node_reserve_bytes);
  resp->set_owned_chunks(s.owned_chunks);
  resp->set_instance_id(info_.instance_id);
  resp->set_replaced_backings(s.replaced_backings);
  resp->set_spare_backings(s.spare_backings);
  resp->set_stale_backings(s.stale_backings);
  resp->set_stale_bytes(s.stale_bytes);
  resp->set_regions(s.regions);
  resp->set_region_bytes(s.region_bytes);
  resp->set_region_max_bytes(s.region_max_bytes);
  for (size_t k = 0; k < kSessionKindCount; ++k) {
    v1::KindUsage* kind = resp->add_kinds();
    kind->set_kind(SessionKindName(static_cast<SessionKind>(k)));
    kind->set_sessions(s.sessions_by_kind[k]);
    kind->set_held_bytes(s.held_by_kind[k]);
  }
  resp->set_state_blocks(s.state_blocks);
  resp->set_state_bytes(s.state_bytes);
  resp->set_state_share(s.state_share);
  for (const UidSnapshot& u : table_->ListUids()) {
    v1::UidUsage* out = resp->add_uids();
    out->set_uid(u.uid);
    out->set_sessions(u.sessions);
    out->set_held_bytes(u.held_bytes);
    out->set_owned_chunks(u.owned_chunks);
    out->set_region_bytes(u.region_bytes);
    out->set_regions(u.regions);
  }
  Policy policy;
  {
    absl::MutexLock lock(&config_mu_);
    policy = config_.policy;
  }
  resp->set_uid_max_bytes(policy.uid_max_bytes);
  resp->set_uid_max_chunks(policy.uid_max_chunks);
  resp->set_region_uid_max_bytes(policy.region_uid_max_bytes);
  resp->set_max_regions_per_uid(policy.max_regions_per_uid);

  resp->set_uptime_seconds(std::chrono::duration<double>(Clock::now() - started_).count());
  return Finish(Method::kGetStatus, start, Status::Ok());
}

grpc::Status OffloadService::ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                                          v1::ListSessionsResponse* resp) {
  const auto start = Clock::now();
  for (const SessionSnapshot& s : table_->ListSessions()) {
    v1::SessionInfo* info = resp->add_sessions();
    info->set_session_id(s.session_id);
    info->set_job_id(s.job_id);
    info->set_rank(s.rank);
    info->set_local_rank(s.local_rank);
    info->set_pid(s.peer.pid);
    info->set_uid(s.peer.uid);
    info->set_gid(s.peer.gid);
    info->set_held_bytes(s.held_bytes);
    info->set_groups(s.groups);
    info->set_age_seconds(s.age_seconds);
    info->set_limit_bytes(s.limit_bytes);
    info->set_kind(SessionKindName(s.kind));
    info->set_blocks(s.blocks);
  }
  return Finish(Method::kListSessions, start, Status::Ok());
}

grpc::Status OffloadService::GetConfig(grpc::ServerContext*, const v1::GetConfigRequest*,
                                       v1::GetConfigResponse* resp) {
  const auto start = Clock::now();
  DaemonConfig config;
  {
    absl::MutexLock lock(&config_mu_);
    config = config_;
  }
  resp->set_config_file(config.config_file);
  for (const ConfigEntry& e : ConfigEntries(config)) {
    v1::ConfigEntry* out = resp->add_entries();
    out->set_key(e.key);
    out->set_value(e.value);
    out->set_source(e.source);
  }
  resp->set_toml(FormatConfig(config));
  return Finish(Method::kGetConfig, start, Status::Ok());
}

grpc::Status OffloadService::Drain(grpc::ServerContext*, const v1::DrainRequest* req,
                                   v1::DrainResponse* resp) {
  const auto start = Clock::now();
  if (!ConstantTimeEquals(req->admin_token(), info_.admin_token)) {
    return Finish(Method::kDrain, start,
                  PermissionDenied("admin token does not match; read it from " + info_.runtime_dir +
                                   "/admin.token (root or the daemon's user only)"));
  }
  if (Status st = table_->SetDraining(req->drain()); !st.ok()) {
    return Finish(Method::kDrain, start, st);
  }
  const ArenaSnapshot s = table_->Snapshot();
  resp->set_draining(s.draining);
  resp->set_sessions(s.sessions);
  resp->set_used_bytes(s.capacity_bytes - s.free_bytes);
  return Finish(Method::kDrain, start, Status::Ok());
}

}  // namespace memoffload::daemon
