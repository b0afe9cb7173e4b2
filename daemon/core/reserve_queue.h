// ReserveQueue: who among the waiting reserves is served next.
//
// The rules, and nothing else: no lock, no thread, no clock of its own (the
// caller passes `now`), so each rule is testable without threads and sleeps.
// SessionTable owns one (ABSL_GUARDED_BY its mutex).
//
// Rules:
// - FIFO within a tenant: a tenant's waiters are tried in arrival order, and
//   the first one that finds no room stops its tenant's line. A waiter held
//   back by its own session or job quota is skipped and blocks nobody.
// - Across tenants, round robin: each round offers every tenant's line one
//   placement, starting after the tenant served last. A tenant's waiter never
//   stops another tenant's line, and a request of another tenant that fits is
//   placed even while a waiter cannot fit.
// - Aging: a capacity waiter (one its quota allows) that has waited `aging`
//   is aged. The oldest aged waiter is tried first, and while it cannot fit,
//   every request of another tenant must leave its bytes free
//   (keep_free_bytes), so returned bytes accumulate for it and it is not
//   overtaken forever.
// - Bounds: at most max_waiters in all, and max_waiters_per_tenant per
//   tenant and per owner (the uid of the waiter: with tenant = job, the
//   tenants of one uid share one bound, so a uid gets no more of the queue
//   by naming more job ids); Add over a bound is RESOURCE_EXHAUSTED naming
//   it.
#ifndef MEMOFFLOAD_DAEMON_RESERVE_QUEUE_H_
#define MEMOFFLOAD_DAEMON_RESERVE_QUEUE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload::daemon {

class ReserveQueue {
 public:
  using Clock = std::chrono::steady_clock;

  struct Limits {
    size_t max_waiters = 1024;
    size_t max_waiters_per_tenant = 256;
    Clock::duration aging = std::chrono::seconds(2);
  };

  static constexpr uint64_t kNoOwner = UINT64_MAX;

  struct Waiter {
    uint64_t ticket = 0;
    std::string tenant;
    uint64_t owner = kNoOwner;
    uint64_t bytes = 0;
    Clock::time_point queued_at;
    Clock::time_point deadline;
  };

  // The outcome of one try to place a waiter.
  enum class Try {
    kPlaced,     // placed: it leaves the queue
    kNoRoom,     // no room now: it stays, and its tenant's line stops
    kQuotaHeld,  // its own quota holds it back: it stays, its line goes on
    kLeft,       // answered with an error (e.g. its session ended): it leaves
  };

  ReserveQueue() = default;
  explicit ReserveQueue(Limits limits);

  void SetLimits(const Limits& limits);
  const Limits& limits() const { return limits_; }

  // Queues a waiter at the back of its tenant's line; returns its ticket
  // (never 0). RESOURCE_EXHAUSTED naming the bound when the queue or the
  // tenant's line is full; nothing is queued then.
  Result<uint64_t> Add(const std::string& tenant, uint64_t bytes, Clock::time_point now,
                       Clock::time_point deadline, uint64_t owner = kNoOwner);
  // Removes a waiter; false if it is not queued.
  bool Remove(uint64_t ticket);
  // The queued waiter, or nullptr.
  const Waiter* Find(uint64_t ticket) const;
  size_t size() const { return tenant_of_.size(); }

  // What stands before a new request of `tenant` (one that would be placed
  // now, outside the queue): the same tenant's capacity waiters, and the
  // aged waiter of another tenant whose bytes it must leave free.
  struct Before {
    size_t same_tenant_count = 0;
    uint64_t same_tenant_bytes = 0;
    const Waiter* aged = nullptr;  // of another tenant; nullptr if none
    uint64_t keep_free_bytes = 0;  // aged->bytes, or 0
  };
  Before Ahead(const std::string& tenant, Clock::time_point now,
               const std::function<bool(const Waiter&)>& quota_held) const;

  // Offers room to the waiters by the rules above, until a full round places
  // nobody. `place` tries one waiter, leaving keep_free_bytes free for an
  // aged waiter of another tenant; it is called only for a waiter that
  // quota_held has just found not held, with nothing in between, so it need
  // not ask about quotas again. Placed and left waiters are removed;
  // returns their tickets in the order they were tried.
  std::vector<uint64_t> Dispatch(
      Clock::time_point now, const std::function<bool(const Waiter&)>& quota_held,
      const std::function<Try(const Waiter&, uint64_t keep_free_bytes)>& place);

  // Removes and returns the waiters whose deadline is at or before `now`.
  std::vector<Waiter> TakeExpired(Clock::time_point now);
  // Removes and returns every waiter.
  std::vector<Waiter> TakeAll();
  // The earliest deadline of a queued waiter.
  std::optional<Clock::time_point> NextDeadline() const;

 private:
  // The oldest capacity waiter that has waited at least limits_.aging.
  const Waiter* Aged(Clock::time_point now,
                     const std::function<bool(const Waiter&)>& quota_held) const;
  void EraseTenantIfEmpty(const std::string& tenant);

  Limits limits_;
  uint64_t next_ticket_ = 1;
  std::map<std::string, std::deque<Waiter>> lines_;  // per tenant, arrival order
  std::string last_served_;  // a round starts at the tenant after it (name order)
  std::unordered_map<uint64_t, std::string> tenant_of_;  // ticket -> tenant
  std::unordered_map<uint64_t, size_t> owner_waiters_;   // owner -> waiters; no 0 entry
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_RESERVE_QUEUE_H_
