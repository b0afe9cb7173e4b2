#include "memoffload/client/host_blocks.h"

#include <string>
#include <utility>
#include <vector>

#include "memoffload/client/log.h"

namespace memoffload::client {

HostBlocks::HostBlocks(std::shared_ptr<Client> client) : client_(std::move(client)) {}

HostBlocks::~HostBlocks() {
  std::vector<uint64_t> groups;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [group, held] : held_) groups.push_back(group);
  }
  for (uint64_t group : groups) {
    if (Status st = Free(group); !st.ok()) {
      Log(LogLevel::kWarning, st.code(), "freeing a host block at exit: " + st.message());
    }
  }
}

Result<HostBlock> HostBlocks::Allocate(uint64_t size_bytes) {
  auto refused = [this](Status st) {
    absl::MutexLock lock(&mu_);
    ++stats_.refused;
    return st;
  };
  if (size_bytes == 0) return refused(InvalidArgument("a host block must have a positive size"));
  uint64_t group = 0;
  {
    absl::MutexLock lock(&mu_);
    group = next_group_++;
  }
  ReserveOptions options;
  options.single_extent = true;
  Result<Reservation> r = client_->Reserve(group, size_bytes, options);
  if (!r.ok()) return refused(r.status());
  if (r->extents.size() != 1) {
    (void)client_->Release(group);  // the INTERNAL below is what matters
    return refused(Internal("the daemon placed a single-extent group in " +
                            std::to_string(r->extents.size()) + " extents"));
  }
  // Committed at once: the block is the process's to use from now on, and
  // the daemon shows it as held, not as a reservation in flight.
  if (Result<CommitInfo> c = client_->Commit(group, r->reserved_bytes); !c.ok()) {
    if (Status st = client_->Release(group); !st.ok()) {
      Log(LogLevel::kWarning, st.code(), "releasing an uncommitted host block: " + st.message());
    }
    return refused(c.status());
  }
  HostBlock block;
  block.group_id = group;
  block.chunk = r->extents[0].chunk;
  block.address = client_->Address(r->extents[0]);
  block.size_bytes = size_bytes;
  block.held_bytes = r->reserved_bytes;
  if (block.address == nullptr) {
    (void)client_->Release(group);  // the INTERNAL below is what matters
    return refused(Internal("a reserved extent is not mapped in this process"));
  }
  absl::MutexLock lock(&mu_);
  held_[group] = Held{size_bytes, block.held_bytes, block.address};
  by_address_[block.address] = size_bytes;
  ++stats_.blocks;
  stats_.size_bytes += size_bytes;
  stats_.held_bytes += block.held_bytes;
  return block;
}

Status HostBlocks::Free(uint64_t group_id) {
  {
    absl::MutexLock lock(&mu_);
    auto it = held_.find(group_id);
    if (it == held_.end()) {
      return NotFound("host block " + std::to_string(group_id) + " is not allocated");
    }
    --stats_.blocks;
    stats_.size_bytes -= it->second.size_bytes;
    stats_.held_bytes -= it->second.held_bytes;
    by_address_.erase(it->second.address);
    held_.erase(it);
  }
  return client_->Release(group_id);
}

bool HostBlocks::Holds(const void* address) const {
  const auto* p = static_cast<const uint8_t*>(address);
  absl::MutexLock lock(&mu_);
  auto it = by_address_.upper_bound(p);
  if (it == by_address_.begin()) return false;
  --it;
  return p < it->first + it->second;
}

HostBlockStats HostBlocks::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace memoffload::client
