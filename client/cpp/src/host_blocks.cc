#include "memoffload/client/host_blocks.h"

#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "memoffload/client/log.h"

namespace memoffload::client {

class HostBlocks::Book {
 public:
  struct Held {
    uint64_t size_bytes = 0;
    uint64_t held_bytes = 0;
    const uint8_t* address = nullptr;
  };
  absl::Mutex mu;
  uint64_t next_group ABSL_GUARDED_BY(mu) = 1;
  std::unordered_map<uint64_t, Held> held ABSL_GUARDED_BY(mu);        // by group id
  std::map<const uint8_t*, uint64_t> by_address ABSL_GUARDED_BY(mu);  // -> group id
  HostBlockStats stats ABSL_GUARDED_BY(mu);
};

HostBlocks::HostBlocks(std::shared_ptr<Client> client)
    : client_(std::move(client)), book_(std::make_unique<Book>()) {}

HostBlocks::~HostBlocks() {
  std::vector<uint64_t> groups;
  {
    absl::MutexLock lock(&book_->mu);
    for (const auto& [group, held] : book_->held) groups.push_back(group);
  }
  for (uint64_t group : groups) {
    if (Status st = Free(group); !st.ok()) {
      Log(LogLevel::kWarning, st.code(), "freeing a host block at exit: " + st.message());
    }
  }
}

Result<HostBlock> HostBlocks::Allocate(uint64_t size_bytes) {
  auto refused = [this](Status st) {
    absl::MutexLock lock(&book_->mu);
    ++book_->stats.refused;
    return st;
  };
  if (size_bytes == 0) return refused(InvalidArgument("a host block must have a positive size"));
  uint64_t group = 0;
  {
    absl::MutexLock lock(&book_->mu);
    group = book_->next_group++;
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
  absl::MutexLock lock(&book_->mu);
  book_->held[group] = Book::Held{size_bytes, block.held_bytes, block.address};
  book_->by_address[block.address] = group;
  ++book_->stats.blocks;
  book_->stats.size_bytes += size_bytes;
  book_->stats.held_bytes += block.held_bytes;
  return block;
}

Status HostBlocks::Free(uint64_t group_id) {
  {
    absl::MutexLock lock(&book_->mu);
    auto it = book_->held.find(group_id);
    if (it == book_->held.end()) {
      return NotFound("host block " + std::to_string(group_id) + " is not allocated");
    }
    --book_->stats.blocks;
    book_->stats.size_bytes -= it->second.size_bytes;
    book_->stats.held_bytes -= it->second.held_bytes;
    book_->by_address.erase(it->second.address);
    book_->held.erase(it);
  }
  return client_->Release(group_id);
}

bool HostBlocks::Holds(const void* address) const {
  const auto* p = static_cast<const uint8_t*>(address);
  absl::MutexLock lock(&book_->mu);
  auto it = book_->by_address.upper_bound(p);
  if (it == book_->by_address.begin()) return false;
  --it;
  return p < it->first + book_->held.at(it->second).size_bytes;
}

HostBlockStats HostBlocks::stats() const {
  absl::MutexLock lock(&book_->mu);
  return book_->stats;
}

}  // namespace memoffload::client
