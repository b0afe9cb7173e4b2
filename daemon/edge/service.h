// OffloadService: the gRPC edge of the daemon (memoffload.v1.Offload).
//
// Validates every request's shape, delegates to SessionTable, maps Status to
// gRPC status codes and records metrics. Holds no state of its own beyond
// what GetStatus reports; thread-safe (gRPC calls it from its pool).
// Every method uses gRPC's callback API; a waiting reserve holds no thread:
// it is answered by whoever frees the space, or by the table's deadline
// thread.
#ifndef MEMOFFLOAD_DAEMON_SERVICE_H_
#define MEMOFFLOAD_DAEMON_SERVICE_H_

#include <chrono>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "config/config.h"
#include "core/refusal_log.h"
#include "core/session_table.h"
#include "memoffload/v1/memoffload.grpc.pb.h"
#include "memory/arena.h"
#include "observe/metrics.h"

namespace memoffload::daemon {

struct ServiceInfo {
  std::string version;
  std::string runtime_dir;
  std::string metrics_address;  // bound address, "" when disabled or not bound yet
  std::string admin_token;      // required by Drain
  uint64_t instance_id = 0;     // random per start
};

// Every method of the service uses the callback API: a request is answered
// on the thread that read it, with no hand-off to a thread pool, and a call
// whose reply the peer does not take (an HTTP/2 window kept at 0) holds no
// thread. That includes the checkpoint region calls: each is a table update
// of microseconds (the bytes move through shared memory, never over gRPC),
// and on the synchronous pool one uid's stalled calls took every thread
// from everyone's checkpoints (issue 38). Only gRPC's reflection service is
// left on the synchronous pool, whose threads the daemon bounds (daemon.cc).
template <typename Base>
using RegionCallbacks = memoffload::v1::Offload::WithCallbackMethod_CreateRegion<
    memoffload::v1::Offload::WithCallbackMethod_CommitRegion<
        memoffload::v1::Offload::WithCallbackMethod_OpenRegion<
            memoffload::v1::Offload::WithCallbackMethod_CloseRegion<
                memoffload::v1::Offload::WithCallbackMethod_DeleteRegion<
                    memoffload::v1::Offload::WithCallbackMethod_ListRegions<Base>>>>>>;
using OffloadServiceBase = memoffload::v1::Offload::WithCallbackMethod_Reserve<
    memoffload::v1::Offload::WithCallbackMethod_Commit<
        memoffload::v1::Offload::WithCallbackMethod_Prefetch<
            memoffload::v1::Offload::WithCallbackMethod_Release<
                memoffload::v1::Offload::WithCallbackMethod_GetStatus<
                    memoffload::v1::Offload::WithCallbackMethod_ListSessions<
                        memoffload::v1::Offload::WithCallbackMethod_GetConfig<
                            memoffload::v1::Offload::WithCallbackMethod_Drain<
                                RegionCallbacks<memoffload::v1::Offload::Service>>>>>>>>>;

class OffloadService final : public OffloadServiceBase {
 public:
  OffloadService(const Arena* arena, SessionTable* table, Metrics* metrics, ServiceInfo info,
                 const DaemonConfig& config);

  // Replaces the configuration GetConfig reports and the reserve wait cap
  // (after SIGHUP). Thread-safe.
  void SetConfig(const DaemonConfig& config) ABSL_LOCKS_EXCLUDED(config_mu_);

  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* ctx, const v1::ReserveRequest* req,
                                    v1::ReserveResponse* resp) override;
  // Reserve without gRPC's call objects. `deadline` is the caller's
  // (time_point::max() when it set none): a waiting reserve is answered a
  // margin before it, so that the caller sees why. `done` is called exactly
  // once, maybe on this thread, after *resp is filled; `cancelled` (may be
  // empty) tells whether the caller went away (see SessionTable::
  // ReserveAsync). Returns the table's ticket while the reserve waits, 0
  // once answered.
  uint64_t StartReserve(const v1::ReserveRequest& req, v1::ReserveResponse* resp,
                        std::chrono::system_clock::time_point deadline,
                        std::function<void(grpc::Status)> done,
                        std::function<bool()> cancelled = nullptr);
  // StartReserve, waiting on this thread for the answer (fuzzers, tests).
  grpc::Status ReserveAndWait(const v1::ReserveRequest& req, v1::ReserveResponse* resp,
                              std::chrono::system_clock::time_point deadline =
                                  std::chrono::system_clock::time_point::max());
  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* ctx, const v1::CommitRequest* req,
                                   v1::CommitResponse* resp) override;
  grpc::ServerUnaryReactor* Prefetch(grpc::CallbackServerContext* ctx,
                                     const v1::PrefetchRequest* req,
                                     v1::PrefetchResponse* resp) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* req,
                                    v1::ReleaseResponse* resp) override;
  // The same, answered on the calling thread (fuzzers, tests); `ctx` is not
  // used.
  grpc::Status Commit(grpc::ServerContext* ctx, const v1::CommitRequest* req,
                      v1::CommitResponse* resp) override;
  grpc::Status Prefetch(grpc::ServerContext* ctx, const v1::PrefetchRequest* req,
                        v1::PrefetchResponse* resp) override;
  grpc::Status Release(grpc::ServerContext* ctx, const v1::ReleaseRequest* req,
                       v1::ReleaseResponse* resp) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx,
                                      const v1::GetStatusRequest* req,
                                      v1::GetStatusResponse* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* req,
                                         v1::ListSessionsResponse* resp) override;
  grpc::ServerUnaryReactor* GetConfig(grpc::CallbackServerContext* ctx,
                                      const v1::GetConfigRequest* req,
                                      v1::GetConfigResponse* resp) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const v1::DrainRequest* req,
                                  v1::DrainResponse* resp) override;
  // The same four, synchronous: what the callbacks answer with (also
  // called directly by tests and fuzzers).
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest* req,
                         v1::GetStatusResponse* resp) override;
  grpc::Status ListSessions(grpc::ServerContext* ctx, const v1::ListSessionsRequest* req,
                            v1::ListSessionsResponse* resp) override;
  grpc::Status GetConfig(grpc::ServerContext* ctx, const v1::GetConfigRequest* req,
                         v1::GetConfigResponse* resp) override;
  grpc::Status Drain(grpc::ServerContext* ctx, const v1::DrainRequest* req,
                     v1::DrainResponse* resp) override;
  // Checkpoint regions (service_regions.cc): callbacks answered at once
  // with the synchronous versions, which tests and fuzzers call directly.
  grpc::ServerUnaryReactor* CreateRegion(grpc::CallbackServerContext* ctx,
                                         const v1::CreateRegionRequest* req,
                                         v1::CreateRegionResponse* resp) override;
  grpc::ServerUnaryReactor* CommitRegion(grpc::CallbackServerContext* ctx,
                                         const v1::CommitRegionRequest* req,
                                         v1::CommitRegionResponse* resp) override;
  grpc::ServerUnaryReactor* OpenRegion(grpc::CallbackServerContext* ctx,
                                       const v1::OpenRegionRequest* req,
                                       v1::OpenRegionResponse* resp) override;
  grpc::ServerUnaryReactor* CloseRegion(grpc::CallbackServerContext* ctx,
                                        const v1::CloseRegionRequest* req,
                                        v1::CloseRegionResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteRegion(grpc::CallbackServerContext* ctx,
                                         const v1::DeleteRegionRequest* req,
                                         v1::DeleteRegionResponse* resp) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* ctx,
                                        const v1::ListRegionsRequest* req,
                                        v1::ListRegionsResponse* resp) override;
  grpc::Status CreateRegion(grpc::ServerContext* ctx, const v1::CreateRegionRequest* req,
                            v1::CreateRegionResponse* resp) override;
  grpc::Status CommitRegion(grpc::ServerContext* ctx, const v1::CommitRegionRequest* req,
                            v1::CommitRegionResponse* resp) override;
  grpc::Status OpenRegion(grpc::ServerContext* ctx, const v1::OpenRegionRequest* req,
                          v1::OpenRegionResponse* resp) override;
  grpc::Status CloseRegion(grpc::ServerContext* ctx, const v1::CloseRegionRequest* req,
                           v1::CloseRegionResponse* resp) override;
  grpc::Status DeleteRegion(grpc::ServerContext* ctx, const v1::DeleteRegionRequest* req,
                            v1::DeleteRegionResponse* resp) override;
  grpc::Status ListRegions(grpc::ServerContext* ctx, const v1::ListRegionsRequest* req,
                           v1::ListRegionsResponse* resp) override;

  // The metrics address once bound after start (its port was taken then).
  void SetMetricsAddress(const std::string& address) ABSL_LOCKS_EXCLUDED(metrics_address_mu_);

 private:
  // Converts and records; `start` is when the request arrived.
  grpc::Status Finish(Method method, std::chrono::steady_clock::time_point start,
                      const Status& status);
  grpc::Status DoCommit(const v1::CommitRequest& req, v1::CommitResponse* resp);
  grpc::Status DoPrefetch(const v1::PrefetchRequest& req, v1::PrefetchResponse* resp);
  grpc::Status DoRelease(const v1::ReleaseRequest& req, v1::ReleaseResponse* resp);
  // A Reserve refused for want of space (arena full, or waited for it in
  // vain): one warning per uid and job id per interval (refusals_), naming
  // who and why, with the count of refusals left out since the last one.
  void LogRefusal(uint64_t session_id, const Status& refusal, RejectReason reason);

  const Arena* arena_;
  SessionTable* table_;
  Metrics* metrics_;
  const ServiceInfo info_;
  mutable absl::Mutex metrics_address_mu_;
  std::string metrics_address_ ABSL_GUARDED_BY(metrics_address_mu_);
  const std::chrono::steady_clock::time_point started_;
  mutable absl::Mutex config_mu_;
  DaemonConfig config_ ABSL_GUARDED_BY(config_mu_);
  RefusalLog refusals_;  // its own lock
};

// Maps our status to gRPC's (same numeric codes).
grpc::Status ToGrpc(const Status& status);
// Finishes a callback call at once with `status`, on the thread that read it.
grpc::ServerUnaryReactor* Answered(grpc::CallbackServerContext* ctx, const grpc::Status& status);
// A request's session credentials are present (INVALID_ARGUMENT,
// UNAUTHENTICATED otherwise); the table checks them.
Status CheckCredentials(const v1::SessionCredentials& creds, bool has_session);
void CopyExtents(const Extent* in, size_t count,
                 google::protobuf::RepeatedPtrField<v1::Extent>* out);
template <typename Extents>
void CopyExtents(const Extents& in, google::protobuf::RepeatedPtrField<v1::Extent>* out) {
  CopyExtents(in.data(), in.size(), out);
}

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SERVICE_H_
