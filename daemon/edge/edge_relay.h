// EdgeRelay: stands between each admitted gRPC connection and gRPC itself,
// so that the daemon, not gRPC 1.51, decides what a peer may send.
//
// For every connection the listener admits, the relay makes a socket pair,
// gives one end to gRPC and keeps the other with the client's socket. On one
// thread of its own it moves bytes both ways: what the client sends passes
// through an H2Guard (h2_guard.h) and only whole frames that keep its rules
// reach gRPC; what gRPC sends goes back unchanged. A connection that breaks a
// rule is closed at once (gRPC then ends its calls) and reported through
// `closed` (the daemon counts it by reason);
// the heap gRPC built for it is handed back to the system soon after
// (malloc_trim, at most once a second).
//
// Each direction holds at most one frame plus one read of bytes: a peer that
// never reads its replies stops gRPC's writes on that connection alone,
// as before. Thread-safe: Relay and Stop may be called from any thread;
// `closed` callbacks run on the relay's thread.
#ifndef MEMOFFLOAD_DAEMON_EDGE_RELAY_H_
#define MEMOFFLOAD_DAEMON_EDGE_RELAY_H_

#include <sys/types.h>

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "edge/h2_guard.h"
#include "memoffload/common/status.h"

namespace memoffload::daemon {

class EdgeRelay {
 public:
  explicit EdgeRelay(const H2Limits& limits);
  ~EdgeRelay();
  EdgeRelay(const EdgeRelay&) = delete;
  EdgeRelay& operator=(const EdgeRelay&) = delete;

  // Takes ownership of `client_fd` (a connected Unix stream socket) and
  // returns the end gRPC should serve (ownership to the caller, who hands it
  // to gRPC). `closed` runs once, on the relay's thread, when the connection
  // is gone: with kNone when either side closed it, else with the rule the
  // peer broke.
  Result<int> Relay(int client_fd, pid_t pid, uid_t uid, std::function<void(H2Violation)> closed);
  // Closes every connection and stops the thread (idempotent).
  void Stop();

 private:
  class Connection;
  friend class Connection;
  void OnViolation(const Connection& c);
  void Tick();
  void TrimSoon();
  void OnTrimTimer(boost::system::error_code ec);

  const H2Limits limits_;
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  boost::asio::steady_timer tick_;
  boost::asio::steady_timer trim_;
  bool trim_pending_ = false;  // relay thread only
  int trims_wanted_ = 0;       // relay thread only
  bool stopping_ = false;      // relay thread only: Stop's work has begun
  std::unordered_set<std::shared_ptr<Connection>> connections_;  // relay thread only
  // Per uid, kept a minute past its last connection (relay thread only).
  std::unordered_map<uid_t, std::shared_ptr<H2Budget>> budgets_;
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_EDGE_RELAY_H_
