// Minimal leveled logging to stderr: "memoffloadd[pid] LEVEL message".
// Thread-safe (one write(2) per line). Journald and kubectl logs add their
// own timestamps, so none is printed.
#ifndef MEMOFFLOAD_DAEMON_LOG_H_
#define MEMOFFLOAD_DAEMON_LOG_H_

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

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_LOG_H_
