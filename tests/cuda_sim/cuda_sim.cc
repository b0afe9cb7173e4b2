// A simulated CUDA driver (libcuda.so.1) for the copy engine's tests: see
// cuda_sim.h for the model and what it checks.
#include "cuda_sim.h"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using CUresult = int;
constexpr CUresult kSuccess = 0;
constexpr CUresult kInvalidValue = 1;
constexpr CUresult kNotInitialized = 3;
constexpr CUresult kNoDevice = 100;
constexpr CUresult kInvalidDevice = 101;
constexpr CUresult kInvalidContext = 201;
constexpr CUresult kInvalidHandle = 400;
constexpr CUresult kNotReady = 600;
constexpr CUresult kAlreadyRegistered = 712;
constexpr CUresult kNotRegistered = 713;

struct Context {
  int device;
};

struct Event {
  int device = 0;
  uint64_t records = 0;    // records queued so far
  uint64_t completed = 0;  // the highest record that completed
};

// One item of a stream's work: a wait (wait_for set), an event record
// (record set; done under the lock) or anything else (run, without it).
struct Work {
  std::function<void()> run;
  const Event* wait_for = nullptr;  // until wait_for->completed >= target
  uint64_t target = 0;
  Event* record = nullptr;  // record->completed = max(it, target)
};

struct Stream {
  int device = 0;
  std::deque<Work> queue;
  bool busy = false;
  std::mt19937 rng;
};

// Everything lives as long as the process (stream threads may still run at
// exit), under one lock; `changed` is notified whenever work completes.
struct Sim {
  std::mutex mu;
  std::condition_variable changed;
  bool initialized = false;
  int devices = 2;
  uint32_t max_delay_us = 2000;
  uint32_t copy_delay_us = 0;  // on top, before every copy
  uint32_t seed = 1;
  std::vector<Context*> contexts;                             // primary context per device
  std::vector<Stream*> default_streams;                       // legacy stream per device
  std::set<Stream*> streams;                                  // created by cuStreamCreate
  std::set<Event*> events;                                    // live
  std::vector<Event*> destroyed;                              // queued work may still use them
  std::map<uintptr_t, std::pair<int, size_t>> device_memory;  // base -> (device, bytes)
  std::map<uintptr_t, size_t> registered;                     // host base -> bytes
  std::map<std::string, std::pair<int, int>> failures;        // call -> (countdown, result)
  std::set<std::string> blocked;                              // calls held at entry
  SimStats stats{};
  std::string last_misuse;
};

Sim& S() {
  static Sim* sim = new Sim;  // never destroyed: see above
  return *sim;
}

thread_local Context* current_context = nullptr;

CUresult Misuse(Sim& s, CUresult result, const std::string& what) {
  ++s.stats.misuse;
  s.last_misuse = what;
  return result;
}

// Consumes one injected failure of `call`, if one is due: its result.
bool Injected(Sim& s, const char* call, CUresult* result) {
  auto it = s.failures.find(call);
  if (it == s.failures.end()) return false;
  if (--it->second.first > 0) return false;
  *result = it->second.second;
  s.failures.erase(it);
  return true;
}

void RunStream(Stream* st) {
  Sim& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  while (true) {
    s.changed.wait(lock, [&] { return !st->queue.empty(); });
    Work w = std::move(st->queue.front());
    st->queue.pop_front();
    st->busy = true;
    if (w.wait_for != nullptr) {
      s.changed.wait(lock, [&] { return w.wait_for->completed >= w.target; });
    } else {
      const uint32_t delay = s.max_delay_us == 0 ? 0 : st->rng() % (s.max_delay_us + 1);
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(delay));
      if (w.run != nullptr) w.run();
      lock.lock();
      if (w.record != nullptr) w.record->completed = std::max(w.record->completed, w.target);
    }
    st->busy = false;
    --s.stats.pending_work;
    s.changed.notify_all();
  }
}

Stream* NewStream(Sim& s, int device) {
  auto* st = new Stream;
  st->device = device;
  st->rng.seed(s.seed + static_cast<uint32_t>(s.streams.size() * 7919 + device));
  std::thread(RunStream, st).detach();
  return st;
}

void Enqueue(Sim& s, Stream* st, Work w) {
  ++s.stats.pending_work;
  st->queue.push_back(std::move(w));
  s.changed.notify_all();
}

// The stream a handle names (null: the legacy stream of the current
// context's device), or null after recording a misuse in *result.
Stream* Resolve(Sim& s, void* handle, const char* call, CUresult* result) {
  if (current_context == nullptr) {
    *result = Misuse(s, kInvalidContext, std::string(call) + " without a current context");
    return nullptr;
  }
  if (handle == nullptr) return s.default_streams[current_context->device];
  auto* st = static_cast<Stream*>(handle);
  if (s.streams.count(st) == 0) {
    *result = Misuse(s, kInvalidHandle, std::string(call) + " on an unknown stream");
    return nullptr;
  }
  return st;
}

Event* LiveEvent(Sim& s, void* handle, const char* call, CUresult* result) {
  auto* e = static_cast<Event*>(handle);
  if (s.events.count(e) == 0) {
    *result = Misuse(s, kInvalidHandle, std::string(call) + " on a destroyed or unknown event");
    return nullptr;
  }
  return e;
}

// Whether [p, p + n) lies in device memory of some device.
bool IsDeviceMemory(const Sim& s, uintptr_t p, size_t n) {
  auto it = s.device_memory.upper_bound(p);
  if (it == s.device_memory.begin()) return false;
  --it;
  return p + n <= it->first + it->second.second;
}

bool IsRegistered(const Sim& s, uintptr_t p, size_t n) {
  auto it = s.registered.upper_bound(p);
  if (it == s.registered.begin()) return false;
  --it;
  return p + n <= it->first + it->second;
}

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
