// Minimal leveled logging to stderr: "memoffloadd[pid] LEVEL message".
// Thread-safe (one write(2) per line). Journald and kubectl logs add their
// own timestamps, so none is printed.
#ifndef MEMOFFLOAD_DAEMON_LOG_H_
#define MEMOFFLOAD_DAEMON_LOG_H_

#include <atomic>

namespace memoffload::daemon {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
void Log(LogLevel level, const char* format, ...) __attribute__((format(printf, 2, 3)));

#define MO_LOG_INFO(...) \
  ::memoffload::daemon::Log(::memoffload::daemon::LogLevel::kInfo, __VA_ARGS__)
#define MO_LOG_WARN(...) \
  ::memoffload::daemon::Log(::memoffload::daemon::LogLevel::kWarning, __VA_ARGS__)
#define MO_LOG_ERROR(...) \
  ::memoffload::daemon::Log(::memoffload::daemon::LogLevel::kError, __VA_ARGS__)
#define MO_LOG_DEBUG(...) \
  ::memoffload::daemon::Log(::memoffload::daemon::LogLevel::kDebug, __VA_ARGS__)

// Admits at most kBurst lines per call site per second; the next admitted
// line reports how many were suppressed in between. Thread-safe. Every line
// a peer can trigger (a refused connection, a bad frame, a failing accept)
// goes through MO_LOG_WARN_LIMITED, so no peer can flood the journal.
class LogRateLimiter {
 public:
  static constexpr int kBurst = 5;
  // True when this line may be written; *suppressed is set to the lines
  // dropped since the last admitted one.
  bool Allow(unsigned long* suppressed);

 private:
  std::atomic<long long> window_start_ms_{0};
  std::atomic<int> in_window_{0};
  std::atomic<unsigned long> suppressed_{0};
};

#define MO_LOG_LIMITED(level, ...)                                                    \
  do {                                                                                \
    static ::memoffload::daemon::LogRateLimiter mo_log_limiter;                       \
    unsigned long mo_log_suppressed = 0;                                              \
    if (mo_log_limiter.Allow(&mo_log_suppressed)) {                                   \
      if (mo_log_suppressed != 0) {                                                   \
        ::memoffload::daemon::Log(level, "(%lu lines like the next were suppressed)", \
                                  mo_log_suppressed);                                 \
      }                                                                               \
      ::memoffload::daemon::Log(level, __VA_ARGS__);                                  \
    }                                                                                 \
  } while (0)
#define MO_LOG_WARN_LIMITED(...) \
  MO_LOG_LIMITED(::memoffload::daemon::LogLevel::kWarning, __VA_ARGS__)
#define MO_LOG_INFO_LIMITED(...) MO_LOG_LIMITED(::memoffload::daemon::LogLevel::kInfo, __VA_ARGS__)

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_LOG_H_
