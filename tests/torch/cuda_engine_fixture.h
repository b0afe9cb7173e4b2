// The fixture of the CUDA copy engine's tests (cuda_engine_*_test.cc): one
// engine per process (the driver is loaded once), made with the simulated
// caching allocator, over the simulated driver (tests/cuda_sim); helpers for
// device memory, "kernels" and copies back.
#ifndef MEMOFFLOAD_TESTS_TORCH_CUDA_ENGINE_FIXTURE_H_
#define MEMOFFLOAD_TESTS_TORCH_CUDA_ENGINE_FIXTURE_H_

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "cuda_sim.h"
#include "memoffload/client/log.h"
#include "memoffload/torch/copy_engine.h"
#include "sim_caching_allocator.h"

// The driver calls the tests make themselves (the simulated driver's).
extern "C" {
int cuDeviceGet(int* device, int ordinal);
int cuDevicePrimaryCtxRetain(void** context, int device);
int cuCtxSetCurrent(void* context);
int cuCtxGetCurrent(void** context);
}

namespace memoffload::torch {

// The tests read what the engine logs through the client's log queue.
using client::EnableLogQueue;
using client::LogLevel;
using client::LogRecord;
using client::TakeLogRecords;

inline constexpr size_t kBytes = 1 << 20;
inline const c10::Device kGpu0(c10::DeviceType::CUDA, 0);

inline bool AllAre(const uint8_t* p, size_t n, uint8_t value) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != value) return false;
  }
  return true;
}

// A "kernel": after sleep_ms, fills n bytes at p.
struct Fill {
  uint8_t* p;
  size_t n;
  uint8_t value;
  int sleep_ms;
};
inline void RunFill(void* arg) {
  auto* f = static_cast<Fill*>(arg);
  std::this_thread::sleep_for(std::chrono::milliseconds(f->sleep_ms));
  std::memset(f->p, f->value, f->n);
}

// A "kernel" that, after sleep_ms, reads device memory into `seen`.
struct Read {
  const uint8_t* p;
  std::vector<uint8_t>* seen;
  int sleep_ms = 0;
};
inline void RunRead(void* arg) {
  auto* r = static_cast<Read*>(arg);
  std::this_thread::sleep_for(std::chrono::milliseconds(r->sleep_ms));
  r->seen->assign(r->p, r->p + kBytes);
}

// A "kernel" that runs until the test opens it (a layer's backward still
// queued), or 20 s.
inline void RunGate(void* arg) {
  auto* open = static_cast<std::atomic<bool>*>(arg);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!open->load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

class CudaEngine : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    allocator_ = new SimCachingAllocator;
    Result<std::unique_ptr<CopyEngine>> made =
        MakeCudaCopyEngine(std::unique_ptr<DeviceAllocator>(allocator_));
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    engine_ = std::move(made).value().release();
    EnableLogQueue(1000);  // the tests read what the engine logs
  }
  void SetUp() override {
    ASSERT_NE(engine_, nullptr);
    sim_set_max_delay_us(2000);
    sim_set_copy_delay_us(0);
    sim_reset_counters();
  }
  void TearDown() override {
    // Before the buffers go: a broken engine may still have copies queued.
    sim_synchronize_all();
    allocator_->ReclaimFinished();
    const SimStats s = sim_stats();
    EXPECT_EQ(s.live_events, 0u) << "the engine leaked events (tokens never dropped)";
    EXPECT_EQ(s.misuse, 0u) << "the engine made a call CUDA would reject: " << sim_last_misuse();
  }
  // kBytes of device `device`'s memory (in the simulation) or of host memory,
  // filled with `fill`, alive until after TearDown.
  uint8_t* Device(int device, uint8_t fill) {
    uint8_t* p = Host(fill);
    sim_add_device_memory(device, p, kBytes);
    return p;
  }
  uint8_t* Host(uint8_t fill, size_t n = kBytes) {
    buffers_.emplace_back(n, fill);
    return buffers_.back().data();
  }
  // A copy back of kBytes of 0x5C from a new arena buffer (*arena) into a
  // new buffer of GPU 0 (*dst), queued; the token FinishCopyIn returned.
  ReadyToken StartCopyBack(uint8_t** dst, uint8_t** arena_out = nullptr) {
    *dst = Device(0, 0);
    uint8_t* arena = Host(0x5C);
    if (arena_out != nullptr) *arena_out = arena;
    EXPECT_TRUE(engine_->CopyIn(kGpu0, arena, *dst, kBytes).ok());
    Result<ReadyToken> done = engine_->FinishCopyIn(kGpu0);
    EXPECT_TRUE(done.ok()) << done.status().ToString();
    return done.ok() ? *done : 0;
  }
  // Whether a "kernel" queued now on GPU 0's legacy stream reads 0x5C at dst.
  bool ConsumerSeesTheCopy(const uint8_t* dst) {
    std::vector<uint8_t>& seen = buffers_.emplace_back();
    Launch(0, RunRead, &reads_.emplace_back(Read{dst, &seen}));
    sim_synchronize_all();
    return AllAre(seen.data(), kBytes, 0x5C);
  }
  // Queues a "kernel" on the legacy stream of `device`; its argument must be
  // one of the members below, which outlive the test's queued work.
  void Launch(int device, void (*fn)(void*), void* arg) { sim_launch(device, nullptr, fn, arg); }
  static CopyEngine* engine_;
  static SimCachingAllocator* allocator_;  // owned by engine_
  std::deque<std::vector<uint8_t>> buffers_;
  std::deque<Fill> fills_;
  std::deque<Read> reads_;
  std::deque<std::atomic<bool>> gates_;
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TESTS_TORCH_CUDA_ENGINE_FIXTURE_H_
