#include "app/takeover_host.h"

#include <boost/asio/post.hpp>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <thread>

#include "base/log.h"

namespace memoffload::daemon {

using Clock = std::chrono::steady_clock;

bool LoopTakeoverHost::OnLoop(const std::function<void()>& f) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> waited = done->get_future();
  boost::asio::post(*p_.io, [f, done] {
    f();
    done->set_value();
  });
  while (waited.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
    if (p_.io->stopped()) return false;
  }
  return true;
}

bool LoopTakeoverHost::PauseForTakeover(pid_t pid, bool keep_sessions,
                                        const std::function<bool()>& gone) {
  OnLoop(p_.pause_timers);
  keep_sessions_ = keep_sessions;
  was_draining_ = p_.table->draining();
  if (keep_sessions) {
    // Under the table's lock: every call answered from here on is refused
    // (and sent again by its client), so the records below are the last word.
    p_.table->SetFrozen(true);
    MO_LOG_INFO("take-over by pid %d: sessions paused (%u)", static_cast<int>(pid),
                p_.table->Snapshot().sessions);
    return true;
  }
  if (Status st = p_.table->SetDraining(true); !st.ok()) {
    MO_LOG_WARN("take-over: %s", st.ToString().c_str());
  }
  MO_LOG_INFO("take-over by pid %d: draining (up to %lu ms)", static_cast<int>(pid),
              static_cast<unsigned long>(p_.drain_timeout_ms));
  const auto until = Clock::now() + std::chrono::milliseconds(p_.drain_timeout_ms);
  while (Clock::now() < until && !gone()) {
    const ArenaSnapshot s = p_.table->Snapshot();
    if (s.group_bytes() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (gone()) return false;
  OnLoop(p_.close_sessions);
  p_.table->SetFrozen(true);
  return true;
}

Result<HandoffState> LoopTakeoverHost::Freeze() {
  // Before a chunk's fd leaves: what the new daemon hands out is in its
  // record only, so a start from this store must not believe this one.
  if (p_.disown_handed) p_.disown_handed();
  HandoffState out;
  out.instance_id = p_.instance_id;
  SnapshotContents snapshot;
  snapshot.instance_id = p_.instance_id;
  snapshot.layout = ArenaLayout{p_.arena->capacity_bytes(), p_.arena->chunk_size_bytes(),
                                static_cast<uint32_t>(p_.arena->page_bytes())};
  snapshot.last_seq = p_.last_seq();
  for (RegionRecord& r : p_.table->CommittedRegions()) snapshot.regions[KeyOf(r)] = r;
  if (keep_sessions_) snapshot.sessions = p_.table->SessionRecords();
  out.snapshot = EncodeSnapshot(snapshot);
  out.tenants = p_.table->tenant_mode() != TenantMode::kNone;
  std::map<uint32_t, SessionTable::ChunkOwner> owners;
  for (const auto& o : p_.table->ChunkOwners()) owners[o.chunk] = o;
  // Draining and frozen, no chunk changes tenant (and backing) any more.
  for (uint32_t i = 0; i < p_.arena->chunk_count(); ++i) {
    const auto it = owners.find(i);
    out.chunks.push_back(HandoffState::Chunk{i, p_.arena->chunk(i).fd(),
                                             it != owners.end() ? it->second.tenant : "",
                                             it != owners.end() ? it->second.uid : 0});
  }
  return out;
}

void LoopTakeoverHost::ServeOn(const std::string& why) {
  MO_LOG_WARN("take-over did not happen: %s; serving on", why.c_str());
  p_.table->SetFrozen(false);
  if (Status st = p_.table->SetDraining(was_draining_); !st.ok()) {
    MO_LOG_WARN("take-over: %s", st.ToString().c_str());
  }
  OnLoop(p_.resume_timers);
}

Result<HandoffListeners> LoopTakeoverHost::Release() {
  HandoffListeners l;
  if (!OnLoop([&] { l = p_.release(); })) return Internal("the event loop stopped");
  // The new daemon keeps the state from here: nothing is recorded any more.
  p_.table->SetRecorder(nullptr);
  return l;
}

void LoopTakeoverHost::Exit() { boost::asio::post(*p_.io, p_.stop_loop); }

void UseHandedState(const TakeoverClient& client, StateLoad* load) {
  CloseChunkFds(load);
  load->chunk_fds.clear();
  const SnapshotContents& snapshot = client.snapshot();
  load->state = ReplayedState{};
  load->state.found = true;
  load->state.instance_id = client.instance_id();
  load->state.layout = snapshot.layout;
  load->state.last_seq = snapshot.last_seq;
  load->state.regions = snapshot.regions;
  load->state.sessions = snapshot.sessions;
}

}  // namespace memoffload::daemon
