// MetricsPort: the metrics HTTP listener's address, bound at start and, when
// another process holds the port, bound later. A port that is taken does not
// stop the daemon (any local user could otherwise keep it from starting by
// binding the port first): the daemon serves without metrics, says so in an
// ERROR line and on /readyz ("degraded: ..."), and tries again every
// retry_ms until it gets the port.
//
// Not thread-safe: call every method from the io_context's thread (or before
// it runs). The callback runs there too.
#ifndef MEMOFFLOAD_DAEMON_METRICS_PORT_H_
#define MEMOFFLOAD_DAEMON_METRICS_PORT_H_

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace prometheus {
class Exposer;
}

namespace memoffload::daemon {

class MetricsPort {
 public:
  using Bound = std::function<void(std::unique_ptr<prometheus::Exposer>, const std::string&)>;

  MetricsPort(boost::asio::io_context& io, std::string address, int retry_ms);
  MetricsPort(const MetricsPort&) = delete;
  MetricsPort& operator=(const MetricsPort&) = delete;

  // Tries to bind once now. True when bound: take() hands the listener over.
  bool TryBind();
  std::unique_ptr<prometheus::Exposer> take() { return std::move(exposer_); }
  // "host:port" once bound, "" before.
  const std::string& bound() const { return bound_; }
  // Why the port is not served ("" once bound or when never tried).
  const std::string& problem() const { return problem_; }

  // Retries every retry_ms until bound, then calls `bound` with the listener
  // and its address. Nothing to do when bound already.
  void RetryUntilBound(Bound bound);
  void Stop();

 private:
  void Arm();

  const std::string address_;
  const int retry_ms_;
  boost::asio::steady_timer timer_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string bound_;
  std::string problem_;
  uint64_t failures_ = 0;
  Bound on_bound_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_METRICS_PORT_H_
