#include "app/notifier.h"

#include <systemd/sd-daemon.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "base/log.h"

namespace memoffload::daemon {

Notifier::Notifier() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  enabled_ = socket != nullptr && socket[0] != '\0';
  if (!enabled_) return;
  uint64_t timeout_usec = 0;
  // Keeps the environment (unset_environment = 0); returns > 0 only when
  // WATCHDOG_USEC is set and WATCHDOG_PID, if set, names this process.
  const int r = sd_watchdog_enabled(0, &timeout_usec);
  if (r < 0) {
    MO_LOG_WARN("systemd watchdog: bad WATCHDOG_USEC/WATCHDOG_PID (%s); not pinging",
                std::strerror(-r));
  } else if (r > 0 && timeout_usec > 0) {
    watchdog_interval_ = std::chrono::microseconds(std::max<uint64_t>(1, timeout_usec / 2));
  }
}

void Notifier::Ready(const std::string& status_text) const {
  if (!enabled_) return;
  std::string status = status_text;
  std::replace(status.begin(), status.end(), '\n', ' ');
  Send("READY=1\nSTATUS=" + status);
}

void Notifier::Stopping() const {
  if (!enabled_) return;
  Send("STOPPING=1");
}

void Notifier::Status(const std::string& text) const {
  if (!enabled_) return;
  std::string status = text;
  std::replace(status.begin(), status.end(), '\n', ' ');
  Send("STATUS=" + status);
}

void Notifier::WatchdogPing() const {
  if (!WatchdogEnabled()) return;
  Send("WATCHDOG=1");
}

void Notifier::Send(const std::string& state) const {
  const int r = sd_notify(0, state.c_str());
  if (r > 0) return;
  if (!warned_.exchange(true)) {
    MO_LOG_WARN("sd_notify(%s) failed: %s; later failures are not logged",
                state.substr(0, state.find('\n')).c_str(),
                r < 0 ? std::strerror(-r) : "NOTIFY_SOCKET unset");
  }
}

}  // namespace memoffload::daemon
