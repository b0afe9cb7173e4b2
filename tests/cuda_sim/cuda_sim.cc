// A simulated CUDA driver (libcuda.so.1) for the copy engine's tests: see
// cuda_sim.h for the model and what it checks.
#include "cuda_sim.h"

#include <cstdlib>
#include <cstring>

#include "sim_internal.h"

namespace {

using namespace cuda_sim;  // NOLINT: the one namespace of the simulator

uint64_t EnvNumber(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

CUresult Copy(void* dst, const void* src, size_t n, void* stream, bool to_host, const char* call) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  if (Injected(s, call, &r)) return r;
  Stream* st = Resolve(s, stream, call, &r);
  if (st == nullptr) return r;
  const uintptr_t dev = reinterpret_cast<uintptr_t>(to_host ? src : dst);
  const uintptr_t host = reinterpret_cast<uintptr_t>(to_host ? dst : src);
  if (!IsDeviceMemory(s, dev, n)) {
    return Misuse(s, kInvalidValue, std::string(call) + " with memory that is not device memory");
  }
  r = CaptureCheck(s, st);
  if (r == kCaptured) return kSuccess;  // a node of the graph: not run now
  if (r != kSuccess) return r;
  ++(to_host ? s.stats.dtoh_copies : s.stats.htod_copies);
  if (!IsRegistered(s, host, n)) ++s.stats.copies_with_pageable_host;
  const uint32_t delay = s.copy_delay_us;
  Enqueue(s, st,
          {[dst, src, n, delay] {
             std::this_thread::sleep_for(std::chrono::microseconds(delay));
             std::memcpy(dst, src, n);
           },
           nullptr, 0, nullptr});
  return kSuccess;
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  const CUresult forced = static_cast<CUresult>(EnvNumber("CUDA_SIM_INIT_RESULT", 0));
  if (forced != kSuccess) return forced;
  if (s.initialized) return kSuccess;
  s.devices = static_cast<int>(EnvNumber("CUDA_SIM_DEVICES", 2));
  s.max_delay_us = static_cast<uint32_t>(EnvNumber("CUDA_SIM_MAX_DELAY_US", s.max_delay_us));
  s.seed = static_cast<uint32_t>(EnvNumber("CUDA_SIM_SEED", 1));
  for (int d = 0; d < s.devices; ++d) {
    s.contexts.push_back(new Context{d});
    s.default_streams.push_back(NewStream(s, d));
  }
  s.initialized = true;
  return kSuccess;
}

CUresult cuGetErrorString(CUresult error, const char** text) {
  static const std::map<CUresult, const char*> names = {
      {kSuccess, "CUDA_SUCCESS"},
      {kInvalidValue, "CUDA_ERROR_INVALID_VALUE"},
      {2, "CUDA_ERROR_OUT_OF_MEMORY"},
      {kNotInitialized, "CUDA_ERROR_NOT_INITIALIZED"},
      {kNoDevice, "CUDA_ERROR_NO_DEVICE"},
      {kInvalidDevice, "CUDA_ERROR_INVALID_DEVICE"},
      {kInvalidContext, "CUDA_ERROR_INVALID_CONTEXT"},
      {kInvalidHandle, "CUDA_ERROR_INVALID_HANDLE"},
      {kNotReady, "CUDA_ERROR_NOT_READY"},
      {700, "CUDA_ERROR_ILLEGAL_ADDRESS"},
      {kAlreadyRegistered, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
      {kNotRegistered, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
      {kStreamCaptureUnsupported, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"},
      {kStreamCaptureInvalidated, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"},
      {999, "CUDA_ERROR_UNKNOWN"}};
  auto it = names.find(error);
  if (it == names.end()) {
    *text = nullptr;
    return kInvalidValue;
  }
  *text = it->second;
  return kSuccess;
}

CUresult cuDeviceGetCount(int* count) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.initialized) return kNotInitialized;
  *count = s.devices;
  return kSuccess;
}

CUresult cuDeviceGet(int* device, int ordinal) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.initialized) return kNotInitialized;
  if (ordinal < 0 || ordinal >= s.devices) return kInvalidDevice;
  *device = ordinal;
  return kSuccess;
}

CUresult cuDevicePrimaryCtxRetain(void** context, int device) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.initialized) return kNotInitialized;
  if (device < 0 || device >= s.devices) return kInvalidDevice;
  *context = s.contexts[device];
  return kSuccess;
}

CUresult cuCtxSetCurrent(void* context) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (context == nullptr) {
    current_context = nullptr;
    return kSuccess;
  }
  for (Context* c : s.contexts) {
    if (c == context) {
      current_context = c;
      return kSuccess;
    }
  }
  return Misuse(s, kInvalidContext, "cuCtxSetCurrent with an unknown context");
}

CUresult cuCtxGetCurrent(void** context) {
  *context = current_context;
  return kSuccess;
}

CUresult cuStreamCreate(void** stream, unsigned) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (current_context == nullptr) {
    return Misuse(s, kInvalidContext, "cuStreamCreate without a current context");
  }
  Stream* st = NewStream(s, current_context->device);
  s.streams.insert(st);
  *stream = st;
  return kSuccess;
}

CUresult cuStreamSynchronize(void* stream) {
  Sim& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  Stream* st = Resolve(s, stream, "cuStreamSynchronize", &r);
  if (st == nullptr) return r;
  if (st->capture_status == kCaptureActive) {  // as CUDA: not permitted, breaks the capture
    InvalidateCapture(s, st->capture_origin);
    return kStreamCaptureUnsupported;
  }
  s.changed.wait(lock, [&] { return st->queue.empty() && !st->busy; });
  return kSuccess;
}

CUresult cuStreamWaitEvent(void* stream, void* event, unsigned) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  if (Injected(s, "cuStreamWaitEvent", &r)) return r;
  Stream* st = Resolve(s, stream, "cuStreamWaitEvent", &r);
  if (st == nullptr) return r;
  Event* e = LiveEvent(s, event, "cuStreamWaitEvent", &r);
  if (e == nullptr) return r;
  ++s.stats.stream_waits;
  if (e->captured_by != nullptr && e->captured_by->capture_status == kCaptureActive &&
      st->capture_status == kCaptureNone) {
    // Waiting on an event recorded in a capture pulls the stream into it.
    auto* origin = const_cast<Stream*>(e->captured_by);
    st->capture_status = kCaptureActive;
    st->capture_mode = origin->capture_mode;
    st->capture_origin = origin;
  }
  r = CaptureCheck(s, st);
  if (r == kCaptured) return kSuccess;
  if (r != kSuccess) return r;
  // As CUDA: the wait is for the event's most recent record as of now.
  if (e->records > 0) Enqueue(s, st, {nullptr, e, e->records, nullptr});
  return kSuccess;
}

CUresult cuEventCreate(void** event, unsigned) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (current_context == nullptr) {
    return Misuse(s, kInvalidContext, "cuEventCreate without a current context");
  }
  auto* e = new Event;
  e->device = current_context->device;
  s.events.insert(e);
  ++s.stats.live_events;
  *event = e;
  return kSuccess;
}

CUresult cuEventRecord(void* event, void* stream) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  if (Injected(s, "cuEventRecord", &r)) return r;
  Event* e = LiveEvent(s, event, "cuEventRecord", &r);
  if (e == nullptr) return r;
  Stream* st = Resolve(s, stream, "cuEventRecord", &r);
  if (st == nullptr) return r;
  r = CaptureCheck(s, st);
  if (r == kCaptured) {
    e->captured_by = st->capture_origin;
    return kSuccess;
  }
  if (r != kSuccess) return r;
  e->captured_by = nullptr;
  const uint64_t record = ++e->records;
  Enqueue(s, st, {nullptr, nullptr, record, e});
  return kSuccess;
}

CUresult cuEventQuery(void* event) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  Event* e = LiveEvent(s, event, "cuEventQuery", &r);
  if (e == nullptr) return r;
  return e->completed >= e->records ? kSuccess : kNotReady;
}

CUresult cuEventSynchronize(void* event) {
  Sim& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  if (Injected(s, "cuEventSynchronize", &r)) return r;
  Event* e = LiveEvent(s, event, "cuEventSynchronize", &r);
  if (e == nullptr) return r;
  if (e->captured_by != nullptr && e->captured_by->capture_status == kCaptureActive) {
    InvalidateCapture(s, e->captured_by);
    return kStreamCaptureUnsupported;
  }
  const uint64_t target = e->records;
  s.changed.wait(lock, [&] { return e->completed >= target; });
  return kSuccess;
}

CUresult cuEventDestroy_v2(void* event) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  Event* e = LiveEvent(s, event, "cuEventDestroy", &r);
  if (e == nullptr) return r;
  // Queued records and waits may still use it (as CUDA allows): the object
  // stays, only the handle dies.
  s.events.erase(e);
  s.destroyed.push_back(e);
  --s.stats.live_events;
  return kSuccess;
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t n, void* stream) {
  return Copy(dst, reinterpret_cast<const void*>(src), n, stream, true, "cuMemcpyDtoHAsync");
}

CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* stream) {
  return Copy(reinterpret_cast<void*>(dst), src, n, stream, false, "cuMemcpyHtoDAsync");
}

CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned) {
  Sim& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  // Pinning a large range takes long on a real driver: a test holds it here.
  s.changed.wait(lock, [&] { return s.blocked.count("cuMemHostRegister") == 0; });
  CUresult r = kSuccess;
  if (Injected(s, "cuMemHostRegister", &r)) return r;
  if (current_context == nullptr) {
    return Misuse(s, kInvalidContext, "cuMemHostRegister without a current context");
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  for (const auto& [b, size] : s.registered) {
    if (base < b + size && b < base + n) return kAlreadyRegistered;
  }
  s.registered[base] = n;
  ++s.stats.registered_ranges;
  ++s.stats.register_calls;
  return kSuccess;
}

CUresult cuMemHostUnregister(void* p) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = kSuccess;
  if (Injected(s, "cuMemHostUnregister", &r)) return r;  // and the range stays registered
  if (current_context == nullptr) {
    return Misuse(s, kInvalidContext, "cuMemHostUnregister without a current context");
  }
  auto it = s.registered.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.registered.end()) {
    ++s.stats.unknown_unregisters;
    return kNotRegistered;
  }
  s.registered.erase(it);
  --s.stats.registered_ranges;
  return kSuccess;
}

// ---- control API (cuda_sim.h) ----------------------------------------------

SimStats sim_stats() {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.stats;
}

const char* sim_last_misuse() {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  static thread_local std::string copy;
  copy = s.last_misuse;
  return copy.c_str();
}

void sim_add_device_memory(int device, void* base, size_t bytes) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.device_memory[reinterpret_cast<uintptr_t>(base)] = {device, bytes};
}

void sim_launch(int device, void* stream, void (*fn)(void*), void* arg) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  Stream* st = stream != nullptr ? static_cast<Stream*>(stream) : s.default_streams.at(device);
  if (CaptureCheck(s, st) != kSuccess) return;  // captured, or the capture is broken
  Enqueue(s, st, {[fn, arg] { fn(arg); }, nullptr, 0, nullptr});
}

void sim_synchronize_all() {
  Sim& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  s.changed.wait(lock, [&] { return s.stats.pending_work == 0; });
}

void sim_fail_call(const char* call, int nth, int result) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.failures[call] = {nth, result};
}

void sim_block_call(const char* call, int blocked) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (blocked != 0) {
    s.blocked.insert(call);
  } else {
    s.blocked.erase(call);
  }
  s.changed.notify_all();
}

void sim_set_max_delay_us(uint32_t us) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.max_delay_us = us;
}

void sim_set_copy_delay_us(uint32_t us) {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.copy_delay_us = us;
}

void sim_reset_counters() {
  Sim& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  const SimStats keep = s.stats;
  s.stats = SimStats{};
  s.stats.live_events = keep.live_events;
  s.stats.pending_work = keep.pending_work;
  s.stats.registered_ranges = keep.registered_ranges;
  s.last_misuse.clear();
}

}  // extern "C"
