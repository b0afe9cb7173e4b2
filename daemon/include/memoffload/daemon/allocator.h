// ExtentAllocator: packs byte ranges into the arena's chunks.
//
// The arena is a list of chunks (sizes fixed at construction). The allocator
// hands out extents (chunk, offset, length) at page granularity; an extent
// never crosses a chunk boundary. It is a segregated-fit allocator of the TLSF
// class: Allocate and Free are O(1) in the number of free extents, and a freed
// extent is coalesced with its free neighbours immediately.
//
// A request larger than the largest free extent is served as several extents
// unless the caller asks for a single extent; it fails only when the total
// free bytes (in chunks the caller may use) are not enough. Searches
// restricted to some chunks look at each allowed chunk's own size-class
// lists: O(allowed chunks), not O(free extents).
//
// Not thread-safe: the owner (Arena) serialises calls.
#ifndef MEMOFFLOAD_DAEMON_ALLOCATOR_H_
#define MEMOFFLOAD_DAEMON_ALLOCATOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "memoffload/shared_mem/extent.h"
#include "memoffload/shared_mem/status.h"

namespace memoffload::daemon {

// (chunk, offset, length); shared with the client.
using Extent = ::memoffload::Extent;

class ExtentAllocator {
 public:
  // chunk_sizes[i] is the usable size of chunk i; each must be a non-zero
  // multiple of page_bytes, which must be a power of two.
  ExtentAllocator(const std::vector<uint64_t>& chunk_sizes, uint64_t page_bytes);
  ~ExtentAllocator();
  ExtentAllocator(const ExtentAllocator&) = delete;
  ExtentAllocator& operator=(const ExtentAllocator&) = delete;

  // Allocates `bytes` (> 0) rounded up to page_bytes. With single_extent the
  // result is exactly one extent or RESOURCE_EXHAUSTED. Otherwise the result
  // may be several extents whose lengths sum to the rounded size; it uses
  // as few extents as it cheaply can. Fails with RESOURCE_EXHAUSTED (message
  // names requested, free and largest-free bytes) and changes nothing.
  // `allowed_chunks`, when non-null, restricts placement to chunks whose
  // entry is true (size must equal chunk_count()).
  // A restricted search costs O(allowed chunks), whatever the number of
  // free extents (each chunk keeps its own size-class lists).
  Result<std::vector<Extent>> Allocate(uint64_t bytes, bool single_extent = false,
                                       const std::vector<bool>* allowed_chunks = nullptr);
  // As Allocate restricted to the chunks listed in `allowed_chunks` (distinct
  // indices < chunk_count(), else INVALID_ARGUMENT; empty allows none). Saves
  // the O(chunk_count()) pass over a vector<bool> for callers that keep a
  // list, e.g. the chunks a tenant owns.
  Result<std::vector<Extent>> AllocateIn(uint64_t bytes, bool single_extent,
                                         const std::vector<uint32_t>& allowed_chunks);

  // Returns an extent obtained from Allocate (or a page-aligned sub-range of
  // one, as produced by Trim). Freeing anything else is a bug; it is detected
  // and reported as FAILED_PRECONDITION without corrupting state.
  Status Free(const Extent& extent);

  // Keeps the first `keep_bytes` (rounded up to a page) of an allocation
  // given as `extents` and frees the rest; returns the kept extents.
  Result<std::vector<Extent>> Trim(const std::vector<Extent>& extents, uint64_t keep_bytes);

  uint64_t capacity_bytes() const;
  uint64_t free_bytes() const;
  uint64_t used_bytes() const { return capacity_bytes() - free_bytes(); }
  uint64_t largest_free_extent_bytes() const;
  uint64_t page_bytes() const;
  uint32_t chunk_count() const;
  // Free bytes inside chunk `chunk`.
  uint64_t chunk_free_bytes(uint32_t chunk) const;

  // Verifies: free + used == capacity, free extents do not overlap and lie in
  // their chunk, no two adjacent free extents are left uncoalesced, every free
  // extent is in the right size class. OK or INTERNAL naming the violation.
  // O(number of extents); for tests and debug builds.
  Status CheckInvariants() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_ALLOCATOR_H_
