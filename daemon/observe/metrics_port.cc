#include "observe/metrics_port.h"

#include <prometheus/exposer.h>

#include <chrono>
#include <utility>

#include "base/log.h"
#include "observe/metrics.h"

namespace memoffload::daemon {

MetricsPort::MetricsPort(boost::asio::io_context& io, std::string address, int retry_ms)
    : address_(std::move(address)), retry_ms_(retry_ms), timer_(io) {}

bool MetricsPort::TryBind() {
  std::string bound;
  Result<std::unique_ptr<prometheus::Exposer>> listening = Metrics::Listen(address_, &bound);
  if (!listening.ok()) {
    ++failures_;
    if (problem_.empty()) {
      MO_LOG_ERROR(
          "metrics: %s; serving without metrics and trying again every %d s (readyz says "
          "degraded until then; whoever holds the port answers scrapes of it)",
          listening.status().message().c_str(), retry_ms_ / 1000);
    }
    problem_ = "metrics port " + address_ + " is taken; retrying every " +
               std::to_string(retry_ms_ / 1000) + " s";
    return false;
  }
  if (!problem_.empty()) {
    MO_LOG_INFO("metrics: bound %s after %llu failed tries; serving metrics now", bound.c_str(),
                static_cast<unsigned long long>(failures_));
  }
  problem_.clear();
  bound_ = std::move(bound);
  exposer_ = std::move(listening).value();
  return true;
}

void MetricsPort::RetryUntilBound(Bound bound) {
  if (!bound_.empty()) return;
  on_bound_ = std::move(bound);
  Arm();
}

void MetricsPort::Arm() {
  timer_.expires_after(std::chrono::milliseconds(retry_ms_));
  timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;  // stopped
    if (!TryBind()) {
      Arm();
      return;
    }
    if (on_bound_) on_bound_(take(), bound_);
  });
}

void MetricsPort::Stop() { timer_.cancel(); }

}  // namespace memoffload::daemon
