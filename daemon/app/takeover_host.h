// The serving daemon's side of a take-over (takeover.h) over the daemon's
// parts: the table's steps run where they are (it is thread-safe), those of
// the event loop's objects (timers, broker, ports, listeners) run on the
// loop, the take-over's thread waiting for each.
#ifndef MEMOFFLOAD_DAEMON_TAKEOVER_HOST_H_
#define MEMOFFLOAD_DAEMON_TAKEOVER_HOST_H_

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <string>

#include "app/state_store.h"
#include "app/takeover.h"
#include "core/session_table.h"
#include "memory/arena.h"

namespace memoffload::daemon {

struct TakeoverParts {
  boost::asio::io_context* io = nullptr;
  SessionTable* table = nullptr;
  const Arena* arena = nullptr;
  uint64_t instance_id = 0;
  uint64_t drain_timeout_ms = 0;
  std::function<uint64_t()> last_seq;  // the state store's last record, 0 without one
  // Run on the event loop:
  std::function<void()> pause_timers;    // nothing expires while it drains
  std::function<void()> resume_timers;   // it serves on
  std::function<void()> close_sessions;  // every broker connection and its session
  // Stops the metrics and health ports, gives up the listeners and the lock
  // (the files stay: the new daemon uses them).
  std::function<HandoffListeners()> release;
  std::function<void()> stop_loop;
  // The chunks go to the new daemon: the state store's record of those
  // handed out is never believed again (StateStore::DisownHandedRecord).
  std::function<void()> disown_handed;
};

class LoopTakeoverHost : public TakeoverHost {
 public:
  explicit LoopTakeoverHost(TakeoverParts parts) : p_(std::move(parts)) {}
  bool PauseForTakeover(pid_t pid, bool keep_sessions, const std::function<bool()>& gone) override;
  Result<HandoffState> Freeze() override;
  void ServeOn(const std::string& why) override;
  Result<HandoffListeners> Release() override;
  void Exit() override;

 private:
  // Runs `f` on the event loop and waits for it (not once the loop stopped);
  // false when it did not run.
  bool OnLoop(const std::function<void()>& f);
  const TakeoverParts p_;
  bool was_draining_ = false;  // an operator's drain, restored by ServeOn
  bool keep_sessions_ = false;
};

// The state a take-over handed on, as a start's StateLoad: `load` keeps the
// store this daemon opened (its fds are closed: the chunks come from the
// serving daemon) and gets the handed snapshot as the state found.
void UseHandedState(const TakeoverClient& client, StateLoad* load);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_TAKEOVER_HOST_H_
