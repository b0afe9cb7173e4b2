// A stand-in for torch's CUDA caching allocator over the simulated driver
// (tests/cuda_sim), for the CUDA engine's tests: what the engine's restored
// storages get from torch in a trainer, with the properties the engine
// relies on. Blocks come from cuMemAlloc (so a graph capture sees the call)
// and are cached per (device, stream, size): a freed block serves the next
// allocation for the stream it was allocated for at once, never another
// stream's; a block whose use on other streams was recorded (RecordStream)
// goes back to its pool only once that work, as of the free, is done.
#ifndef MEMOFFLOAD_TESTS_TORCH_SIM_CACHING_ALLOCATOR_H_
#define MEMOFFLOAD_TESTS_TORCH_SIM_CACHING_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include "memoffload/torch/copy_engine.h"

namespace memoffload::torch {

class SimCachingAllocator final : public DeviceAllocator {
 public:
  // The calling thread's current stream (torch.cuda.set_stream; 0, the
  // legacy stream, until set): where at::empty would allocate.
  static void SetCurrentStream(uintptr_t stream);
  static uintptr_t CurrentStream();

  Result<c10::DataPtr> Allocate(c10::Device device, size_t n, uintptr_t stream) override;
  Status RecordStream(const c10::DataPtr& data, uintptr_t stream) override;

  // Returns to their pools the freed blocks whose recorded uses are done
  // (and destroys the events that tracked them): after sim_synchronize_all,
  // every one.
  void ReclaimFinished();

 private:
  struct Block {
    SimCachingAllocator* owner = nullptr;
    int device = 0;
    uint8_t* data = nullptr;
    size_t bytes = 0;
    uintptr_t stream = 0;        // allocated for
    std::set<uintptr_t> uses;    // other streams, recorded
    std::vector<void*> pending;  // events recorded on `uses` at the free
  };
  using PoolKey = std::tuple<int, uintptr_t, size_t>;

  static void Free(void* block);
  void ReclaimLocked();

  std::mutex mu_;
  std::map<PoolKey, std::vector<Block*>> pools_;  // GUARDED_BY(mu_)
  std::vector<Block*> freed_pending_;             // GUARDED_BY(mu_)
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TESTS_TORCH_SIM_CACHING_ALLOCATOR_H_
