// The simulated driver's device allocations and CUDA graph capture (see
// cuda_sim.h): what a pack hook or a copy back meets while the trainer
// captures a graph.
#include <vector>

#include "cuda_sim.h"
#include "sim_internal.h"

namespace {

using namespace cuda_sim;  // NOLINT: the one namespace of the simulator

// A stream the test or the engine created (captures never run on the
// legacy stream), or null after recording a misuse in *result.
Stream* CreatedStream(Sim& s, void* handle, const char* call, CUresult* result) {
  Stream* st = Resolve(s, handle, call, result);
  if (st != nullptr && s.streams.count(st) == 0) {
    *result = Misuse(s, kInvalidValue, std::string(call) + " on the legacy stream");
    return nullptr;
  }
  return st;
}

}  // namespace

extern "C" {

CUresult cuStreamBeginCapture_v2(void* stream, int mode) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  Stream* st = CreatedStream(s, stream, "cuStreamBeginCapture", &r);
  if (st == nullptr) return r;
  if (st->capture_status != kCaptureNone) {
    return Misuse(s, kInvalidValue, "cuStreamBeginCapture on a stream already capturing");
  }
  st->capture_status = kCaptureActive;
  st->capture_mode = mode;
  st->capture_origin = st;
  st->capture_thread = std::this_thread::get_id();
  return kSuccess;
}

// The graph handle is opaque and unusable: the tests only look at whether
// the capture survived.
CUresult cuStreamEndCapture(void* stream, void** graph) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  Stream* st = CreatedStream(s, stream, "cuStreamEndCapture", &r);
  if (st == nullptr) return r;
  if (st->capture_origin != st) {
    return Misuse(s, kInvalidValue, "cuStreamEndCapture on a stream that did not begin one");
  }
  r = st->capture_status == kCaptureInvalidated ? kStreamCaptureInvalidated : kSuccess;
  for (Stream* other : s.streams) {
    if (other->capture_origin != st) continue;
    other->capture_status = kCaptureNone;
    other->capture_origin = nullptr;
  }
  *graph = r == kSuccess ? st : nullptr;
  return r;
}

CUresult cuStreamIsCapturing(void* stream, int* status) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  Stream* st = Resolve(s, stream, "cuStreamIsCapturing", &r);
  if (st == nullptr) return r;
  *status = st->capture_status;
  return kSuccess;
}

CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  if (*mode < kModeGlobal || *mode > kModeRelaxed) return kInvalidValue;
  const int previous = thread_capture_mode;
  thread_capture_mode = *mode;
  *mode = previous;
  return kSuccess;
}

// Device memory of the current context's device, from the process heap.
CUresult cuMemAlloc_v2(unsigned long long* dptr, size_t bytes) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  if (Injected(s, "cuMemAlloc", &r)) return r;
  if (current_context == nullptr) {
    return Misuse(s, kInvalidContext, "cuMemAlloc without a current context");
  }
  r = UnsafeCall(s);
  if (r != kSuccess) return r;
  auto* block = new std::vector<uint8_t>(bytes == 0 ? 1 : bytes);
  const auto base = reinterpret_cast<uintptr_t>(block->data());
  s.allocations[base] = block;
  s.device_memory[base] = {current_context->device, bytes};
  ++s.stats.device_allocations;
  *dptr = base;
  return kSuccess;
}

CUresult cuMemFree_v2(unsigned long long dptr) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = UnsafeCall(s);
  if (r != kSuccess) return r;
  auto it = s.allocations.find(dptr);
  if (it == s.allocations.end()) {
    return Misuse(s, kInvalidValue, "cuMemFree of memory cuMemAlloc did not return");
  }
  delete it->second;
  s.allocations.erase(it);
  s.device_memory.erase(dptr);
  return kSuccess;
}

}  // extern "C"
