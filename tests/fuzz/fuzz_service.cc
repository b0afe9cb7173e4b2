// Fuzzes the gRPC edge (OffloadService) in-process, with sequences of
// requests against a real arena, session table and metrics.
//
// The input is decoded (FuzzedDataProvider) into two sessions and up to 64
// operations: each of the eight methods, with credentials of the right
// session, the other session, a closed or unknown session, no session, and
// right / other / empty / garbage tokens; arbitrary group ids, sizes and
// flags; raw bytes parsed as each request type (optionally given real
// credentials); session close and reopen (the lifeline); quota changes;
// chunk fd requests (the broker's ChunkRequest) under each tenant mode, with
// sessions of one or two tenants.
//
// A shadow model predicts every status code and checks every answer: group
// state machine, byte counts, limits, extents in bounds and never shared
// between live groups, one session never reaching another's groups nor
// another tenant's chunks, and
// SessionTable::CheckInvariants after every operation. Any mismatch aborts.
#include <fuzzer/FuzzedDataProvider.h>
#include <grpcpp/server_context.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/session_table.h"
#include "edge/service.h"
#include "fuzz_common.h"
#include "fuzz_service_model.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "observe/metrics.h"

namespace memoffload::fuzz {
namespace {

using daemon::Policy;
constexpr char kAdminToken[] = "fuzz-admin-token";
constexpr int kMaxOperations = 64;

std::string GrpcText(const grpc::Status& s) {
  return std::to_string(s.error_code()) + " " + s.error_message();
}

// Drives the real service and checks every answer against the model.
class Harness : private ServiceModel {
 public:
  explicit Harness(FuzzedDataProvider* in) : ServiceModel(in), arena_(SharedArena()) {
    policy_.max_wait_ms = 0;  // waiting reserves answer at once
    tenant_mode_ = static_cast<daemon::TenantMode>(in_->ConsumeIntegralInRange(0, 2));
    table_ = std::make_unique<daemon::SessionTable>(arena_, policy_, tenant_mode_);
    metrics_ = std::make_unique<daemon::Metrics>(table_.get(), daemon::MetricsInfo{});
    daemon::DaemonConfig config;
    config.policy = policy_;
    service_ = std::make_unique<daemon::OffloadService>(
        arena_, table_.get(), metrics_.get(),
        daemon::ServiceInfo{"fuzz", "/tmp/fuzz", "", kAdminToken}, config);
    page_ = arena_->page_bytes();
  }

  ~Harness() {
    for (ModelSession& s : sessions_) {
      if (s.open) CloseSession(&s);
    }
    CheckOk(table_->CheckInvariants(), "invariants at the end");
    Check(arena_->allocator().free_bytes() == arena_->capacity_bytes(),
          "bytes left allocated after every session closed");
    service_.reset();
    metrics_.reset();
    table_.reset();
  }

  void Run() {
    OpenSession(&sessions_[0]);
    OpenSession(&sessions_[1]);
    for (int op = 0; op < kMaxOperations && in_->remaining_bytes() > 0; ++op) {
      Step();
      CheckOk(table_->CheckInvariants(), "invariants after operation " + std::to_string(op));
      CheckTotals();
    }
  }

 private:
  // ---- session lifecycle (the broker's side) ----
  void OpenSession(ModelSession* s) {
    Hello hello;
    hello.job_id = in_->ConsumeBool() ? "job-a" : "job-b";
    hello.rank = in_->ConsumeIntegralInRange<int32_t>(-1, 7);
    hello.max_bytes = PickLimit();
    hello.job_max_bytes = PickLimit();
    const uid_t uid = in_->ConsumeBool() ? 1000 : 1001;  // two possible tenants
    Result<daemon::SessionGrant> grant = table_->Open(hello, daemon::PeerCredentials{1, uid, 3});
    if (draining_) {
      Check(!grant.ok() && grant.status().code() == StatusCode::kUnavailable,
            "Open while draining: " + grant.status().ToString());
      s->open = false;
      return;
    }
    CheckOk(grant.status(), "Open");
    s->grant = *grant;
    s->hello = hello;
    s->uid = uid;
    s->groups.clear();
    s->open = true;
    CheckOk(table_->AttachChunks(s->grant.session_id).status(), "AttachChunks");
    // The job's requested limit: smallest asked while the job had sessions.
    JobOpened(*s);
  }

  void CloseSession(ModelSession* s) {
    auto closed = table_->Close(s->grant.session_id, daemon::CloseReason::kLifelineClosed);
    CheckOk(closed.status(), "Close");
    Check(closed->group_bytes == s->Held(), "Close reclaimed " +
                                                std::to_string(closed->group_bytes) +
                                                " bytes, model " + std::to_string(s->Held()));
    s->open = false;
    s->groups.clear();
    closed_ids_.push_back(s->grant.session_id);
  }

  // ---- operations ----
  void Step() {
    switch (in_->ConsumeIntegralInRange(0, 14)) {
      case 0:
      case 1: {
        v1::ReserveRequest req;
        bool has = false;
        StatusCode expect;
        ModelSession* s = FillCredentials(req.mutable_session(), &has, &expect);
        if (!has) req.clear_session();
        req.set_group_id(PickGroup());
        req.set_size_bytes(PickSize());
        req.set_single_extent(in_->ConsumeBool());
        req.set_wait_for_space(in_->ConsumeBool());
        return DoReserve(req, s, expect);
      }
      case 2: {
        v1::CommitRequest req;
        bool has = false;
        StatusCode expect;
        ModelSession* s = FillCredentials(req.mutable_session(), &has, &expect);
        if (!has) req.clear_session();
        req.set_group_id(PickGroup());
        req.set_used_bytes(in_->ConsumeBool() ? in_->ConsumeIntegralInRange<uint64_t>(0, 2 * kMiB)
                                              : in_->ConsumeIntegral<uint64_t>());
        req.mutable_copy()->set_bytes(in_->ConsumeIntegral<uint64_t>());
        req.mutable_copy()->set_seconds(in_->ConsumeFloatingPoint<double>());
        return DoCommit(req, s, expect);
      }
      case 3: {
        v1::PrefetchRequest req;
        bool has = false;
        StatusCode expect;
        ModelSession* s = FillCredentials(req.mutable_session(), &has, &expect);
        if (!has) req.clear_session();
        req.set_group_id(PickGroup());
        return DoPrefetch(req, s, expect);
      }
      case 4: {
        v1::ReleaseRequest req;
        bool has = false;
        StatusCode expect;
        ModelSession* s = FillCredentials(req.mutable_session(), &has, &expect);
        if (!has) req.clear_session();
        req.set_group_id(PickGroup());
        req.mutable_copy()->set_bytes(in_->ConsumeIntegral<uint64_t>());
        req.mutable_copy()->set_seconds(in_->ConsumeFloatingPoint<double>());
        return DoRelease(req, s, expect);
      }
      case 5:
        return DoReads();
      case 6: {
        v1::DrainRequest req;
        req.set_admin_token(in_->ConsumeBool() ? kAdminToken : in_->ConsumeRandomLengthString(20));
        req.set_drain(in_->ConsumeBool());
        return DoDrain(req);
      }
      case 7:
      case 8: {
        ModelSession* s = nullptr;
        StatusCode expect = StatusCode::kOk;
        switch (in_->ConsumeIntegralInRange(0, 4)) {
          case 0: {
            v1::ReserveRequest req;
            if (FromRaw(&req, &s, &expect)) DoReserve(req, s, expect);
            return;
          }
          case 1: {
            v1::CommitRequest req;
            if (FromRaw(&req, &s, &expect)) DoCommit(req, s, expect);
            return;
          }
          case 2: {
            v1::PrefetchRequest req;
            if (FromRaw(&req, &s, &expect)) DoPrefetch(req, s, expect);
            return;
          }
          case 3: {
            v1::ReleaseRequest req;
            if (FromRaw(&req, &s, &expect)) DoRelease(req, s, expect);
            return;
          }
          default: {
            v1::DrainRequest req;
            if (req.ParseFromString(in_->ConsumeRandomLengthString(64))) DoDrain(req);
            return;
          }
        }
      }
      case 9:
      case 10: {  // a client dies (lifeline closes) and maybe another attaches
        ModelSession* s = &sessions_[in_->ConsumeIntegralInRange(0, 1)];
        if (s->open) CloseSession(s);
        if (in_->ConsumeBool()) OpenSession(s);
        return;
      }
      case 11: {  // SIGHUP with new quotas
        policy_.session_max_bytes = PickLimit();
        policy_.job_max_bytes = PickLimit();
        policy_.uid_max_bytes = PickLimit();
        policy_.uid_max_chunks = in_->ConsumeIntegralInRange<uint64_t>(0, 3);
        policy_.node_reserve_bytes = kMiB / 2 * in_->ConsumeIntegralInRange<uint64_t>(0, 7);
        table_->SetPolicy(policy_);
        daemon::DaemonConfig config;
        config.policy = policy_;
        service_->SetConfig(config);
        return;
      }
      case 12:
        return DoGrantChunks();
      default:
        return DoReads();
    }
  }

  // A session asks for chunk fds (the broker's ChunkRequest, decoded from
  // raw bytes or chosen). Chunks where another tenant holds a live group must
  // be refused; chunks where the session's own groups live must be granted.
  void DoGrantChunks() {
    ModelSession* s = &sessions_[in_->ConsumeIntegralInRange(0, 1)];
    std::vector<uint32_t> chunks;
    if (in_->ConsumeBool()) {
      Result<ChunkRequest> req = DecodeChunkRequest(in_->ConsumeRandomLengthString(64));
      if (!req.ok()) return;
      chunks = req->chunk_indexes;
    } else {
      const size_t n = in_->ConsumeIntegralInRange<size_t>(0, 5);
      for (size_t i = 0; i < n; ++i) chunks.push_back(in_->ConsumeIntegralInRange<uint32_t>(0, 5));
    }
    const Status st = table_->GrantChunks(s->grant.session_id, chunks).status();
    if (!s->open) {
      Check(st.code() == StatusCode::kNotFound, "GrantChunks for a closed session");
      return;
    }
    bool out_of_range = false, foreign = false;
    for (uint32_t c : chunks) {
      if (c >= arena_->chunk_count()) out_of_range = true;
      for (const ModelSession& other : sessions_) {
        if (!other.open || Tenant(other) == Tenant(*s)) continue;
        for (const auto& [gid, g] : other.groups) {
          for (const Extent& e : g.extents) foreign |= e.chunk == c;
        }
      }
    }
    if (out_of_range) {
      Check(st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kPermissionDenied,
            "GrantChunks of a chunk that does not exist: " + st.ToString());
    } else if (foreign && tenant_mode_ != daemon::TenantMode::kNone) {
      Check(st.code() == StatusCode::kPermissionDenied,
            "GrantChunks handed out a chunk where another tenant holds data: " + st.ToString());
    }
    // Chunks of the session's own groups are always its tenant's.
    std::vector<uint32_t> own;
    for (const auto& [gid, g] : s->groups) {
      for (const Extent& e : g.extents) own.push_back(e.chunk);
    }
    CheckOk(table_->GrantChunks(s->grant.session_id, own).status(),
            "GrantChunks of the session's own chunks");
  }

  void CheckExtents(const v1::ReserveResponse& resp, uint64_t expect_bytes) {
    uint64_t sum = 0;
    for (const v1::Extent& e : resp.extents()) {
      Check(e.chunk() < arena_->chunk_count(), "extent in a chunk that does not exist");
      const uint64_t chunk_bytes = arena_->chunk(e.chunk()).size_bytes();
      Check(e.length() > 0 && e.offset() % page_ == 0 && e.length() % page_ == 0,
            "extent not page-aligned or empty");
      Check(e.offset() <= chunk_bytes && e.length() <= chunk_bytes - e.offset(),
            "extent beyond its chunk");
      for (const ModelSession& s : sessions_) {
        for (const auto& [gid, g] : s.groups) {
          for (const Extent& x : g.extents) {
            const bool overlap = x.chunk == e.chunk() && x.offset < e.offset() + e.length() &&
                                 e.offset() < x.offset + x.length;
            Check(!overlap, "Reserve handed out bytes another live group holds");
          }
        }
      }
      sum += e.length();
    }
    Check(sum == expect_bytes,
          "extents sum to " + std::to_string(sum) + ", reserved " + std::to_string(expect_bytes));
  }

  void DoReserve(const v1::ReserveRequest& req, ModelSession* s, StatusCode expect) {
    v1::ReserveResponse resp;
    const uint32_t uid_chunks_before = s != nullptr ? table_->UidChunks(s->uid) : 0;
    const grpc::Status st = service_->ReserveAndWait(req, &resp);
    const auto code = static_cast<StatusCode>(st.error_code());
    // No Reserve takes a chunk over for a uid at quotas.uid_max_chunks (a
    // SIGHUP may have lowered it below what the uid owned already).
    const uint64_t cap = policy_.uid_max_chunks;
    Check(s == nullptr || cap == 0 ||
              table_->UidChunks(s->uid) <= std::max<uint64_t>(cap, uid_chunks_before),
          "Reserve took a chunk over beyond the uid's quotas.uid_max_chunks");
    // A refused Reserve takes no chunk: one that its pool and the chunks it
    // may take over cannot hold is refused before it claims any (it used to
    // claim them, fail, and keep them empty). The extent limit refuses only
    // after placing, so its refusal may keep what it claimed.
    Check(s == nullptr || code != StatusCode::kResourceExhausted ||
              st.error_message().rfind("arena fragmented", 0) == 0 ||
              table_->UidChunks(s->uid) <= uid_chunks_before,
          "a refused Reserve took a chunk over: " + GrpcText(st));
    if (s == nullptr) {
      Check(code == expect, "Reserve: expected " + std::to_string(static_cast<int>(expect)) +
                                ", got " + GrpcText(st));
      return;
    }
    const uint64_t size = req.size_bytes();
    const uint64_t usable = arena_->capacity_bytes() - policy_.node_reserve_bytes;
    if (s->groups.count(req.group_id()) != 0) {
      expect = StatusCode::kFailedPrecondition;
    } else if (size == 0) {
      expect = StatusCode::kInvalidArgument;
    } else if (draining_) {
      expect = StatusCode::kUnavailable;
    } else if (size > usable) {
      expect = StatusCode::kResourceExhausted;
    } else {
      // May succeed or run out of space (limits, fragmentation); checked below.
      Check(code == StatusCode::kOk || code == StatusCode::kResourceExhausted,
            "Reserve: " + GrpcText(st));
      if (code != StatusCode::kOk) return;
      const uint64_t rounded = (size + page_ - 1) / page_ * page_;
      Check(resp.reserved_bytes() == rounded, "Reserve did not round to pages");
      const uint64_t session_limit = MinLimit(policy_.session_max_bytes, s->hello.max_bytes);
      Check(session_limit == 0 || s->Held() + rounded <= session_limit,
            "Reserve exceeded the session limit");
      const uint64_t job_limit = MinLimit(policy_.job_max_bytes, job_requested_[JobKey(*s)]);
      Check(job_limit == 0 || JobHeld(JobKey(*s)) + rounded <= job_limit,
            "Reserve exceeded the job limit");
      Check(policy_.uid_max_bytes == 0 || UidHeld(s->uid) + rounded <= policy_.uid_max_bytes,
            "Reserve exceeded the uid limit");
      Check(TotalHeld() + rounded <= usable, "Reserve ate into the node reserve");
      Check(!req.single_extent() || resp.extents_size() == 1,
            "single_extent Reserve returned several extents");
      CheckExtents(resp, rounded);
      ModelGroup g;
      for (const v1::Extent& e : resp.extents()) {
        g.extents.push_back(Extent{e.chunk(), e.offset(), e.length()});
      }
      g.held_bytes = rounded;
      s->groups[req.group_id()] = std::move(g);
      return;
    }
    Check(code == expect, "Reserve: expected " + std::to_string(static_cast<int>(expect)) +
                              ", got " + GrpcText(st));
  }

  void DoCommit(const v1::CommitRequest& req, ModelSession* s, StatusCode expect) {
    grpc::ServerContext ctx;
    v1::CommitResponse resp;
    const grpc::Status st = service_->Commit(&ctx, &req, &resp);
    const auto code = static_cast<StatusCode>(st.error_code());
    ModelGroup* g = nullptr;
    if (s != nullptr) {
      auto it = s->groups.find(req.group_id());
      if (it == s->groups.end()) {
        expect = StatusCode::kNotFound;
      } else if (it->second.state != State::kReserved) {
        expect = StatusCode::kFailedPrecondition;
      } else if (req.used_bytes() > it->second.held_bytes) {
        expect = StatusCode::kInvalidArgument;
      } else {
        g = &it->second;
      }
    }
    Check(code == expect,
          "Commit: expected " + std::to_string(static_cast<int>(expect)) + ", got " + GrpcText(st));
    if (g == nullptr) return;
    const uint64_t kept = (req.used_bytes() + page_ - 1) / page_ * page_;
    Check(resp.committed_bytes() == kept && resp.returned_bytes() == g->held_bytes - kept,
          "Commit byte counts wrong");
    // The daemon keeps the first `kept` bytes of the group's extents.
    std::vector<Extent> prefix;
    uint64_t left = kept;
    for (const Extent& e : g->extents) {
      if (left == 0) break;
      Extent part = e;
      part.length = std::min(left, e.length);
      left -= part.length;
      prefix.push_back(part);
    }
    g->extents = std::move(prefix);
    g->held_bytes = kept;
    g->used_bytes = req.used_bytes();
    g->state = State::kCommitted;
  }

  void DoPrefetch(const v1::PrefetchRequest& req, ModelSession* s, StatusCode expect) {
    grpc::ServerContext ctx;
    v1::PrefetchResponse resp;
    const grpc::Status st = service_->Prefetch(&ctx, &req, &resp);
    const auto code = static_cast<StatusCode>(st.error_code());
    ModelGroup* g = nullptr;
    if (s != nullptr) {
      auto it = s->groups.find(req.group_id());
      if (it == s->groups.end()) {
        expect = StatusCode::kNotFound;
      } else if (it->second.state == State::kReserved) {
        expect = StatusCode::kFailedPrecondition;
      } else {
        g = &it->second;
      }
    }
    Check(code == expect, "Prefetch: expected " + std::to_string(static_cast<int>(expect)) +
                              ", got " + GrpcText(st));
    if (g == nullptr) return;
    Check(resp.used_bytes() == g->used_bytes, "Prefetch reports other used bytes");
    Check(static_cast<size_t>(resp.extents_size()) == g->extents.size(),
          "Prefetch returns other extents than were committed");
    for (int i = 0; i < resp.extents_size(); ++i) {
      const v1::Extent& e = resp.extents(i);
      Check(Extent{e.chunk(), e.offset(), e.length()} == g->extents[static_cast<size_t>(i)],
            "Prefetch returns other extents than were committed");
    }
    g->state = State::kRead;
  }

  void DoRelease(const v1::ReleaseRequest& req, ModelSession* s, StatusCode expect) {
    grpc::ServerContext ctx;
    v1::ReleaseResponse resp;
    const grpc::Status st = service_->Release(&ctx, &req, &resp);
    const auto code = static_cast<StatusCode>(st.error_code());
    std::map<uint64_t, ModelGroup>::iterator it;
    if (s != nullptr) {
      it = s->groups.find(req.group_id());
      if (it == s->groups.end()) expect = StatusCode::kNotFound;
    }
    Check(code == expect, "Release: expected " + std::to_string(static_cast<int>(expect)) +
                              ", got " + GrpcText(st));
    if (s == nullptr || expect != StatusCode::kOk) return;
    Check(resp.released_bytes() == it->second.held_bytes, "Release byte count wrong");
    s->groups.erase(it);
  }

  void DoDrain(const v1::DrainRequest& req) {
    grpc::ServerContext ctx;
    v1::DrainResponse resp;
    const grpc::Status st = service_->Drain(&ctx, &req, &resp);
    if (req.admin_token() != kAdminToken) {
      Check(st.error_code() == grpc::StatusCode::PERMISSION_DENIED, "Drain with a wrong token");
      return;
    }
    Check(st.ok() && resp.draining() == req.drain(), "Drain: " + GrpcText(st));
    draining_ = req.drain();
  }

  void DoReads() {
    grpc::ServerContext ctx;
    v1::GetStatusRequest status_req;
    v1::GetStatusResponse status;
    Check(service_->GetStatus(&ctx, &status_req, &status).ok(), "GetStatus failed");
    Check(status.used_bytes() == TotalHeld(), "GetStatus used_bytes disagrees with the model");
    Check(status.draining() == draining_, "GetStatus draining disagrees with the model");
    v1::ListSessionsRequest list_req;
    v1::ListSessionsResponse list;
    Check(service_->ListSessions(&ctx, &list_req, &list).ok(), "ListSessions failed");
    for (const v1::SessionInfo& info : list.sessions()) {
      const ModelSession* match = nullptr;
      for (const ModelSession& s : sessions_) {
        if (s.open && s.grant.session_id == info.session_id()) match = &s;
      }
      Check(match != nullptr, "ListSessions shows a session that is not open");
      Check(info.held_bytes() == match->Held() && info.groups() == match->groups.size(),
            "ListSessions disagrees with the model");
    }
    v1::GetConfigRequest config_req;
    v1::GetConfigResponse config;
    Check(service_->GetConfig(&ctx, &config_req, &config).ok(), "GetConfig failed");
  }

  void CheckTotals() {
    const daemon::ArenaSnapshot snap = table_->Snapshot();
    Check(snap.capacity_bytes - snap.free_bytes == TotalHeld(),
          "arena use disagrees with the model: " +
              std::to_string(snap.capacity_bytes - snap.free_bytes) + " vs " +
              std::to_string(TotalHeld()));
    uint64_t groups = 0;
    for (const ModelSession& s : sessions_) groups += s.open ? s.groups.size() : 0;
    Check(snap.groups == groups, "group count disagrees with the model");
  }

  daemon::Arena* arena_;
  Policy policy_;
  bool draining_ = false;
  std::unique_ptr<daemon::SessionTable> table_;
  std::unique_ptr<daemon::Metrics> metrics_;
  std::unique_ptr<daemon::OffloadService> service_;
};

}  // namespace
}  // namespace memoffload::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  memoffload::fuzz::Harness harness(&in);
  harness.Run();
  return 0;
}
