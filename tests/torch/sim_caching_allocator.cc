#include "sim_caching_allocator.h"

#include <string>

// The simulated driver's calls the allocator makes itself.
extern "C" {
int cuDeviceGet(int* device, int ordinal);
int cuDevicePrimaryCtxRetain(void** context, int device);
int cuCtxSetCurrent(void* context);
int cuCtxGetCurrent(void** context);
int cuMemAlloc_v2(unsigned long long* dptr, size_t bytes);
int cuEventCreate(void** event, unsigned flags);
int cuEventRecord(void* event, void* stream);
int cuEventQuery(void* event);
int cuEventDestroy_v2(void* event);
}

namespace memoffload::torch {
namespace {

thread_local uintptr_t current_stream = 0;

// `device`'s primary context current for the scope, as torch's device guard.
class DeviceContext {
 public:
  explicit DeviceContext(int device) {
    cuCtxGetCurrent(&previous_);
    int dev = 0;
    void* context = nullptr;
    ok_ = cuDeviceGet(&dev, device) == 0 && cuDevicePrimaryCtxRetain(&context, dev) == 0 &&
          cuCtxSetCurrent(context) == 0;
  }
  ~DeviceContext() { cuCtxSetCurrent(previous_); }
  bool ok() const { return ok_; }

 private:
  void* previous_ = nullptr;
  bool ok_ = false;
};

}  // namespace

void SimCachingAllocator::SetCurrentStream(uintptr_t stream) { current_stream = stream; }
uintptr_t SimCachingAllocator::CurrentStream() { return current_stream; }

Result<c10::DataPtr> SimCachingAllocator::Allocate(c10::Device device, size_t n, uintptr_t stream) {
  const int index = device.has_index() ? device.index() : 0;
  std::lock_guard<std::mutex> lock(mu_);
  ReclaimLocked();
  Block* block = nullptr;
  std::vector<Block*>& pool = pools_[PoolKey{index, stream, n}];
  if (!pool.empty()) {
    block = pool.back();
    pool.pop_back();
  } else {
    DeviceContext context(index);
    if (!context.ok()) return Internal("no context for device " + std::to_string(index));
    unsigned long long base = 0;
    const int r = cuMemAlloc_v2(&base, n);
    if (r != 0) return Unavailable("cuMemAlloc failed (" + std::to_string(r) + ")");
    block = new Block;  // cached for the process, like torch's
    block->owner = this;
    block->device = index;
    block->data = reinterpret_cast<uint8_t*>(base);
    block->bytes = n;
    block->stream = stream;
  }
  return c10::DataPtr(block->data, block, &SimCachingAllocator::Free, device);
}

Status SimCachingAllocator::RecordStream(const c10::DataPtr& data, uintptr_t stream) {
  auto* block = static_cast<Block*>(data.get_context());
  std::lock_guard<std::mutex> lock(mu_);
  if (stream != block->stream) block->uses.insert(stream);
  return Status::Ok();
}

void SimCachingAllocator::Free(void* context) {
  auto* block = static_cast<Block*>(context);
  SimCachingAllocator* self = block->owner;
  std::lock_guard<std::mutex> lock(self->mu_);
  if (block->uses.empty()) {
    self->pools_[PoolKey{block->device, block->stream, block->bytes}].push_back(block);
    return;
  }
  DeviceContext current(block->device);
  for (uintptr_t use : block->uses) {
    void* event = nullptr;
    cuEventCreate(&event, 0x2);
    cuEventRecord(event, reinterpret_cast<void*>(use));
    block->pending.push_back(event);
  }
  block->uses.clear();
  self->freed_pending_.push_back(block);
}

void SimCachingAllocator::ReclaimFinished() {
  std::lock_guard<std::mutex> lock(mu_);
  ReclaimLocked();
}

void SimCachingAllocator::ReclaimLocked() {
  for (auto it = freed_pending_.begin(); it != freed_pending_.end();) {
    Block* block = *it;
    bool done = true;
    for (void* event : block->pending) done = done && cuEventQuery(event) == 0;
    if (!done) {
      ++it;
      continue;
    }
    DeviceContext current(block->device);
    for (void* event : block->pending) cuEventDestroy_v2(event);
    block->pending.clear();
    pools_[PoolKey{block->device, block->stream, block->bytes}].push_back(block);
    it = freed_pending_.erase(it);
  }
}

}  // namespace memoffload::torch
