// The CUDA engine while the trainer captures a CUDA graph (issue 18 #8): a
// pack on the capturing stream must leave the tensor in place without
// touching the capture, and the worker's allocations and copies must not
// break a global-mode capture another thread is making.
#include "cuda_engine_fixture.h"

extern "C" {
int cuDeviceGet(int* device, int ordinal);
int cuDevicePrimaryCtxRetain(void** context, int device);
int cuCtxSetCurrent(void* context);
int cuStreamCreate(void** stream, unsigned flags);
int cuStreamBeginCapture_v2(void* stream, int mode);
int cuStreamEndCapture(void* stream, void** graph);
}

namespace memoffload::torch {
namespace {

constexpr int kCaptureModeGlobal = 0;

// A stream of GPU 0 capturing a graph in global mode (torch.cuda.graph's
// default) from the calling thread; EndCapture's result.
class Capture {
 public:
  Capture() {
    int device = 0;
    ok_ = cuDeviceGet(&device, 0) == 0 && cuDevicePrimaryCtxRetain(&context_, device) == 0 &&
          cuCtxSetCurrent(context_) == 0 && cuStreamCreate(&stream_, 0x1) == 0 &&
          cuStreamBeginCapture_v2(stream_, kCaptureModeGlobal) == 0;
    cuCtxSetCurrent(nullptr);
  }
  bool ok() const { return ok_; }
  uintptr_t stream() const { return reinterpret_cast<uintptr_t>(stream_); }
  int End() {
    void* graph = nullptr;
    cuCtxSetCurrent(context_);
    const int r = cuStreamEndCapture(stream_, &graph);
    cuCtxSetCurrent(nullptr);
    return r;
  }

 private:
  void* context_ = nullptr;
  void* stream_ = nullptr;
  bool ok_ = false;
};

using DuringCapture = CudaEngine;

// The pack hook's MarkReady on the capturing stream would record its event
// into the graph (and CopyOut's wait on it would pull the D2H stream in, its
// synchronisation break the capture): the engine refuses, FAILED_PRECONDITION,
// and the offloader keeps the tensor where it is.
TEST_F(DuringCapture, MarkReadyOnTheCapturingStreamRefusesAndLeavesTheGraphAlone) {
  Capture capture;
  ASSERT_TRUE(capture.ok());
  Result<ReadyToken> ready = engine_->MarkReady(kGpu0, capture.stream());
  const uint64_t nodes = sim_stats().captured_nodes;
  if (ready.ok()) engine_->DropToken(*ready);
  EXPECT_EQ(capture.End(), 0) << "the capture was broken";
  EXPECT_EQ(nodes, 0u) << "MarkReady recorded an event inside a graph capture";
  ASSERT_FALSE(ready.ok()) << "MarkReady accepted a stream that is capturing a graph";
  EXPECT_EQ(ready.status().code(), StatusCode::kFailedPrecondition) << ready.status().ToString();
}

// The worker restores a group (a prefetch) while the training thread
// captures in global mode: a cudaMalloc from a thread in global mode would
// invalidate the capture. The engine's calls run in relaxed mode.
TEST_F(DuringCapture, AWorkersCopyBackLeavesAGlobalCaptureIntact) {
  Capture capture;
  ASSERT_TRUE(capture.ok());
  Status restored = Internal("not run");
  std::thread worker([&] {
    // A size no earlier test allocated: the allocator has to call cuMemAlloc.
    Result<c10::DataPtr> dst = engine_->AllocateForCopyIn(kGpu0, kBytes + 4096);
    if (!dst.ok()) {
      restored = dst.status();
      return;
    }
    uint8_t* arena = Host(0x5C);
    restored = engine_->CopyIn(kGpu0, arena, dst->get(), kBytes);
    Result<ReadyToken> done = engine_->FinishCopyIn(kGpu0);
    if (done.ok()) engine_->SyncAndDropToken(*done);
  });
  worker.join();
  EXPECT_EQ(capture.End(), 0) << "the copy back invalidated the trainer's capture";
  EXPECT_TRUE(restored.ok()) << restored.ToString();
}

}  // namespace
}  // namespace memoffload::torch
