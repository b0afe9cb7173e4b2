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
// free bytes (in chunks the caller may use) are not enough.
//
// Each chunk belongs to one pool (pool 0 at first). A free extent is listed
// in its pool's size-class lists, so a search in one pool (a tenant's
// chunks: SetChunkPool, AllocateInPool) is O(1) like the unrestricted one.
// A search restricted to a list of chunks (Allocate with allowed_chunks,
// AllocateIn) asks each listed chunk's own lists: O(allowed chunks), not
// O(free extents). Those per-chunk lists are built on the first such call
// (O(extents)) and kept from then on; an allocator that only ever searches
// pools (the daemon's) lists each free extent once.
//
// Not thread-safe: the owner (Arena) serialises calls.
#ifndef MEMOFFLOAD_DAEMON_ALLOCATOR_H_
#define MEMOFFLOAD_DAEMON_ALLOCATOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/common/status.h"
#include "memoffload/shared_mem/extent.h"
#include "memory/size_class_lists.h"
#include "memory/start_index.h"

namespace memoffload::daemon {

// (chunk, offset, length); shared with the client.
using Extent = ::memoffload::Extent;

class ExtentAllocator {
 public:
  // chunk_sizes[i] is the usable size of chunk i; each must be a non-zero
  // multiple of page_bytes, which must be a power of two.
  ExtentAllocator(const std::vector<uint64_t>& chunk_sizes, uint64_t page_bytes);
  ~ExtentAllocator() = default;
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
  // As AllocateIn (every chunk when `allowed_chunks` is null), appending the
  // extents to *out, which is left as it was on failure. For callers that
  // keep a vector to reuse (the session table's groups): no allocation of
  // its own on the way.
  Status AllocateInto(uint64_t bytes, bool single_extent,
                      const std::vector<uint32_t>* allowed_chunks, std::vector<Extent>* out);

  // Pools. Moves the chunk, with its free extents, to `pool` (< kMaxPools);
  // O(extents in the chunk). INVALID_ARGUMENT for a chunk or pool out of
  // range, changing nothing.
  static constexpr uint32_t kMaxPools = 1u << 20;
  Status SetChunkPool(uint32_t chunk, uint32_t pool);
  uint32_t chunk_pool(uint32_t chunk) const { return chunk_pool_[chunk]; }
  // Pools with lists: the highest pool number used, plus one (they are not
  // given back; SessionTable reuses the numbers of tenants that went).
  uint32_t pool_count() const { return static_cast<uint32_t>(pool_lists_.size()); }
  // As AllocateInto, in the chunks of `pool` only: O(1) whatever the number
  // of chunks or free extents. A pool without chunks has no room.
  Status AllocateInPool(uint64_t bytes, bool single_extent, uint32_t pool,
                        std::vector<Extent>* out);

  // Returns an extent obtained from Allocate (or a page-aligned sub-range of
  // one, as produced by Trim). Freeing anything else is a bug; it is detected
  // and reported as FAILED_PRECONDITION without corrupting state.
  // Whether `bytes` fit in the pool's free space now: in one free extent
  // with single_extent, else in its free pages (the extent limit aside).
  bool FitsInPool(uint64_t bytes, bool single_extent, uint32_t pool);

  Status Free(const Extent& extent);
  // Allocates exactly `extent` (page-aligned, inside its chunk), which must
  // be free: a restart placing what its predecessor had allocated (the
  // state store). FAILED_PRECONDITION, changing nothing, otherwise.
  Status TakeExact(const Extent& extent);

  // Keeps the first `keep_bytes` (rounded up to a page) of an allocation
  // given as `extents` and frees the rest; returns the kept extents.
  Result<std::vector<Extent>> Trim(const std::vector<Extent>& extents, uint64_t keep_bytes);

  uint64_t capacity_bytes() const { return ToBytes(capacity_pages_); }
  uint64_t free_bytes() const { return ToBytes(free_pages_); }
  uint64_t used_bytes() const { return capacity_bytes() - free_bytes(); }
  uint64_t largest_free_extent_bytes() const { return ToBytes(LongestFreePages(Scope{})); }
  uint64_t page_bytes() const { return page_bytes_; }
  uint32_t chunk_count() const { return static_cast<uint32_t>(chunk_pages_.size()); }
  // Free bytes inside chunk `chunk`.
  uint64_t chunk_free_bytes(uint32_t chunk) const;
  // Free bytes in the pool's chunks (0 for a pool without lists).
  uint64_t pool_free_bytes(uint32_t pool) const {
    return pool < pool_free_pages_.size() ? ToBytes(pool_free_pages_[pool]) : 0;
  }

  // Verifies: free + used == capacity, free extents do not overlap and lie in
  // their chunk, no two adjacent free extents are left uncoalesced, every free
  // extent is in the right size class. OK or INTERNAL naming the violation.
  // O(number of extents); for tests and debug builds.
  Status CheckInvariants() const;

 private:
  // Where a search looks: the listed chunks (distinct indices), one pool, or
  // (neither) every chunk.
  static constexpr uint32_t kEveryPool = UINT32_MAX;
  struct Scope {
    const std::vector<uint32_t>* chunks = nullptr;
    uint32_t pool = kEveryPool;
  };
  // The search and the node bookkeeping (allocator.cc; the searches in
  // allocator_search.cc). Sizes and offsets are in pages.
  Status AllocateFrom(uint64_t bytes, bool single_extent, Scope scope, std::vector<Extent>* out);
  // Checks `allowed` (size, or range and duplicates) and turns it into a
  // chunk list (in allowed_list_ for a vector<bool>); nullptr when it allows
  // every chunk.
  Result<const std::vector<uint32_t>*> ToList(const std::vector<bool>* allowed);
  Result<const std::vector<uint32_t>*> ToList(const std::vector<uint32_t>& allowed);
  // Pages of the longest free extent in the scope, and its free pages.
  uint64_t LongestFreePages(Scope scope) const;
  uint64_t FreePages(Scope scope) const;
  uint64_t ToBytes(uint64_t pages) const { return pages << page_shift_; }
  std::string Bytes(uint64_t pages) const;
  std::string Describe(uint32_t chunk, uint64_t offset, uint64_t len) const;
  // Makes the per-chunk lists, if not yet there, from the free nodes.
  void BuildChunkLists();
  uint32_t NewNode();
  void InsertFree(uint32_t i);
  void RemoveFree(uint32_t i);
  uint32_t SplitAt(uint32_t i, uint64_t pages);
  uint32_t FindFit(uint64_t pages, bool exact, Scope scope);
  // The best fit over several lists (`which` of them, or all): each chunk's,
  // or each pool's, whose free pages are `free_pages`.
  uint32_t BestFitAmong(std::vector<SizeClassLists>& lists, const std::vector<uint64_t>& free_pages,
                        const std::vector<uint32_t>* which, uint64_t pages, bool exact);
  uint32_t Largest(Scope scope, bool longest) const;
  uint32_t LargestAmong(const std::vector<SizeClassLists>& lists,
                        const std::vector<uint32_t>* which, bool longest) const;
  Extent Carve(uint32_t i, uint64_t pages);
  void FreeNode(uint32_t i);
  void Absorb(uint32_t left, uint32_t right);
  void FreeRange(uint32_t i, uint64_t offset, uint64_t pages);
  Status Locate(const Extent& extent, uint32_t* node) const;

  uint64_t page_bytes_;
  int page_shift_ = 0;
  uint64_t capacity_pages_ = 0;
  uint64_t free_pages_ = 0;
  std::vector<uint64_t> chunk_pages_;
  std::vector<uint64_t> chunk_free_pages_;
  std::vector<ExtentNode> nodes_;
  std::vector<uint32_t> spare_nodes_;
  uint64_t max_chunk_pages_ = 0;
  std::vector<SizeClassLists> pool_lists_;   // by pool: the free nodes of its chunks
  std::vector<uint64_t> pool_free_pages_;    // by pool
  std::vector<uint32_t> chunk_pool_;         // by chunk
  std::vector<SizeClassLists> chunk_lists_;  // by chunk, once built: its free nodes
  std::vector<uint32_t> allowed_list_;       // scratch for ToList
  std::vector<uint8_t> allowed_mark_;        // scratch for ToList: 1 = listed
  StartIndex index_;                         // start key -> allocated node
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_ALLOCATOR_H_
