// The simulated CUDA driver's control API, for tests (tests/cuda_sim/).
//
// libcuda.so.1 built from cuda_sim.cc implements the driver calls the CUDA
// copy engine resolves (client/torch/src/cuda_driver.cc) with real
// asynchrony: every stream is a worker thread that runs its work in order,
// each item after a random delay; an event completes when its stream reaches
// it; a stream wait holds back the stream's later work until the event's
// record (as of the wait call) completes. "Device memory" is host memory the
// test registers with sim_add_device_memory. A test that links this library
// gets the same instance the engine dlopens (same soname).
//
// What it checks, as CUDA would fail or as a bug (sim_stats().misuse):
// calls that need a current context on a thread without one
// (CUDA_ERROR_INVALID_CONTEXT), destroyed or unknown handles, copies from or
// to device memory that was not handed out, unregistering an unknown range.
//
// Device memory also comes from cuMemAlloc / cuMemFree (host heap memory
// recorded as the current context's device's).
//
// Graph capture (cuStreamBeginCapture_v2, cuStreamEndCapture,
// cuStreamIsCapturing, cuThreadExchangeStreamCaptureMode), as CUDA does it:
// work queued on a capturing stream becomes a node and does not run; an event
// recorded there is a captured event, and a stream that waits on it joins
// the capture; synchronising a capturing stream or a captured event fails
// with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture, as
// does cuMemAlloc/cuMemFree from a thread not in relaxed mode while a global
// capture (or this thread's thread-local one) is active; cuStreamEndCapture
// of an invalidated capture returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED.
//
// Environment, read at cuInit: CUDA_SIM_DEVICES (default 2),
// CUDA_SIM_INIT_RESULT (cuInit's result, default 0), CUDA_SIM_MAX_DELAY_US
// (default 2000), CUDA_SIM_SEED (default 1).
//
// Not modelled: the implicit synchronisation of blocking streams with the
// legacy default stream (the engine's streams are non-blocking; a test that
// relies on it would pass where CUDA also orders, so leaving it out only
// makes the checks stricter).
#ifndef MEMOFFLOAD_TESTS_CUDA_SIM_H_
#define MEMOFFLOAD_TESTS_CUDA_SIM_H_

#include <cstddef>
#include <cstdint>

extern "C" {

struct SimStats {
  uint64_t live_events;          // created, not destroyed
  uint64_t pending_work;         // queued on any stream, not done
  uint64_t registered_ranges;    // cuMemHostRegister'ed, not unregistered
  uint64_t register_calls;       // successful cuMemHostRegister
  uint64_t unknown_unregisters;  // cuMemHostUnregister of a range never registered
  uint64_t misuse;               // calls CUDA would reject (see above)
  uint64_t dtoh_copies;
  uint64_t htod_copies;
  uint64_t copies_with_pageable_host;  // host side not registered
  uint64_t stream_waits;               // cuStreamWaitEvent calls
  uint64_t captured_nodes;             // work added to a graph being captured
  uint64_t captures_invalidated;       // captures broken by a prohibited call
  uint64_t device_allocations;         // successful cuMemAlloc
};

SimStats sim_stats();
// The last misuse, as text ("" if none).
const char* sim_last_misuse();

// [base, base + bytes) is device `device`'s memory from now on.
void sim_add_device_memory(int device, void* base, size_t bytes);

// Queues fn(arg) on `stream` (null: the legacy default stream of `device`),
// in order with its other work: the test's "kernel".
void sim_launch(int device, void* stream, void (*fn)(void*), void* arg);

// Waits until every stream is idle.
void sim_synchronize_all();

// The `nth` (1 = next) call of `call` ("cuMemHostRegister",
// "cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync", "cuEventRecord", ...) returns
// `result` without doing anything.
void sim_fail_call(const char* call, int nth, int result);

// While `blocked` is non-zero, calls of `call` (today "cuMemHostRegister")
// wait at entry: a slow driver call, held as long as the test wants.
void sim_block_call(const char* call, int blocked);

// Upper bound of the random delay before each item of stream work.
void sim_set_max_delay_us(uint32_t us);

// A fixed delay before every copy, on top of the random one: makes a copy
// reliably slower than the work a test queues right after it.
void sim_set_copy_delay_us(uint32_t us);

// Clears the counters (not the handles or registrations).
void sim_reset_counters();
}

#endif  // MEMOFFLOAD_TESTS_CUDA_SIM_H_
