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

#include "fuzz_common.h"
#include "memoffload/daemon/config.h"
#include "memoffload/daemon/metrics.h"
#include "memoffload/daemon/service.h"
#include "memoffload/daemon/session_table.h"
#include "memoffload/shared_mem/attach_wire.h"

namespace memoffload::fuzz {
namespace {

using daemon::Policy;
constexpr char kAdminToken[] = "fuzz-admin-token";
constexpr int kMaxOperations = 64;

enum class State { kReserved, kCommitted, kRead };

struct ModelGroup {
  State state = State::kReserved;
  std::vector<Extent> extents;  // what the daemon holds for the group
  uint64_t held_bytes = 0;
  uint64_t used_bytes = 0;
};

struct ModelSession {
  daemon::SessionGrant grant;
  Hello hello;
  uid_t uid = 0;
  bool open = false;
  std::map<uint64_t, ModelGroup> groups;
  uint64_t Held() const {
    uint64_t sum = 0;
    for (const auto& [id, g] : groups) sum += g.held_bytes;
    return sum;
  }
};

// Which credentials a request carries.
enum class Who { kSessionA, kSessionB, kClosed, kUnknown, kMissing, kZero };
enum class TokenKind { kRight, kOther, kEmpty, kGarbage };

std::string GrpcText(const grpc::Status& s) {
  return std::to_string(s.error_code()) + " " + s.error_message();
}

class Harness {
 public:
  explicit Harness(FuzzedDataProvider* in) : in_(in), arena_(SharedArena()) {
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

  // A job is a job id within one uid (another uid naming it is another job).
  static std::string JobKey(const ModelSession& s) {
    return std::to_string(s.uid) + ":" + s.hello.job_id;
  }

  void JobOpened(const ModelSession& session) {
    const Hello& hello = session.hello;
    uint64_t& asked = job_requested_[JobKey(session)];
    if (JobSessions(JobKey(session)) == 1) asked = 0;  // a fresh job entry
    if (hello.job_max_bytes != 0 && (asked == 0 || hello.job_max_bytes < asked)) {
      asked = hello.job_max_bytes;
    }
  }

  int JobSessions(const std::string& job) const {
    int n = 0;
    for (const ModelSession& s : sessions_) n += s.open && JobKey(s) == job;
    return n;
  }

  void CloseSession(ModelSession* s) {
    Result<uint64_t> closed =
        table_->Close(s->grant.session_id, daemon::CloseReason::kLifelineClosed);
    CheckOk(closed.status(), "Close");
    Check(*closed == s->Held(), "Close reclaimed " + std::to_string(*closed) + " bytes, model " +
                                    std::to_string(s->Held()));
    s->open = false;
    s->groups.clear();
    closed_ids_.push_back(s->grant.session_id);
  }

  uint64_t PickLimit() {
    switch (in_->ConsumeIntegralInRange(0, 3)) {
      case 0:
        return 0;
      case 1:
        return in_->ConsumeIntegralInRange<uint64_t>(1, 5 * kMiB);
      case 2:
        return kMiB * in_->ConsumeIntegralInRange<uint64_t>(1, 4);
      default:
        return in_->ConsumeIntegral<uint64_t>();
    }
  }

  // ---- request building ----
  ModelSession* Target(Who who) {
    if (who == Who::kSessionA) return &sessions_[0];
    if (who == Who::kSessionB) return &sessions_[1];
    return nullptr;
  }

  // Fills credentials; returns the model session they authenticate as, or
  // nullptr and in *expect the code the daemon must answer with.
  ModelSession* FillCredentials(v1::SessionCredentials* creds, bool* has_session,
                                StatusCode* expect) {
    const Who who = static_cast<Who>(in_->ConsumeIntegralInRange(0, 5));
    const TokenKind token = static_cast<TokenKind>(in_->ConsumeIntegralInRange(0, 3));
    ModelSession* named = Target(who);
    uint64_t id = 0;
    if (named != nullptr) {
      id = named->grant.session_id;
    } else if (who == Who::kClosed && !closed_ids_.empty()) {
      id = closed_ids_[in_->ConsumeIntegralInRange<size_t>(0, closed_ids_.size() - 1)];
    } else if (who == Who::kClosed || who == Who::kUnknown) {
      id = in_->ConsumeIntegral<uint64_t>();
    }
    std::string token_text;
    if (token == TokenKind::kRight && named != nullptr) {
      token_text = named->grant.token;
    } else if (token == TokenKind::kOther) {
      token_text = (named == &sessions_[0] ? sessions_[1] : sessions_[0]).grant.token;
    } else if (token == TokenKind::kGarbage) {
      token_text = in_->ConsumeRandomLengthString(40);
    }
    *has_session = who != Who::kMissing;
    if (*has_session) {
      creds->set_session_id(id);
      creds->set_session_token(token_text);
    }
    return Authenticates(*has_session, id, token_text, expect);
  }

  // What the daemon must do with these credentials: the service checks
  // presence (INVALID_ARGUMENT) and a token (UNAUTHENTICATED), the table the
  // session (NOT_FOUND) and then the token (UNAUTHENTICATED).
  ModelSession* Authenticates(bool has_session, uint64_t id, const std::string& token,
                              StatusCode* expect) {
    *expect = StatusCode::kOk;
    if (!has_session || id == 0) {
      *expect = StatusCode::kInvalidArgument;
      return nullptr;
    }
    if (token.empty()) {
      *expect = StatusCode::kUnauthenticated;
      return nullptr;
    }
    for (ModelSession& s : sessions_) {
      if (s.open && s.grant.session_id == id) {
        if (token == s.grant.token) return &s;
        *expect = StatusCode::kUnauthenticated;
        return nullptr;
      }
    }
    *expect = StatusCode::kNotFound;
    return nullptr;
  }

  uint64_t PickGroup() {
    return in_->ConsumeBool() ? in_->ConsumeIntegralInRange<uint64_t>(0, 7)
                              : in_->ConsumeIntegral<uint64_t>();
  }

  uint64_t PickSize() {
    switch (in_->ConsumeIntegralInRange(0, 3)) {
      case 0:
        return in_->ConsumeIntegralInRange<uint64_t>(0, 3 * page_);
      case 1:
        return in_->ConsumeIntegralInRange<uint64_t>(0, 5 * kMiB);
      case 2:
        return kMiB / 4 * in_->ConsumeIntegralInRange<uint64_t>(1, 8);
      default:
        return in_->ConsumeIntegral<uint64_t>();
    }
  }

  // Parses raw fuzz bytes as a request; when asked, replaces its credentials
  // with chosen ones so that arbitrary fields reach a real session.
  template <typename Request>
  bool FromRaw(Request* req, ModelSession** session, StatusCode* expect) {
    const std::string raw = in_->ConsumeRandomLengthString(256);
    if (!req->ParseFromString(raw)) return false;
    if (in_->ConsumeBool()) {
      bool has = false;
      v1::SessionCredentials creds;
      *session = FillCredentials(&creds, &has, expect);
      if (has) {
        *req->mutable_session() = creds;
      } else {
        req->clear_session();
      }
    } else {
      *session = Authenticates(req->has_session(), req->session().session_id(),
                               req->session().session_token(), expect);
      Check(*session == nullptr, "raw bytes guessed a 128-bit session token");
    }
    return true;
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

  std::string Tenant(const ModelSession& s) const {
    switch (tenant_mode_) {
      case daemon::TenantMode::kUid:
        return std::to_string(s.uid);
      case daemon::TenantMode::kJob:
        return std::to_string(s.uid) + ":" + s.hello.job_id;
      case daemon::TenantMode::kNone:
        break;
    }
    return "";
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

  static uint64_t MinLimit(uint64_t a, uint64_t b) {
    if (a == 0) return b;
    if (b == 0) return a;
    return std::min(a, b);
  }

  uint64_t JobHeld(const std::string& job) const {
    uint64_t sum = 0;
    for (const ModelSession& s : sessions_) {
      if (s.open && JobKey(s) == job) sum += s.Held();
    }
    return sum;
  }

  uint64_t TotalHeld() const {
    uint64_t sum = 0;
    for (const ModelSession& s : sessions_) sum += s.open ? s.Held() : 0;
    return sum;
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
    const grpc::Status st = service_->ReserveAndWait(req, &resp);
    const auto code = static_cast<StatusCode>(st.error_code());
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

  FuzzedDataProvider* in_;
  daemon::Arena* arena_;
  uint64_t page_ = 0;
  Policy policy_;
  daemon::TenantMode tenant_mode_ = daemon::TenantMode::kUid;
  bool draining_ = false;
  std::unique_ptr<daemon::SessionTable> table_;
  std::unique_ptr<daemon::Metrics> metrics_;
  std::unique_ptr<daemon::OffloadService> service_;
  ModelSession sessions_[2];
  std::vector<uint64_t> closed_ids_;
  std::map<std::string, uint64_t> job_requested_;
};

}  // namespace
}  // namespace memoffload::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  memoffload::fuzz::Harness harness(&in);
  harness.Run();
  return 0;
}
