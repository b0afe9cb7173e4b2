// RefusalLog: decides which refused Reserves the daemon logs. A full arena
// refuses a trainer's every group of every step: the operator needs to know
// that it happens and to whom, not each refusal. So per key (uid and job id)
// at most one line per interval is admitted, and the admitted line tells how
// many refusals of that key were left out since the one before.
//
// Thread-safe: Admit may be called from any thread.
#ifndef MEMOFFLOAD_DAEMON_REFUSAL_LOG_H_
#define MEMOFFLOAD_DAEMON_REFUSAL_LOG_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace memoffload::daemon {

class RefusalLog {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::seconds kDefaultInterval{10};
  // Keys remembered at most; past it, keys quiet for an interval are
  // forgotten, and a refusal with no room left is admitted untracked.
  static constexpr size_t kMaxKeys = 1024;

  explicit RefusalLog(Clock::duration interval = kDefaultInterval) : interval_(interval) {}

  // A refusal of `key` at `now`: the number of refusals of `key` not logged
  // since its last logged one when this one is to be logged, nullopt when it
  // is left out (and counted).
  std::optional<uint64_t> Admit(const std::string& key, Clock::time_point now)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    Clock::time_point logged_at;
    uint64_t left_out = 0;
  };
  const Clock::duration interval_;
  absl::Mutex mu_;
  std::unordered_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_REFUSAL_LOG_H_
