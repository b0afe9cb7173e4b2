// The daemon's signals, its drain and its stop (app/daemon_process.h).
#include <boost/asio/post.hpp>
#include <cstring>

#include "app/config_changes.h"
#include "app/daemon_parts.h"
#include "app/daemon_process.h"
#include "app/process_setup.h"
#include "app/systemd_job.h"  // SigtermKeepsSessions
#include "base/log.h"
#include "memoffload/common/units.h"
#include "memory/kept_mapping.h"

namespace memoffload::daemon {

namespace asio = boost::asio;

void Daemon::KeepState() {
  if (state_store_ == nullptr) return;
  if (Status st = state_store_->Compact(kept_sessions_, kept_owners_); !st.ok()) {
    MO_LOG_ERROR("cannot write the state snapshot: %s; the next start replays the journal",
                 st.ToString().c_str());
    return;
  }
  const ArenaSnapshot s = table_->Snapshot();
  MO_LOG_INFO(
      "state kept in %s: %u checkpoint region%s (%s) and %zu session%s for the next start (a "
      "restart takes them back; a full stop of the store releases them)",
      state_store_->Describe().c_str(), s.committed_regions, s.committed_regions == 1 ? "" : "s",
      FormatSize(s.committed_region_bytes).c_str(), kept_sessions_.size(),
      kept_sessions_.size() == 1 ? "" : "s");
}

void Daemon::ArmRegionTimer() {
  region_timer_.expires_after(std::chrono::seconds(1));
  region_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;
    for (const std::string& line : table_->CloseUnresumed(Clock::now())) {
      MO_LOG_WARN("handed sessions: %s", line.c_str());
    }
    if (uint64_t expired = table_->ExpireRegions(Clock::now()); expired != 0) {
      MO_LOG_INFO("deleted %lu checkpoint region%s past %s TTL",
                  static_cast<unsigned long>(expired), expired == 1 ? "" : "s",
                  expired == 1 ? "its" : "their");
    }
    ArmRegionTimer();
  });
}

void Daemon::ArmNotifyTimer() {
  notify_timer_.expires_after(notifier_.WatchdogEnabled()
                                  ? notifier_.WatchdogInterval()
                                  : std::chrono::microseconds(std::chrono::seconds(10)));
  notify_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;
    notifier_.WatchdogPing();
    notifier_.Status(StatusText());
    ArmNotifyTimer();
  });
}

void Daemon::OnSignal(const boost::system::error_code& ec, int signo) {
  if (ec) return;
  if (handed_over_) {
    MO_LOG_INFO("received %s after the hand-over", strsignal(signo));
    io_.stop();
    return;
  }
  if (signo == SIGHUP) {
    Reload();
  } else if (signo == SIGTERM && !draining_for_exit_) {
    if (KeepsSessions()) {
      KeepSessions();
    } else {
      BeginDrain();
    }
  } else {
    MO_LOG_INFO("received %s: stopping now", strsignal(signo));
    notifier_.Stopping();
    StopLoop();
    return;
  }
  signals_.async_wait([this](const boost::system::error_code& e, int n) { OnSignal(e, n); });
}

void Daemon::Reload() {
  Result<DaemonConfig> fresh = ReloadConfig(config_, argc_, argv_, ProcessEnvironment());
  if (!fresh.ok()) {
    MO_LOG_ERROR("config reload rejected, keeping the previous configuration: %s",
                 fresh.status().message().c_str());
    return;
  }
  if (std::string problem = ReloadProblem(*fresh, arena_->capacity_bytes()); !problem.empty()) {
    MO_LOG_ERROR("config reload rejected, keeping the previous configuration: %s", problem.c_str());
    return;
  }
  LogConfigChanges(config_, *fresh);
  ApplyLiveSettings(*fresh, &config_);
  table_->SetPolicy(config_.policy);
  broker_->SetPolicy(config_.policy);
  grpc_listener_.SetPolicy(config_.policy);
  service_->SetConfig(config_);
  if (Status keys = LoadLinkKeys(config_, &link_keys_); !keys.ok()) {
    MO_LOG_ERROR("replication keys not reloaded, keeping the previous ones: %s",
                 keys.message().c_str());
  }
  MO_LOG_INFO("config reloaded from %s", config_.config_file.c_str());
}

bool Daemon::KeepsSessions() const {
  return SigtermKeepsSessions(config_.keep_sessions, state_store_ != nullptr, notifier_.Enabled(),
                              *table_);
}

void Daemon::KeepSessions() {
  draining_for_exit_ = true;
  notifier_.Stopping();
  table_->SetFrozen(true);
  kept_sessions_ = table_->SessionRecords();
  kept_owners_ = table_->ChunkOwners();
  // Grants still answered while it exits go unrecorded from here: their
  // chunks (a tenant's own) count as handed out now.
  std::vector<uint32_t> owned;
  for (const ChunkOwnerRecord& o : kept_owners_) owned.push_back(o.chunk);
  state_store_->ChunksHanded(owned);
  // Closing the sessions as the daemon exits changes nothing kept.
  table_->SetRecorder(nullptr);
  const ArenaSnapshot s = table_->Snapshot();
  MO_LOG_INFO(
      "received SIGTERM: keeping %zu session%s (%s in groups) and %u checkpoint region%s (%s) "
      "in %s for the next start; their processes resume them within %lld s of it "
      "(memoffloadctl drain before a stop ends them instead)",
      kept_sessions_.size(), kept_sessions_.size() == 1 ? "" : "s",
      FormatSize(s.group_bytes()).c_str(), s.committed_regions, s.committed_regions == 1 ? "" : "s",
      FormatSize(s.committed_region_bytes).c_str(), state_store_->Describe().c_str(),
      static_cast<long long>(kResumeWithin.count()));
  broker_->NoticeResume("memoffloadd restarts keeping this session: resume it on the next one");
  drain_deadline_ = Clock::now() + std::chrono::milliseconds(500);
  StopOnceNoticed();
}

void Daemon::StopOnceNoticed() {
  if (broker_->Flushed() || Clock::now() >= drain_deadline_) return StopLoop();
  drain_timer_.expires_after(std::chrono::milliseconds(5));
  drain_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec) StopOnceNoticed();
  });
}

void Daemon::BeginDrain() {
  draining_for_exit_ = true;
  notifier_.Stopping();
  const ArenaSnapshot s = table_->Snapshot();
  // The bytes waited for are the groups'; regions are not (CheckDrained).
  MO_LOG_INFO(
      "received SIGTERM: draining (%u sessions, %s held in groups; deadline %lu ms; "
      "%u checkpoint region%s (%s) not waited for)",
      s.sessions, FormatSize(s.group_bytes()).c_str(),
      static_cast<unsigned long>(config_.drain_timeout_ms), s.regions, s.regions == 1 ? "" : "s",
      FormatSize(s.region_bytes).c_str());
  table_->BeginShutdown();
  drain_deadline_ = Clock::now() + std::chrono::milliseconds(config_.drain_timeout_ms);
  CheckDrained();
}

void Daemon::CheckDrained() {
  const ArenaSnapshot s = table_->Snapshot();
  // Groups are what sessions still need to hand back; checkpoint regions
  // do not survive the exit whatever the wait, so they are not waited for.
  const uint64_t groups_bytes = s.group_bytes();
  const bool empty = groups_bytes == 0;
  if (empty || Clock::now() >= drain_deadline_) {
    if (!empty) {
      MO_LOG_WARN("drain deadline passed with %s still held by %u sessions; stopping",
                  FormatSize(groups_bytes).c_str(), s.sessions);
    } else {
      MO_LOG_INFO("drained: no groups held");
    }
    if (s.regions != 0 && state_store_ == nullptr) {
      MO_LOG_WARN(
          "%u checkpoint region%s (%s) end with the daemon; jobs load from their "
          "durable checkpoints after it restarts",
          s.regions, s.regions == 1 ? "" : "s", FormatSize(s.region_bytes).c_str());
    }
    StopLoop();
    return;
  }
  drain_timer_.expires_after(std::chrono::milliseconds(50));
  drain_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec) CheckDrained();
  });
}

void Daemon::StopLoop() {
  notify_timer_.cancel();
  region_timer_.cancel();
  drain_timer_.cancel();
  if (!WaitsAfterHandover()) health_.Stop();
  metrics_port_.Stop();
  if (broker_ != nullptr) broker_->StopAccepting();
  grpc_listener_.Stop();
  if (broker_ != nullptr) broker_->CloseAll();
  io_.stop();
}

void Daemon::StopServing() {
  grpc_listener_.Stop();
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  server_->Wait();
  server_.reset();
}

void Daemon::MapKeptChunks() {
  if (kept_to_map_.empty()) {
    arena_->MappedKept(0);  // every kept chunk was renewed (pre-faulted anew)
    return;
  }
  kept_mapper_ = std::thread([this] {
    // Half the pre-fault's threads: the daemon serves meanwhile.
    const KeptMapping m =
        MapKept(kept_to_map_, std::max(1, config_.prefault_threads / 2), stop_mapping_);
    kept_to_map_.clear();
    if (m.stopped) return;
    arena_->MappedKept(m.thp_bytes);
    const std::string huge =
        m.thp_bytes == 0 ? "" : ", " + FormatSize(m.thp_bytes) + " of them on 2 MiB pages";
    MO_LOG_INFO("kept chunks mapped: %u (%s) in %.3f s after ready%s", m.chunks,
                FormatSize(m.bytes).c_str(), m.seconds, huge.c_str());
  });
}

void Daemon::StopMappingKept() {
  stop_mapping_ = true;
  if (kept_mapper_.joinable()) kept_mapper_.join();
}

}  // namespace memoffload::daemon
