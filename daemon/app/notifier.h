// Notifier: tells the service manager (systemd, Type=notify) what the daemon
// is doing, through libsystemd's sd_notify protocol.
//
// Promises:
// - When NOTIFY_SOCKET is unset (not started by systemd, tests, containers),
//   every method is a no-op that costs one branch.
// - Ready() is called once, after the arena is built and the broker, gRPC and
//   metrics listeners accept connections; Stopping() once, when shutdown
//   begins. Status() may be called any number of times.
// - WatchdogEnabled() is true only when systemd asked this very process for
//   keep-alive pings (WATCHDOG_USEC set and, if WATCHDOG_PID is set, equal to
//   getpid()). The caller then calls WatchdogPing() every WatchdogInterval()
//   from its event loop, so that a wedged loop stops the pings and systemd
//   restarts the daemon.
// - Failures to notify are never fatal: the first one is logged as a warning,
//   later ones are ignored.
//
// Thread safety: the environment is read once in the constructor and never
// changed; all methods are const after that and may be called from any
// thread (sd_notify opens its own socket per call).
#ifndef MEMOFFLOAD_DAEMON_NOTIFIER_H_
#define MEMOFFLOAD_DAEMON_NOTIFIER_H_

#include <atomic>
#include <chrono>
#include <string>

namespace memoffload::daemon {

class Notifier {
 public:
  // Reads NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID from the environment.
  Notifier();

  Notifier(const Notifier&) = delete;
  Notifier& operator=(const Notifier&) = delete;

  // True when NOTIFY_SOCKET is set, i.e. notifications go somewhere.
  bool Enabled() const { return enabled_; }

  // READY=1 together with STATUS=<status_text>.
  void Ready(const std::string& status_text) const;
  // STOPPING=1: shutdown (drain) has begun.
  void Stopping() const;
  // STATUS=<text>: one human-readable line shown by `systemctl status`.
  // Newlines in `text` are replaced by spaces.
  void Status(const std::string& text) const;

  // True when the service manager expects WatchdogPing() calls.
  bool WatchdogEnabled() const { return watchdog_interval_.count() > 0; }
  // How often to call WatchdogPing(): half of the WATCHDOG_USEC timeout.
  // Zero when the watchdog is disabled.
  std::chrono::microseconds WatchdogInterval() const { return watchdog_interval_; }
  // WATCHDOG=1. A no-op when the watchdog is disabled.
  void WatchdogPing() const;

 private:
  void Send(const std::string& state) const;

  bool enabled_ = false;
  std::chrono::microseconds watchdog_interval_{0};
  mutable std::atomic<bool> warned_{false};  // first failure logged
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_NOTIFIER_H_
