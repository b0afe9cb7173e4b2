#include "base/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>

namespace memoffload::daemon {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
const char* kNames[] = {"DEBUG", "INFO", "WARN", "ERROR"};
}  // namespace

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

void Log(LogLevel level, const char* format, ...) {
  if (static_cast<int>(level) < g_level.load(std::memory_order_relaxed)) return;
  char line[2048];
  int n = std::snprintf(line, sizeof(line), "memoffloadd[%d] %s ", getpid(),
                        kNames[static_cast<int>(level)]);
  va_list args;
  va_start(args, format);
  int m = std::vsnprintf(line + n, sizeof(line) - n - 1, format, args);
  va_end(args);
  size_t len = static_cast<size_t>(n) + (m < 0 ? 0 : static_cast<size_t>(m));
  if (len > sizeof(line) - 2) len = sizeof(line) - 2;
  line[len++] = '\n';
  ssize_t ignored = write(STDERR_FILENO, line, len);
  (void)ignored;  // a log line that cannot be written has nowhere else to go
}

bool LogRateLimiter::Allow(unsigned long* suppressed) {
  const long long now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now().time_since_epoch())
                               .count();
  long long start = window_start_ms_.load(std::memory_order_relaxed);
  if (now_ms - start >= 1000 &&
      window_start_ms_.compare_exchange_strong(start, now_ms, std::memory_order_relaxed)) {
    in_window_.store(0, std::memory_order_relaxed);
  }
  if (in_window_.fetch_add(1, std::memory_order_relaxed) >= kBurst) {
    suppressed_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  *suppressed = suppressed_.exchange(0, std::memory_order_relaxed);
  return true;
}

}  // namespace memoffload::daemon
