// Taking the node over, handing it on and standing by (app/daemon_process.h,
// app/takeover.h).
#include <csignal>
#include <cstring>

#include "app/daemon_parts.h"
#include "app/daemon_process.h"
#include "app/state_store.h"
#include "base/log.h"
#include "core/session_token.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {

namespace asio = boost::asio;

bool Daemon::TakesOver() const {
  if (config_.take_over != "auto") return config_.take_over == "always";
  if (RuntimeDirClaim::Held(config_.runtime_dir)) return true;
  MO_LOG_INFO("lifecycle.take_over = auto: no daemon serves %s; starting",
              config_.runtime_dir.c_str());
  return false;
}

Status Daemon::StandBy() {
  MO_LOG_WARN(
      "the state store (the keeper at %s) holds the mark of a hand-over: the node went from "
      "this pod to another pod's daemon, and this copy is stale since; not serving: delete "
      "this pod (%s)",
      config_.keeper_socket.c_str(),
      RuntimeDirClaim::Held(config_.runtime_dir)
          ? "another daemon serves the node"
          : "no daemon serves the node now: docs/restarts.md, 'Take-over across pods'");
  if (!config_.health_address.empty()) {
    Result<std::string> bound = health_.Start(config_.health_address);
    if (!bound.ok()) return bound.status();
  }
  signals_.add(SIGINT);
  signals_.add(SIGTERM);
  signals_.add(SIGHUP);
  handed_over_ = standing_by_ = true;
  return Status::Ok();
}

void Daemon::WaitForStop() {
  claim_.reset();  // its instance lock is the new daemon's alone
  MO_LOG_INFO("%s: waiting for a signal to exit%s; /livez answers 200, /readyz 503",
              standing_by_ ? "standing by" : "handed over",
              standing_by_ ? "" : " (lifecycle.after_handover = wait)");
  io_.restart();
  io_.run();  // OnSignal stops it
}

void Daemon::MarkHandedOver() {
  if (state_store_ == nullptr) return;
  if (Status st = state_store_->MarkHandedOver("handed over by pid " + std::to_string(getpid()));
      !st.ok()) {
    MO_LOG_ERROR(
        "cannot mark the state store as handed over: %s; a restart of this daemon before its "
        "pod goes could take the node back",
        st.ToString().c_str());
  }
}

Status Daemon::RequestTakeover() {
  takeover_started_ = Clock::now();
  if (notifier_.Enabled()) {
    return FailedPrecondition(
        "--take-over under systemd: restart the unit instead (systemctl restart memoffloadd; "
        "its fd store keeps the checkpoint regions)");
  }
  Result<std::string> token = NewSessionToken();
  if (!token.ok()) return token.status();
  admin_token_ = *token;
  MEMOFFLOAD_RETURN_IF_ERROR(PrepareListening());
  MO_LOG_INFO(
      "taking over the node from the daemon serving %s (its sessions pause, then resume "
      "here)",
      config_.runtime_dir.c_str());
  Result<std::unique_ptr<TakeoverClient>> client =
      TakeoverClient::Request(config_.runtime_dir, config_.drain_timeout_ms);
  if (!client.ok() && config_.take_over == "auto") {
    return Status(client.status().code(),
                  "lifecycle.take_over = auto: " + config_.runtime_dir + "/" + kInstanceLockName +
                      " is held, but no daemon takes the node over from there (a process that "
                      "is not memoffloadd may hold the lock: /proc/locks names it): " +
                      client.status().message());
  }
  if (!client.ok()) return client.status();
  takeover_client_ = std::move(client).value();
  // The store this daemon keeps state in (what the old one put there is
  // replaced by Begin).
  Result<StateLoad> load = LoadState(config_.state_store, config_.keeper_socket);
  if (!load.ok()) {
    takeover_client_->Refuse("cannot open the state store: " + load.status().message());
    return load.status();
  }
  kept_ = std::move(load).value();
  UseHandedState(*takeover_client_, &kept_);
  return Status::Ok();
}

Status Daemon::TakeListeners() {
  Result<HandoffListeners> l = takeover_client_->Ready(
      broker_path_, grpc_path_, config_.runtime_dir + "/" + kInstanceLockName);
  if (!l.ok()) return l.status();
  Result<std::unique_ptr<RuntimeDirClaim>> claim =
      RuntimeDirClaim::Adopt(config_.runtime_dir, l->lock_fd);
  if (!claim.ok()) {
    close(l->grpc_fd);
    close(l->broker_fd);
    return claim.status();
  }
  claim_ = std::move(claim).value();
  claim_->Own(grpc_path_);
  claim_->Own(broker_path_);
  return ListenOn(l->grpc_fd, l->broker_fd, /*lenient=*/true);
}

}  // namespace memoffload::daemon
