// The simulated driver's state, shared by its source files (cuda_sim.cc:
// contexts, streams, events, copies, registrations; cuda_sim_capture.cc:
// device allocations and graph capture). Not part of the control API.
#ifndef MEMOFFLOAD_TESTS_CUDA_SIM_INTERNAL_H_
#define MEMOFFLOAD_TESTS_CUDA_SIM_INTERNAL_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda_sim.h"

namespace cuda_sim {

using CUresult = int;
inline constexpr CUresult kSuccess = 0;
inline constexpr CUresult kInvalidValue = 1;
inline constexpr CUresult kNotInitialized = 3;
inline constexpr CUresult kNoDevice = 100;
inline constexpr CUresult kInvalidDevice = 101;
inline constexpr CUresult kInvalidContext = 201;
inline constexpr CUresult kInvalidHandle = 400;
inline constexpr CUresult kNotReady = 600;
inline constexpr CUresult kAlreadyRegistered = 712;
inline constexpr CUresult kNotRegistered = 713;
inline constexpr CUresult kStreamCaptureUnsupported = 900;
inline constexpr CUresult kStreamCaptureInvalidated = 901;
// Not a driver result: the work was added to a graph being captured.
inline constexpr CUresult kCaptured = -1;

// CUstreamCaptureStatus and CUstreamCaptureMode.
inline constexpr int kCaptureNone = 0;
inline constexpr int kCaptureActive = 1;
inline constexpr int kCaptureInvalidated = 2;
inline constexpr int kModeGlobal = 0;
inline constexpr int kModeThreadLocal = 1;
inline constexpr int kModeRelaxed = 2;

struct Stream;

struct Context {
  int device;
};

struct Event {
  int device = 0;
  uint64_t records = 0;    // records queued so far
  uint64_t completed = 0;  // the highest record that completed
  // The capture its last record was added to (its origin stream), or null.
  const Stream* captured_by = nullptr;
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
  // Graph capture: work queued while active is a node of the graph and does
  // not run. `capture_origin` is the stream that began the capture (itself,
  // or the one whose captured event this stream waited on: joined).
  int capture_status = kCaptureNone;
  int capture_mode = kModeGlobal;
  Stream* capture_origin = nullptr;
  std::thread::id capture_thread;
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
  std::map<uintptr_t, std::vector<uint8_t>*> allocations;     // cuMemAlloc'ed, by base
  std::map<std::string, std::pair<int, int>> failures;        // call -> (countdown, result)
  std::set<std::string> blocked;                              // calls held at entry
  SimStats stats{};
  std::string last_misuse;
};

inline Sim& S() {
  static Sim* sim = new Sim;  // never destroyed: see above
  return *sim;
}

inline thread_local Context* current_context = nullptr;
// cuThreadExchangeStreamCaptureMode's setting of this thread.
inline thread_local int thread_capture_mode = kModeGlobal;

inline CUresult Misuse(Sim& s, CUresult result, const std::string& what) {
  ++s.stats.misuse;
  s.last_misuse = what;
  return result;
}

// Consumes one injected failure of `call`, if one is due: its result.
inline bool Injected(Sim& s, const char* call, CUresult* result) {
  auto it = s.failures.find(call);
  if (it == s.failures.end()) return false;
  if (--it->second.first > 0) return false;
  *result = it->second.second;
  s.failures.erase(it);
  return true;
}

inline void RunStream(Stream* st) {
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

inline Stream* NewStream(Sim& s, int device) {
  auto* st = new Stream;
  st->device = device;
  st->rng.seed(s.seed + static_cast<uint32_t>(s.streams.size() * 7919 + device));
  std::thread(RunStream, st).detach();
  return st;
}

inline void Enqueue(Sim& s, Stream* st, Work w) {
  ++s.stats.pending_work;
  st->queue.push_back(std::move(w));
  s.changed.notify_all();
}

// The stream a handle names (null: the legacy stream of the current
// context's device), or null after recording a misuse in *result.
inline Stream* Resolve(Sim& s, void* handle, const char* call, CUresult* result) {
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

inline Event* LiveEvent(Sim& s, void* handle, const char* call, CUresult* result) {
  auto* e = static_cast<Event*>(handle);
  if (s.events.count(e) == 0) {
    *result = Misuse(s, kInvalidHandle, std::string(call) + " on a destroyed or unknown event");
    return nullptr;
  }
  return e;
}

// Whether [p, p + n) lies in device memory of some device.
inline bool IsDeviceMemory(const Sim& s, uintptr_t p, size_t n) {
  auto it = s.device_memory.upper_bound(p);
  if (it == s.device_memory.begin()) return false;
  --it;
  return p + n <= it->first + it->second.second;
}

inline bool IsRegistered(const Sim& s, uintptr_t p, size_t n) {
  auto it = s.registered.upper_bound(p);
  if (it == s.registered.begin()) return false;
  --it;
  return p + n <= it->first + it->second;
}

// Every stream of the capture begun on `origin` sees it invalidated.
inline void InvalidateCapture(Sim& s, const Stream* origin) {
  ++s.stats.captures_invalidated;
  for (Stream* st : s.streams) {
    if (st->capture_origin == origin) st->capture_status = kCaptureInvalidated;
  }
}

// For work about to be queued on `st`: kSuccess to queue it; kCaptured when
// `st` is capturing (the work is a node of the graph and does not run); the
// error of an invalidated capture.
inline CUresult CaptureCheck(Sim& s, const Stream* st) {
  if (st->capture_status == kCaptureActive) {
    ++s.stats.captured_nodes;
    return kCaptured;
  }
  if (st->capture_status == kCaptureInvalidated) return kStreamCaptureInvalidated;
  return kSuccess;
}

// A call CUDA prohibits during capture ("potentially unsafe": cuMemAlloc,
// cuMemFree, ...) unless this thread is in relaxed mode: any active capture
// in global mode, or in thread-local mode begun by this thread, is
// invalidated and the call fails.
inline CUresult UnsafeCall(Sim& s) {
  if (thread_capture_mode == kModeRelaxed) return kSuccess;
  CUresult r = kSuccess;
  for (Stream* st : s.streams) {
    if (st->capture_status != kCaptureActive || st->capture_origin != st) continue;
    if (st->capture_mode == kModeGlobal || (st->capture_mode == kModeThreadLocal &&
                                            st->capture_thread == std::this_thread::get_id())) {
      InvalidateCapture(s, st);
      r = kStreamCaptureUnsupported;
    }
  }
  return r;
}

}  // namespace cuda_sim

#endif  // MEMOFFLOAD_TESTS_CUDA_SIM_INTERNAL_H_
