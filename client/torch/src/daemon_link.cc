#include "daemon_link.h"

#include <string>
#include <utility>

#include "memoffload/client/log.h"

namespace memoffload::torch {

using client::Client;

bool IsTransport(StatusCode code) {
  return code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded ||
         code == StatusCode::kCancelled;
}

DaemonLink::DaemonLink(const OffloaderOptions& options, CopyEngine* pinning_engine,
                       StatsBook* stats)
    : options_(options), pinning_engine_(pinning_engine), stats_(stats) {}

std::shared_ptr<Client> DaemonLink::Ensure(bool force) {
  if (client_ && !broken_) return client_;
  const auto now = Clock::now();
  if (!force && attempted_ &&
      now - last_attempt_ < std::chrono::milliseconds(options_.reconnect_interval_ms)) {
    return nullptr;
  }
  attempted_ = true;
  last_attempt_ = now;
  client::AttachOptions attach;
  attach.runtime_dir = options_.runtime_dir;
  attach.job_id = options_.job_id;
  attach.rank = options_.rank;
  attach.local_rank = options_.local_rank;
  attach.rpc_timeout_ms = options_.rpc_timeout_ms;
  attach.kind = SessionKind::kActivations;
  Result<std::unique_ptr<Client>> attached = Client::Attach(attach);
  if (!attached.ok()) {
    NoteFailure(attached.status(), "attach");
    return nullptr;
  }
  const bool reconnect = client_ != nullptr;
  // The last holder of a client (this session or a group still reading
  // from the old chunks) unmaps them: drop their CUDA registrations first.
  CopyEngine* engine = pinning_engine_;
  client_ = std::shared_ptr<Client>(std::move(attached).value().release(), [engine](Client* c) {
    if (engine != nullptr) engine->ForgetHostRanges(c);
    delete c;
  });
  broken_ = false;
  stats_->Count([reconnect](OffloaderStats& s) {
    s.connected = true;
    if (reconnect) ++s.reconnects;
  });
  if (reconnect) {
    client::Log(client::LogLevel::kInfo, StatusCode::kOk, "attached a new session to memoffloadd",
                options_.rank);
  }
  return client_;
}

void DaemonLink::NoteFailure(const Status& st, const char* what) {
  if (IsTransport(st.code()) && client_) broken_ = true;
  stats_->Count([&](OffloaderStats& s) {
    ++s.rpc_errors;
    if (IsTransport(st.code())) s.connected = false;
    s.last_skip_reason = std::string(what) + ": " + st.message();  // the code: last_skip_code
    s.last_skip_code = st.code();
  });
  const bool first = logged_codes_.insert(static_cast<int>(st.code())).second;
  if (first) {
    client::Log(
        client::LogLevel::kWarning, st.code(),
        std::string(what) + " failed (" + st.ToString() +
            "); affected groups stay in memory, training goes on (logged once per error code)",
        options_.rank);
  }
}

}  // namespace memoffload::torch
