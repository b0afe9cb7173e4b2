// Fuzzes the checkpoint-region methods of the gRPC edge (OffloadService) in
// process, against a real arena, session table and metrics.
//
// Four session slots (two of one job, one of another uid naming the same
// job, one without a job id) run up to 64 operations: create, commit (with
// right and wrong checksum counts), open, close, delete, the operator's
// delete (right and wrong admin token), list, the TTL sweep, the end of a
// session (a crash) and raw bytes parsed as each region request. A model
// predicts every status code and the regions each job holds; after every
// operation the table's invariants hold and its region bytes and counts
// match the model. At the end, with every session closed and every region
// expired, the arena is whole again.
#include <fuzzer/FuzzedDataProvider.h>
#include <grpcpp/server_context.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/session_table.h"
#include "edge/service.h"
#include "fuzz_common.h"
#include "observe/metrics.h"

namespace memoffload::fuzz {
namespace {

constexpr char kAdminToken[] = "fuzz-admin-token";
constexpr int kMaxOperations = 64;
constexpr int kSlots = 5;
const char* const kNames[] = {"n0", "n1", "dcp/1/.metadata", "bad name", ""};

struct ModelRegion {
  bool committed = false;
  int writer = -1;
  std::vector<int> readers;  // slots, once per open
  bool deleted = false;
  uint64_t held = 0;
  size_t extents = 0;
  std::vector<uint64_t> extent_lengths;
};

struct Slot {
  uid_t uid = 1000;
  std::string job;
  daemon::SessionGrant grant;
  bool open = false;
};

class Harness {
 public:
  explicit Harness(FuzzedDataProvider* in) : in_(in), arena_(SharedArena()) {
    policy_.region_max_bytes = in_->ConsumeBool() ? 3 * kMiB : kMiB;
    policy_.region_job_max_bytes = in_->ConsumeBool() ? 0 : 2 * kMiB;
    policy_.max_regions_per_job = in_->ConsumeIntegralInRange<uint64_t>(1, 4);
    policy_.region_uid_max_bytes = in_->ConsumeBool() ? 0 : 2 * kMiB;
    policy_.max_regions_per_uid = in_->ConsumeIntegralInRange<uint64_t>(0, 6);
    policy_.region_ttl_ms = 3600 * 1000;
    table_ = std::make_unique<daemon::SessionTable>(
        arena_, policy_, static_cast<daemon::TenantMode>(in_->ConsumeIntegralInRange(0, 2)));
    metrics_ = std::make_unique<daemon::Metrics>(table_.get(), daemon::MetricsInfo{});
    daemon::DaemonConfig config;
    config.policy = policy_;
    service_ = std::make_unique<daemon::OffloadService>(
        arena_, table_.get(), metrics_.get(),
        daemon::ServiceInfo{"fuzz", "/tmp/fuzz", "", kAdminToken}, config);
    slots_[0] = {1000, "a", {}, false};
    slots_[1] = {1000, "a", {}, false};
    slots_[2] = {2000, "a", {}, false};
    slots_[3] = {1000, "", {}, false};
    slots_[4] = {1000, "b", {}, false};  // the same uid's other job
    for (Slot& s : slots_) Open(&s);
  }

  ~Harness() {
    for (int i = 0; i < kSlots; ++i) {
      if (slots_[i].open) EndSession(i);
    }
    Expire();
    CheckOk(table_->CheckInvariants(), "invariants at the end");
    Check(arena_->allocator().free_bytes() == arena_->capacity_bytes(),
          "bytes left allocated after every session closed and every region expired");
  }

  void Run() {
    for (int op = 0; op < kMaxOperations && in_->remaining_bytes() > 0; ++op) {
      Step();
      CheckOk(table_->CheckInvariants(), "invariants after operation " + std::to_string(op));
      CheckTotals();
    }
  }

 private:
  using Job = std::map<std::string, ModelRegion>;

  void Open(Slot* s) {
    Hello hello;
    hello.job_id = s->job;
    Result<daemon::SessionGrant> g =
        table_->Open(hello, daemon::PeerCredentials{1234, s->uid, s->uid});
    CheckOk(g.status(), "opening a session");
    s->grant = *g;
    s->open = true;
  }
  Job& JobOf(int slot) { return jobs_[std::to_string(slots_[slot].uid) + ":" + slots_[slot].job]; }
  void Fill(int slot, v1::SessionCredentials* creds) {
    creds->set_session_id(slots_[slot].grant.session_id);
    creds->set_session_token(slots_[slot].grant.token);
  }
  static bool ValidName(const std::string& n) {
    if (n.empty() || n.size() > 255) return false;
    for (char c : n) {
      if (c < 0x21 || c > 0x7e) return false;
    }
    return true;
  }
  // The code every session call starts with: closed session, name, job id.
  StatusCode Preamble(int slot, const std::string& name, bool check_name = true) {
    if (!slots_[slot].open) return StatusCode::kNotFound;
    if (check_name && !ValidName(name)) return StatusCode::kInvalidArgument;
    if (slots_[slot].job.empty()) return StatusCode::kFailedPrecondition;
    return StatusCode::kOk;
  }
  void Expect(StatusCode want, const grpc::Status& got, const std::string& what) {
    Check(static_cast<int>(want) == static_cast<int>(got.error_code()),
          what + ": expected code " + std::to_string(static_cast<int>(want)) + ", got " +
              std::to_string(got.error_code()) + " " + got.error_message());
  }
  // Drops the region when deleted and unread (the table frees it then).
  static void Settle(Job* job, const std::string& name) {
    auto it = job->find(name);
    if (it != job->end() && it->second.deleted && it->second.readers.empty()) job->erase(it);
  }
  uint64_t HeldByJob(const Job& job) const {
    uint64_t held = 0;
    for (const auto& [n, r] : job) held += r.held;
    return held;
  }
  // The bytes and the count of the regions of `uid`, over all its jobs.
  std::pair<uint64_t, size_t> HeldByUid(uid_t uid) const {
    const std::string prefix = std::to_string(uid) + ":";
    std::pair<uint64_t, size_t> held{0, 0};
    for (const auto& [key, job] : jobs_) {
      if (key.compare(0, prefix.size(), prefix) != 0) continue;
      held.first += HeldByJob(job);
      held.second += job.size();
    }
    return held;
  }

  void Step() {
    const int slot = in_->ConsumeIntegralInRange(0, kSlots - 1);
    const std::string name = in_->ConsumeBool() ? kNames[in_->ConsumeIntegralInRange<size_t>(0, 4)]
                                                : in_->ConsumeRandomLengthString(8);
    grpc::ServerContext ctx;
    switch (in_->ConsumeIntegralInRange(0, 9)) {
      case 0: {  // create
        v1::CreateRegionRequest req;
        Fill(slot, req.mutable_session());
        req.set_name(name);
        const uint64_t size = in_->ConsumeIntegralInRange<uint64_t>(0, 3 * kMiB);
        req.set_size_bytes(size);
        req.set_ttl_seconds(in_->ConsumeBool() ? 0 : 7200);
        Job& job = JobOf(slot);
        const uint64_t rounded = (size + 4095) / 4096 * 4096;
        // Count, job, uid and node limits refuse for sure; past them free space
        // in the tenant's chunks decides, which the model does not follow.
        const auto [uid_bytes, uid_count] = HeldByUid(slots_[slot].uid);
        const bool over =
            job.size() >= policy_.max_regions_per_job ||
            (policy_.max_regions_per_uid != 0 && uid_count >= policy_.max_regions_per_uid) ||
            (policy_.region_job_max_bytes != 0 &&
             HeldByJob(job) + rounded > policy_.region_job_max_bytes) ||
            (policy_.region_uid_max_bytes != 0 &&
             uid_bytes + rounded > policy_.region_uid_max_bytes) ||
            table_->Snapshot().region_bytes + rounded > policy_.region_max_bytes;
        v1::CreateRegionResponse resp;
        const grpc::Status st = service_->CreateRegion(&ctx, &req, &resp);
        StatusCode want = Preamble(slot, name);
        if (want == StatusCode::kOk && size == 0) want = StatusCode::kInvalidArgument;
        if (want == StatusCode::kOk && job.count(name) != 0) want = StatusCode::kAlreadyExists;
        if (want == StatusCode::kOk) {
          if (over) {
            want = StatusCode::kResourceExhausted;
          } else if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
            return;  // the arena was full: nothing changed
          }
        }
        Expect(want, st, "CreateRegion " + name);
        if (st.ok()) {
          ModelRegion r;
          r.writer = slot;
          r.held = resp.reserved_bytes();
          Check(r.held == rounded, "CreateRegion reserved the page-rounded size");
          for (const v1::Extent& e : resp.extents()) r.extent_lengths.push_back(e.length());
          job[name] = r;
        }
        return;
      }
      case 1: {  // commit
        v1::CommitRegionRequest req;
        Fill(slot, req.mutable_session());
        req.set_name(name);
        const uint64_t used = in_->ConsumeIntegralInRange<uint64_t>(0, 3 * kMiB);
        req.set_used_bytes(used);
        const size_t crcs = in_->ConsumeIntegralInRange<size_t>(0, 3);
        for (size_t i = 0; i < crcs; ++i) req.add_extent_crc32c(static_cast<uint32_t>(i));
        v1::CommitRegionResponse resp;
        const grpc::Status st = service_->CommitRegion(&ctx, &req, &resp);
        StatusCode want = Preamble(slot, name);
        Job& job = JobOf(slot);
        auto it = job.find(name);
        ModelRegion* r = nullptr;
        if (want == StatusCode::kOk) {
          if (it == job.end() || it->second.deleted) {
            want = StatusCode::kNotFound;
          } else {
            r = &it->second;
            size_t touched = 0;
            for (uint64_t pos = 0; touched < r->extent_lengths.size() && pos < used; ++touched) {
              pos += r->extent_lengths[touched];
            }
            if (r->committed || r->writer != slot) {
              want = StatusCode::kFailedPrecondition;
            } else if (used > r->held || (crcs != 0 && crcs != touched)) {
              want = StatusCode::kInvalidArgument;
            }
          }
        }
        Expect(want, st, "CommitRegion " + name);
        if (st.ok()) {
          const uint64_t kept = (used + 4095) / 4096 * 4096;
          Check(resp.committed_bytes() == kept && resp.returned_bytes() == r->held - kept,
                "CommitRegion kept the page-rounded used bytes");
          r->held = kept;
          r->committed = true;
          r->writer = -1;
        }
        return;
      }
      case 2: {  // open
        v1::OpenRegionRequest req;
        Fill(slot, req.mutable_session());
        req.set_name(name);
        v1::OpenRegionResponse resp;
        const grpc::Status st = service_->OpenRegion(&ctx, &req, &resp);
        StatusCode want = Preamble(slot, name);
        Job& job = JobOf(slot);
        auto it = job.find(name);
        if (want == StatusCode::kOk &&
            (it == job.end() || it->second.deleted || !it->second.committed)) {
          want = StatusCode::kNotFound;
        }
        Expect(want, st, "OpenRegion " + name);
        if (st.ok()) it->second.readers.push_back(slot);
        return;
      }
      case 3: {  // close
        v1::CloseRegionRequest req;
        Fill(slot, req.mutable_session());
        req.set_name(name);
        v1::CloseRegionResponse resp;
        const grpc::Status st = service_->CloseRegion(&ctx, &req, &resp);
        StatusCode want = Preamble(slot, name);
        Job& job = JobOf(slot);
        auto it = job.find(name);
        std::vector<int>::iterator reader;
        if (want == StatusCode::kOk) {
          if (it == job.end()) {
            want = StatusCode::kFailedPrecondition;
          } else {
            auto& readers = it->second.readers;
            reader = std::find(readers.begin(), readers.end(), slot);
            if (reader == readers.end()) want = StatusCode::kFailedPrecondition;
          }
        }
        Expect(want, st, "CloseRegion " + name);
        if (st.ok()) {
          it->second.readers.erase(reader);
          Settle(&job, name);
        }
        return;
      }
      case 4: {  // delete by a session
        v1::DeleteRegionRequest req;
        Fill(slot, req.mutable_session());
        req.set_name(name);
        v1::DeleteRegionResponse resp;
        const grpc::Status st = service_->DeleteRegion(&ctx, &req, &resp);
        StatusCode want = Preamble(slot, name);
        Job& job = JobOf(slot);
        auto it = job.find(name);
        if (want == StatusCode::kOk) {
          if (it == job.end() || it->second.deleted) {
            want = StatusCode::kNotFound;
          } else if (!it->second.committed && it->second.writer != slot) {
            want = StatusCode::kFailedPrecondition;
          }
        }
        Expect(want, st, "DeleteRegion " + name);
        if (st.ok()) {
          Check(resp.freed_bytes() == (it->second.readers.empty() ? it->second.held : 0),
                "DeleteRegion freed bytes");
          it->second.deleted = true;
          Settle(&job, name);
        }
        return;
      }
      case 5: {  // the operator's delete
        v1::DeleteRegionRequest req;
        const bool right = in_->ConsumeBool();
        req.set_admin_token(right ? kAdminToken : "wrong");
        req.set_uid(slots_[slot].uid);
        req.set_job_id(slots_[slot].job);
        req.set_name(name);
        v1::DeleteRegionResponse resp;
        const grpc::Status st = service_->DeleteRegion(&ctx, &req, &resp);
        Job& job = JobOf(slot);
        auto it = job.find(name);
        StatusCode want = StatusCode::kOk;
        if (!right) {
          want = StatusCode::kPermissionDenied;
        } else if (!ValidName(name)) {
          want = StatusCode::kInvalidArgument;
        } else if (it == job.end() || it->second.deleted) {
          want = StatusCode::kNotFound;
        } else if (!it->second.committed) {
          want = StatusCode::kFailedPrecondition;
        }
        Expect(want, st, "admin DeleteRegion " + name);
        if (st.ok()) {
          it->second.deleted = true;
          Settle(&job, name);
        }
        return;
      }
      case 6: {  // list
        v1::ListRegionsRequest req;
        Fill(slot, req.mutable_session());
        const std::string prefix = in_->ConsumeBool() ? "" : name;
        req.set_prefix(prefix);
        v1::ListRegionsResponse resp;
        const grpc::Status st = service_->ListRegions(&ctx, &req, &resp);
        Expect(Preamble(slot, prefix, /*check_name=*/false), st, "ListRegions");
        if (!st.ok()) return;
        std::vector<std::string> want;
        for (const auto& [n, r] : JobOf(slot)) {
          if (r.committed && !r.deleted && n.compare(0, prefix.size(), prefix) == 0) {
            want.push_back(n);
          }
        }
        Check(static_cast<size_t>(resp.regions_size()) == want.size(), "ListRegions count");
        for (int i = 0; i < resp.regions_size(); ++i) {
          Check(resp.regions(i).name() == want[i], "ListRegions names, in order");
        }
        return;
      }
      case 7:  // the TTL sweep, past every TTL
        Expire();
        return;
      case 8:  // the session ends (its process died), and a new one opens
        if (slots_[slot].open) EndSession(slot);
        Open(&slots_[slot]);
        return;
      default: {  // raw bytes as a region request, maybe with real credentials
        const std::string raw = in_->ConsumeRandomLengthString(256);
        const bool creds = in_->ConsumeBool();
        RawRequest(raw, creds ? slot : -1);
        return;
      }
    }
  }

  template <typename Req>
  bool Parse(const std::string& raw, int slot, Req* req) {
    if (!req->ParseFromString(raw)) return false;
    if (slot >= 0) Fill(slot, req->mutable_session());
    // Only the session's own and garbage credentials: a real session's
    // calls go through the model above.
    return slot < 0 && !req->has_session();
  }

  void RawRequest(const std::string& raw, int slot) {
    grpc::ServerContext ctx;
    // Without credentials every call is refused before the table changes.
    v1::CreateRegionRequest create;
    if (Parse(raw, slot, &create)) {
      v1::CreateRegionResponse resp;
      Check(!service_->CreateRegion(&ctx, &create, &resp).ok(), "CreateRegion without session");
    }
    v1::OpenRegionRequest open;
    if (Parse(raw, slot, &open)) {
      v1::OpenRegionResponse resp;
      Check(!service_->OpenRegion(&ctx, &open, &resp).ok(), "OpenRegion without session");
    }
    v1::DeleteRegionRequest del;
    if (del.ParseFromString(raw) && !del.has_session() && del.admin_token() != kAdminToken) {
      v1::DeleteRegionResponse resp;
      Check(!service_->DeleteRegion(&ctx, &del, &resp).ok(), "DeleteRegion without credentials");
    }
    v1::ListRegionsRequest list;
    if (list.ParseFromString(raw) && !list.has_session()) {
      v1::ListRegionsResponse resp;
      CheckOk(
          Status(static_cast<StatusCode>(service_->ListRegions(&ctx, &list, &resp).error_code()),
                 "admin list"),
          "ListRegions without a session (an admin read)");
      Check(resp.regions_size() <= 4 * 4, "ListRegions lists more regions than can exist");
    }
  }

  void EndSession(int slot) {
    auto closed = table_->Close(slots_[slot].grant.session_id, daemon::CloseReason::kProcessExited);
    CheckOk(closed.status(), "closing a session");
    slots_[slot].open = false;
    uint64_t freed_bytes = 0;
    uint32_t freed = 0;
    for (auto& [key, job] : jobs_) {
      for (auto it = job.begin(); it != job.end();) {
        auto next = std::next(it);
        ModelRegion& r = it->second;
        r.readers.erase(std::remove(r.readers.begin(), r.readers.end(), slot), r.readers.end());
        if (!r.committed && r.writer == slot) r.deleted = true;
        if (r.deleted && r.readers.empty()) {
          freed_bytes += r.held;
          ++freed;
        }
        Settle(&job, it->first);
        it = next;
      }
    }
    Check(closed->regions == freed && closed->region_bytes == freed_bytes,
          "Close freed " + std::to_string(closed->regions) + " regions of " +
              std::to_string(closed->region_bytes) + " bytes, model " + std::to_string(freed) +
              " of " + std::to_string(freed_bytes));
  }

  void Expire() {
    table_->ExpireRegions(std::chrono::steady_clock::now() + std::chrono::hours(48));
    for (auto& [key, job] : jobs_) {
      for (auto it = job.begin(); it != job.end();) {
        auto next = std::next(it);
        if (it->second.committed) it->second.deleted = true;
        Settle(&job, it->first);
        it = next;
      }
    }
  }

  void CheckTotals() {
    uint64_t held = 0, count = 0, committed = 0;
    for (const auto& [key, job] : jobs_) {
      for (const auto& [n, r] : job) {
        held += r.held;
        ++count;
        if (r.committed && !r.deleted) committed += r.held;
      }
    }
    const daemon::ArenaSnapshot s = table_->Snapshot();
    Check(s.region_bytes == held && s.regions == count && s.committed_region_bytes == committed,
          "region totals: table " + std::to_string(s.region_bytes) + " bytes in " +
              std::to_string(s.regions) + ", model " + std::to_string(held) + " in " +
              std::to_string(count));
  }

  FuzzedDataProvider* in_;
  daemon::Arena* arena_;
  daemon::Policy policy_;
  std::unique_ptr<daemon::SessionTable> table_;
  std::unique_ptr<daemon::Metrics> metrics_;
  std::unique_ptr<daemon::OffloadService> service_;
  Slot slots_[kSlots];
  std::map<std::string, Job> jobs_;  // by "uid:job"
};

}  // namespace
}  // namespace memoffload::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  memoffload::fuzz::Harness harness(&in);
  harness.Run();
  return 0;
}
