#include "core/refusal_log.h"

#include <iterator>

namespace memoffload::daemon {

std::optional<uint64_t> RefusalLog::Admit(const std::string& key, Clock::time_point now) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    Entry& e = it->second;
    if (now - e.logged_at < interval_) {
      ++e.left_out;
      return std::nullopt;
    }
    const uint64_t left_out = e.left_out;
    e = Entry{now, 0};
    return left_out;
  }
  if (entries_.size() >= kMaxKeys) {
    // Forget the keys that could log again anyway (what they left out is
    // lost with them: bounded memory comes first).
    for (auto e = entries_.begin(); e != entries_.end();) {
      e = now - e->second.logged_at >= interval_ ? entries_.erase(e) : std::next(e);
    }
    if (entries_.size() >= kMaxKeys) return 0;
  }
  entries_.emplace(key, Entry{now, 0});
  return 0;
}

}  // namespace memoffload::daemon
