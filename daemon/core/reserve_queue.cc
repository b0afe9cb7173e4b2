#include "core/reserve_queue.h"

#include <algorithm>

namespace memoffload::daemon {

ReserveQueue::ReserveQueue(Limits limits) : limits_(limits) {}

void ReserveQueue::SetLimits(const Limits& limits) { limits_ = limits; }

Result<uint64_t> ReserveQueue::Add(const std::string& tenant, uint64_t bytes, Clock::time_point now,
                                   Clock::time_point deadline, uint64_t owner) {
  if (tenant_of_.size() >= limits_.max_waiters) {
    return ResourceExhausted("too many waiting reserves: " + std::to_string(tenant_of_.size()) +
                             " wait already, the limit quotas.max_waiting_reserves is " +
                             std::to_string(limits_.max_waiters));
  }
  auto line = lines_.find(tenant);
  if (line != lines_.end() && line->second.size() >= limits_.max_waiters_per_tenant) {
    return ResourceExhausted("too many waiting reserves of tenant " + tenant + ": " +
                             std::to_string(line->second.size()) +
                             " wait already, the limit quotas.max_waiting_reserves_per_tenant is " +
                             std::to_string(limits_.max_waiters_per_tenant));
  }
  if (owner != kNoOwner) {
    auto count = owner_waiters_.find(owner);
    if (count != owner_waiters_.end() && count->second >= limits_.max_waiters_per_tenant) {
      return ResourceExhausted(
          "too many waiting reserves of uid " + std::to_string(owner) + ": " +
          std::to_string(count->second) +
          " wait already over its job ids, the limit quotas.max_waiting_reserves_per_tenant is " +
          std::to_string(limits_.max_waiters_per_tenant) + " for all tenants of a uid together");
    }
    ++owner_waiters_[owner];
  }
  const uint64_t ticket = next_ticket_++;
  lines_[tenant].push_back(Waiter{ticket, tenant, owner, bytes, now, deadline});
  tenant_of_.emplace(ticket, tenant);
  return ticket;
}

bool ReserveQueue::Remove(uint64_t ticket) {
  auto it = tenant_of_.find(ticket);
  if (it == tenant_of_.end()) return false;
  const std::string tenant = it->second;
  tenant_of_.erase(it);
  std::deque<Waiter>& line = lines_[tenant];
  auto waiter = std::find_if(line.begin(), line.end(),
                             [ticket](const Waiter& w) { return w.ticket == ticket; });
  if (waiter->owner != kNoOwner) {
    auto count = owner_waiters_.find(waiter->owner);
    if (--count->second == 0) owner_waiters_.erase(count);
  }
  line.erase(waiter);
  EraseTenantIfEmpty(tenant);
  return true;
}

const ReserveQueue::Waiter* ReserveQueue::Find(uint64_t ticket) const {
  auto it = tenant_of_.find(ticket);
  if (it == tenant_of_.end()) return nullptr;
  for (const Waiter& w : lines_.at(it->second)) {
    if (w.ticket == ticket) return &w;
  }
  return nullptr;
}

void ReserveQueue::EraseTenantIfEmpty(const std::string& tenant) {
  auto it = lines_.find(tenant);
  if (it != lines_.end() && it->second.empty()) lines_.erase(it);
}

const ReserveQueue::Waiter* ReserveQueue::Aged(
    Clock::time_point now, const std::function<bool(const Waiter&)>& quota_held) const {
  const Waiter* oldest = nullptr;
  for (const auto& [tenant, line] : lines_) {
    for (const Waiter& w : line) {
      if (quota_held(w)) continue;
      // The first capacity waiter of a line is its oldest.
      if (now - w.queued_at >= limits_.aging &&
          (oldest == nullptr || w.queued_at < oldest->queued_at ||
           (w.queued_at == oldest->queued_at && w.ticket < oldest->ticket))) {
        oldest = &w;
      }
      break;
    }
  }
  return oldest;
}

ReserveQueue::Before ReserveQueue::Ahead(
    const std::string& tenant, Clock::time_point now,
    const std::function<bool(const Waiter&)>& quota_held) const {
  Before before;
  if (auto line = lines_.find(tenant); line != lines_.end()) {
    for (const Waiter& w : line->second) {
      if (quota_held(w)) continue;
      ++before.same_tenant_count;
      before.same_tenant_bytes += w.bytes;
    }
  }
  const Waiter* aged = Aged(now, quota_held);
  if (aged != nullptr && aged->tenant != tenant) {
    before.aged = aged;
    before.keep_free_bytes = aged->bytes;
  }
  return before;
}

std::vector<uint64_t> ReserveQueue::Dispatch(
    Clock::time_point now, const std::function<bool(const Waiter&)>& quota_held,
    const std::function<Try(const Waiter&, uint64_t keep_free_bytes)>& place) {
  std::vector<uint64_t> answered;
  while (!lines_.empty()) {
    // The aged waiter first; while it cannot fit, others leave its bytes free.
    uint64_t aged_ticket = 0;
    uint64_t keep_free = 0;
    std::string aged_tenant;
    if (const Waiter* aged = Aged(now, quota_held); aged != nullptr) {
      const Waiter w = *aged;
      const Try t = place(w, 0);
      if (t == Try::kPlaced || t == Try::kLeft) {
        Remove(w.ticket);
        answered.push_back(w.ticket);
        if (t == Try::kPlaced) last_served_ = w.tenant;
        continue;
      }
      if (t == Try::kNoRoom) {
        aged_ticket = w.ticket;
        aged_tenant = w.tenant;
        keep_free = w.bytes;
      }
    }
    // One round: each tenant's line gets one placement, starting after the
    // tenant served last.
    std::vector<std::string> round;
    for (auto it = lines_.upper_bound(last_served_); it != lines_.end(); ++it) {
      round.push_back(it->first);
    }
    for (auto it = lines_.begin(); it != lines_.end() && it->first <= last_served_; ++it) {
      round.push_back(it->first);
    }
    bool placed_any = false;
    for (const std::string& tenant : round) {
      auto line = lines_.find(tenant);
      if (line == lines_.end()) continue;
      const std::vector<Waiter> waiters(line->second.begin(), line->second.end());
      for (const Waiter& w : waiters) {
        if (w.ticket == aged_ticket) break;  // just found no room; its line waits
        if (quota_held(w)) continue;
        const Try t = place(w, tenant == aged_tenant ? 0 : keep_free);
        if (t == Try::kQuotaHeld) continue;
        if (t == Try::kNoRoom) break;
        Remove(w.ticket);
        answered.push_back(w.ticket);
        if (t == Try::kPlaced) {
          placed_any = true;
          last_served_ = tenant;
          break;
        }
      }
    }
    if (!placed_any) break;
  }
  return answered;
}

std::vector<ReserveQueue::Waiter> ReserveQueue::TakeExpired(Clock::time_point now) {
  std::vector<Waiter> expired;
  for (const auto& [tenant, line] : lines_) {
    for (const Waiter& w : line) {
      if (w.deadline <= now) expired.push_back(w);
    }
  }
  for (const Waiter& w : expired) Remove(w.ticket);
  return expired;
}

std::vector<ReserveQueue::Waiter> ReserveQueue::TakeAll() {
  std::vector<Waiter> all;
  for (const auto& [tenant, line] : lines_) all.insert(all.end(), line.begin(), line.end());
  lines_.clear();
  tenant_of_.clear();
  owner_waiters_.clear();
  return all;
}

std::optional<ReserveQueue::Clock::time_point> ReserveQueue::NextDeadline() const {
  std::optional<Clock::time_point> next;
  for (const auto& [tenant, line] : lines_) {
    for (const Waiter& w : line) {
      if (!next.has_value() || w.deadline < *next) next = w.deadline;
    }
  }
  return next;
}

}  // namespace memoffload::daemon
