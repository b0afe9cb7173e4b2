// The CUDA engine's copies back (issue 18 #3, #5, #6): where a restored
// storage's memory comes from and what its copy waits for. The simulated
// caching allocator (sim_caching_allocator.h) stands in for torch's; each
// test makes a block's reuse observable: a "kernel" of the block's previous
// or next life reads or writes it while the H2D would still be running.
#include <future>

#include "cuda_engine_fixture.h"

extern "C" {
int cuDeviceGet(int* device, int ordinal);
int cuDevicePrimaryCtxRetain(void** context, int device);
int cuCtxSetCurrent(void* context);
int cuStreamCreate(void** stream, unsigned flags);
}

namespace memoffload::torch {
namespace {

using CopyBack = CudaEngine;

// A copy back of kBytes of `fill` from a new arena buffer into `dst`, queued;
// the token of FinishCopyIn.
ReadyToken QueueCopyBack(CopyEngine* engine, const uint8_t* arena, const c10::DataPtr& dst) {
  EXPECT_TRUE(engine->CopyIn(kGpu0, arena, dst.get(), kBytes).ok());
  Result<ReadyToken> done = engine->FinishCopyIn(kGpu0);
  EXPECT_TRUE(done.ok()) << done.status().ToString();
  return done.ok() ? *done : 0;
}

// A stream of GPU 0 made by the test (the trainer's side stream).
void* NewStream() {
  int device = 0;
  void* context = nullptr;
  void* stream = nullptr;
  if (cuDeviceGet(&device, 0) != 0 || cuDevicePrimaryCtxRetain(&context, device) != 0 ||
      cuCtxSetCurrent(context) != 0 || cuStreamCreate(&stream, 0x1) != 0) {
    stream = nullptr;
  }
  cuCtxSetCurrent(nullptr);
  return stream;
}

// Issue 18 #6. Prefetch is there to overlap: the copy back of the next
// layer's activations must not wait for the backward still queued on the
// compute stream (it used to wait for everything queued on the legacy
// stream, so it ran just before its consumer).
TEST_F(CopyBack, DoesNotWaitForWorkQueuedOnTheComputeStream) {
  std::atomic<bool>& backward_done = gates_.emplace_back(false);
  Launch(0, RunGate, &backward_done);
  Result<c10::DataPtr> dst = engine_->AllocateForCopyIn(kGpu0, kBytes);
  ASSERT_TRUE(dst.ok()) << dst.status().ToString();
  const ReadyToken done = QueueCopyBack(engine_, Host(0x5C), *dst);
  auto copied = std::async(std::launch::async, [&] { engine_->SyncAndDropToken(done); });
  const bool overlapped = copied.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  backward_done = true;
  copied.wait();
  EXPECT_TRUE(overlapped) << "the copy back waited for the compute stream's queued work";
  EXPECT_TRUE(AllAre(static_cast<uint8_t*>(dst->get()), kBytes, 0x5C));
}

// What stands for the old "copy waits for the legacy stream": the consumer's
// use is recorded, so once autograd frees the restored tensor the next copy
// back (served from the same stream's pool) cannot overwrite the block while
// a kernel queued on the consumer's stream still reads it.
TEST_F(CopyBack, ABlockIsNotReusedWhileItsConsumerStillReadsIt) {
  Result<c10::DataPtr> first = engine_->AllocateForCopyIn(kGpu0, kBytes);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  const ReadyToken done = QueueCopyBack(engine_, Host(0x5C), *first);
  ASSERT_TRUE(engine_->WaitOnStream(done, 0).ok());
  ASSERT_TRUE(engine_->RecordUse(kGpu0, *first, 0).ok());
  std::vector<uint8_t>& seen = buffers_.emplace_back();
  Launch(0, RunRead, &reads_.emplace_back(Read{static_cast<uint8_t*>(first->get()), &seen, 50}));
  first->clear();  // autograd is done with it; its kernel is still queued
  Result<c10::DataPtr> next = engine_->AllocateForCopyIn(kGpu0, kBytes);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  engine_->SyncAndDropToken(QueueCopyBack(engine_, Host(0x66), *next));
  engine_->SyncAndDropToken(done);
  sim_synchronize_all();
  EXPECT_TRUE(AllAre(seen.data(), kBytes, 0x5C))
      << "the next copy back overwrote a block its consumer was still reading";
}

// Issue 18 #3. A group's storage whose entry was dropped unread (a branch
// discarded in forward) is dropped at the end of the backward round while
// its copy back may still be queued. Its block goes back to the allocator;
// the late H2D must not overwrite what the trainer allocates there next.
TEST_F(CopyBack, ARestoredStorageDroppedUnreadDoesNotClobberTheBlocksNextUse) {
  sim_set_copy_delay_us(100000);
  Result<c10::DataPtr> unread = engine_->AllocateForCopyIn(kGpu0, kBytes);
  ASSERT_TRUE(unread.ok()) << unread.status().ToString();
  const ReadyToken done = QueueCopyBack(engine_, Host(0x5C), *unread);
  unread->clear();  // the round ends: the group drops its restored storage
  // The trainer's next tensor (at::empty on its stream), written at once.
  Result<c10::DataPtr> next =
      allocator_->Allocate(kGpu0, kBytes, SimCachingAllocator::CurrentStream());
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  auto* p = static_cast<uint8_t*>(next->get());
  Launch(0, RunFill, &fills_.emplace_back(Fill{p, kBytes, 0x77, 0}));
  engine_->SyncAndDropToken(done);  // at the group's Release
  sim_synchronize_all();
  EXPECT_TRUE(AllAre(p, kBytes, 0x77))
      << "the late copy back of a dropped storage overwrote its block's next tenant";
}

// Issue 18 #5. A second backward restores on the autograd thread, whose
// current stream may be another than the legacy one: the copy must not
// overwrite a block that work queued on that stream still reads.
TEST_F(CopyBack, ARestoreOnAThreadWithAnotherCurrentStreamSparesThatStreamsWork) {
  void* side = NewStream();
  ASSERT_NE(side, nullptr);
  std::vector<uint8_t>& seen = buffers_.emplace_back();
  Status restored = Internal("not run");
  std::thread autograd([&] {
    SimCachingAllocator::SetCurrentStream(reinterpret_cast<uintptr_t>(side));
    // A tensor of this thread's stream, read by a kernel still queued there,
    // then freed (the caching allocator may hand its block to this stream).
    Result<c10::DataPtr> old =
        allocator_->Allocate(kGpu0, kBytes, SimCachingAllocator::CurrentStream());
    if (!old.ok()) return;
    std::memset(old->get(), 0x11, kBytes);
    sim_launch(0, side, RunRead,
               &reads_.emplace_back(Read{static_cast<uint8_t*>(old->get()), &seen, 50}));
    old->clear();
    Result<c10::DataPtr> dst = engine_->AllocateForCopyIn(kGpu0, kBytes);
    if (!dst.ok()) {
      restored = dst.status();
      return;
    }
    engine_->SyncAndDropToken(QueueCopyBack(engine_, Host(0x5C), *dst));
    restored = Status::Ok();
    SimCachingAllocator::SetCurrentStream(0);
  });
  autograd.join();
  ASSERT_TRUE(restored.ok()) << restored.ToString();
  sim_synchronize_all();
  EXPECT_TRUE(AllAre(seen.data(), kBytes, 0x11))
      << "the copy back overwrote a block a kernel on the thread's stream was still reading";
}

}  // namespace
}  // namespace memoffload::torch
