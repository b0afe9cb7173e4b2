// The shadow model of fuzz_service.cc: what two sessions hold, and what the
// daemon must answer to the credentials and requests the fuzz input makes.
// Harness (fuzz_service.cc) drives the real service and checks every answer
// against it.
#ifndef MEMOFFLOAD_TESTS_FUZZ_FUZZ_SERVICE_MODEL_H_
#define MEMOFFLOAD_TESTS_FUZZ_FUZZ_SERVICE_MODEL_H_

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/session_table.h"
#include "fuzz_common.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::fuzz {

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

class ServiceModel {
 protected:
  explicit ServiceModel(FuzzedDataProvider* in) : in_(in) {}

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

  uint64_t UidHeld(uid_t uid) const {
    uint64_t sum = 0;
    for (const ModelSession& s : sessions_) {
      if (s.open && s.uid == uid) sum += s.Held();
    }
    return sum;
  }

  uint64_t TotalHeld() const {
    uint64_t sum = 0;
    for (const ModelSession& s : sessions_) sum += s.open ? s.Held() : 0;
    return sum;
  }

  FuzzedDataProvider* in_;
  uint64_t page_ = 0;
  daemon::TenantMode tenant_mode_ = daemon::TenantMode::kUid;
  ModelSession sessions_[2];
  std::vector<uint64_t> closed_ids_;
  std::map<std::string, uint64_t> job_requested_;
};

}  // namespace memoffload::fuzz

#endif  // MEMOFFLOAD_TESTS_FUZZ_FUZZ_SERVICE_MODEL_H_
