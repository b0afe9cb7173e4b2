// The real CUDA copy engine (client/torch/src/cuda_copy_engine.cc) against
// the simulated driver (tests/cuda_sim): streams that really run late, events
// that complete when their stream reaches them. Each ordering test makes the
// wrong order observable: work queued right after the engine's call would
// run first (or the copy would read changed bytes) if the engine skipped the
// event, wait or synchronisation it owes.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <thread>
#include <vector>

#include "cuda_engine_fixture.h"
#include "cuda_sim.h"
#include "memoffload/client/log.h"
#include "memoffload/torch/copy_engine.h"

namespace memoffload::torch {

CopyEngine* CudaEngine::engine_ = nullptr;
SimCachingAllocator* CudaEngine::allocator_ = nullptr;

namespace {

TEST_F(CudaEngine, IsTheSimulatedDriver) {
  EXPECT_STREQ(engine_->name(), "cuda");
  uint8_t* src = Device(0, 7);
  uint8_t* host = Host(0);
  ASSERT_TRUE(engine_->CopyOut(kGpu0, src, host, kBytes, 0).ok());
  EXPECT_EQ(sim_stats().dtoh_copies, 1u);
}

// The trainer's last kernel writes the tensor late; MarkReady's event is what
// keeps the D2H from reading it before.
TEST_F(CudaEngine, CopyOutReadsTheSourceOnlyAfterMarkReadysPoint) {
  uint8_t* src = Device(0, 0);
  Launch(0, RunFill, &fills_.emplace_back(Fill{src, kBytes, 0xAB, 30}));
  Result<ReadyToken> ready = engine_->MarkReady(kGpu0, 0);
  ASSERT_TRUE(ready.ok()) << ready.status().ToString();
  uint8_t* host = Host(0x11);
  ASSERT_TRUE(engine_->CopyOut(kGpu0, src, host, kBytes, *ready).ok());
  EXPECT_TRUE(AllAre(host, kBytes, 0xAB)) << "the D2H read the source before it was final";
}

// CopyOut's caller checksums the arena bytes and may release the source as
// soon as it returns: the bytes must be there by then.
TEST_F(CudaEngine, CopyOutReturnsOnlyOnceTheBytesAreInTheArena) {
  sim_set_copy_delay_us(20000);
  uint8_t* src = Device(0, 0x3C);
  uint8_t* host = Host(0);
  ASSERT_TRUE(engine_->CopyOut(kGpu0, src, host, kBytes, 0).ok());
  EXPECT_TRUE(AllAre(host, kBytes, 0x3C)) << "CopyOut returned before its copy finished";
}

// The consumer (backward) stream must not read the restored tensor before
// the H2D is done: WaitOnStream orders it without blocking the thread.
TEST_F(CudaEngine, TheConsumerStreamWaitsForTheCopyBack) {
  sim_set_copy_delay_us(200000);
  uint8_t* dst = nullptr;
  const ReadyToken done = StartCopyBack(&dst);
  ASSERT_TRUE(engine_->WaitOnStream(done, 0).ok());
  EXPECT_TRUE(AllAre(dst, kBytes, 0)) << "WaitOnStream blocked the thread until the copy was done";
  EXPECT_TRUE(ConsumerSeesTheCopy(dst)) << "the consumer read before the copy back";
  engine_->SyncAndDropToken(done);
}

// The arena range is handed back (and may be rewritten) right after
// SyncAndDropToken: the copy must have read it by then.
TEST_F(CudaEngine, SyncAndDropTokenReturnsOnlyAfterTheCopyBack) {
  sim_set_copy_delay_us(20000);
  uint8_t *dst = nullptr, *arena = nullptr;
  const ReadyToken done = StartCopyBack(&dst, &arena);
  engine_->SyncAndDropToken(done);
  std::memset(arena, 0, kBytes);  // the range's next use
  sim_synchronize_all();
  EXPECT_TRUE(AllAre(dst, kBytes, 0x5C)) << "the copy back read a range already reused";
}

// Issue 18 #4. Autograd runs unpack hooks on its own thread, which on torch
// 2.x with CUDA 12 may have no current context yet, or the context of
// another GPU than the tensor's: the wait must land on the legacy stream of
// the tensor's device, and the thread's current context must be left as it
// was (torch's own calls on that thread depend on it).
TEST_F(CudaEngine, WaitOnStreamFromAThreadWithoutAContextGatesTheTensorsDevice) {
  sim_set_copy_delay_us(200000);
  uint8_t* dst = nullptr;
  const ReadyToken done = StartCopyBack(&dst);
  Status waited = Internal("not run");
  void* context_after = &waited;
  std::thread autograd([&] {
    waited = engine_->WaitOnStream(done, 0);
    cuCtxGetCurrent(&context_after);
  });
  autograd.join();
  EXPECT_TRUE(waited.ok()) << waited.ToString();
  EXPECT_EQ(context_after, nullptr) << "WaitOnStream left a context current on the thread";
  EXPECT_TRUE(ConsumerSeesTheCopy(dst)) << "the consumer read before the copy back";
  engine_->SyncAndDropToken(done);
}

TEST_F(CudaEngine, WaitOnStreamGatesTheTensorsDeviceNotTheThreadsCurrentOne) {
  sim_set_copy_delay_us(200000);
  uint8_t* dst = nullptr;
  const ReadyToken done = StartCopyBack(&dst);
  void* gpu1 = nullptr;
  void* context_after = nullptr;
  Status waited = Internal("not run");
  std::thread autograd([&] {
    int device = 0;
    if (cuDeviceGet(&device, 1) != 0 || cuDevicePrimaryCtxRetain(&gpu1, device) != 0 ||
        cuCtxSetCurrent(gpu1) != 0) {
      return;
    }
    waited = engine_->WaitOnStream(done, 0);
    cuCtxGetCurrent(&context_after);
  });
  autograd.join();
  ASSERT_NE(gpu1, nullptr);
  EXPECT_TRUE(waited.ok()) << waited.ToString();
  EXPECT_EQ(context_after, gpu1) << "WaitOnStream changed the thread's current context";
  EXPECT_TRUE(ConsumerSeesTheCopy(dst))
      << "the wait gated GPU 1's stream, not the tensor's (GPU 0)";
  engine_->SyncAndDropToken(done);
}

// MarkReady runs on the training thread too.
TEST_F(CudaEngine, MarkReadyLeavesTheThreadsContextAsItWas) {
  void* context_after = &context_after;
  std::thread trainer([&] {
    Result<ReadyToken> ready = engine_->MarkReady(c10::Device(c10::DeviceType::CUDA, 1), 0);
    if (ready.ok()) engine_->DropToken(*ready);
    cuCtxGetCurrent(&context_after);
  });
  trainer.join();
  EXPECT_EQ(context_after, nullptr);
}

TEST_F(CudaEngine, RegistrationsAreOncePerMappingAndDroppedWithTheirOwner) {
  uint8_t* a = Host(0, 3 * kBytes);
  uint8_t* b = Host(0);
  const int session1 = 0, session2 = 0;
  engine_->PrepareHostRange(&session1, a, kBytes);
  engine_->PrepareHostRange(&session1, a + kBytes, kBytes);
  engine_->PrepareHostRange(&session1, a, kBytes);  // already: no second call
  engine_->PrepareHostRange(&session2, b, kBytes);
  EXPECT_EQ(sim_stats().registered_ranges, 3u);
  EXPECT_EQ(sim_stats().register_calls, 3u);
  engine_->ForgetHostRanges(&session1);  // its session reconnects
  EXPECT_EQ(sim_stats().registered_ranges, 1u);
  // A new mapping that lands on the same address is registered afresh.
  const int session3 = 0;
  engine_->PrepareHostRange(&session3, a, kBytes);
  EXPECT_EQ(sim_stats().registered_ranges, 2u);
  engine_->ForgetHostRanges(&session3);
  engine_->ForgetHostRanges(&session2);
  EXPECT_EQ(sim_stats().registered_ranges, 0u) << "registrations leaked";
  EXPECT_EQ(sim_stats().unknown_unregisters, 0u);
}

// Issue 18 #10: pinning a 1 GiB chunk takes long; the pack hook's MarkReady
// on the training thread must not wait for it.
TEST_F(CudaEngine, ARegistrationInProgressDoesNotHoldUpMarkReady) {
  uint8_t* arena = Host(0);
  const int session = 0;
  Result<ReadyToken> warm = engine_->MarkReady(kGpu0, 0);  // streams exist
  ASSERT_TRUE(warm.ok());
  engine_->DropToken(*warm);
  sim_block_call("cuMemHostRegister", 1);
  std::thread worker([&] { engine_->PrepareHostRange(&session, arena, kBytes); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // it is inside the call
  auto marked = std::async(std::launch::async, [&] { return engine_->MarkReady(kGpu0, 0); });
  const bool in_time = marked.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  sim_block_call("cuMemHostRegister", 0);
  worker.join();
  EXPECT_TRUE(in_time) << "MarkReady waited for a registration";
  Result<ReadyToken> token = marked.get();
  ASSERT_TRUE(token.ok());
  engine_->DropToken(*token);
  EXPECT_EQ(sim_stats().registered_ranges, 1u);
  engine_->ForgetHostRanges(&session);
}

// Issue 18 #9: a registration left at an address (an unregister that failed)
// would point the driver at the old pages of a new mapping there: the engine
// replaces it rather than taking "already registered" as fine, and says so
// when an unregister fails.
TEST_F(CudaEngine, AStaleRegistrationAtTheSameAddressIsReplaced) {
  uint8_t* arena = Host(0);
  const int old_session = 0, new_session = 0;
  engine_->PrepareHostRange(&old_session, arena, kBytes);
  sim_fail_call("cuMemHostUnregister", 1, 999);
  engine_->ForgetHostRanges(&old_session);  // the unmap follows; the driver keeps it
  EXPECT_EQ(sim_stats().registered_ranges, 1u);
  bool logged = false;
  for (const LogRecord& r : TakeLogRecords()) {
    logged = logged || r.message.find("cuMemHostUnregister") != std::string::npos;
  }
  EXPECT_TRUE(logged) << "a failed unregister was not logged";
  engine_->PrepareHostRange(&new_session, arena, kBytes);  // a new mapping, same address
  EXPECT_EQ(sim_stats().register_calls, 2u) << "the stale registration was taken as ours";
  engine_->ForgetHostRanges(&new_session);
  EXPECT_EQ(sim_stats().registered_ranges, 0u) << "a registration outlived its mapping";
  TakeLogRecords();
}

// Issue 18 #9: if waiting for the copy back fails, the range may still be
// read by the device; that is an error worth a line, never silence.
TEST_F(CudaEngine, AFailedWaitForTheCopyBackIsLogged) {
  uint8_t* dst = Device(0, 0);
  uint8_t* arena = Host(0x5C);
  ASSERT_TRUE(engine_->CopyIn(kGpu0, arena, dst, kBytes).ok());
  Result<ReadyToken> done = engine_->FinishCopyIn(kGpu0);
  ASSERT_TRUE(done.ok());
  sim_fail_call("cuEventSynchronize", 1, 700);  // CUDA_ERROR_ILLEGAL_ADDRESS
  engine_->SyncAndDropToken(*done);
  bool logged = false;
  for (const LogRecord& r : TakeLogRecords()) {
    logged = logged || (r.level == LogLevel::kError &&
                        r.message.find("CUDA_ERROR_ILLEGAL_ADDRESS") != std::string::npos);
  }
  EXPECT_TRUE(logged) << "a failed cuEventSynchronize was ignored";
}

// A registration CUDA refuses makes copies slower (pageable), never wrong,
// and is not unregistered later.
TEST_F(CudaEngine, AFailedRegistrationOnlyMakesCopiesSlower) {
  uint8_t* arena = Host(0);
  const int session = 0;
  sim_fail_call("cuMemHostRegister", 1, 2);  // CUDA_ERROR_OUT_OF_MEMORY
  engine_->PrepareHostRange(&session, arena, kBytes);
  EXPECT_EQ(sim_stats().registered_ranges, 0u);
  uint8_t* src = Device(0, 0x42);
  ASSERT_TRUE(engine_->CopyOut(kGpu0, src, arena, kBytes, 0).ok());
  EXPECT_TRUE(AllAre(arena, kBytes, 0x42));
  EXPECT_EQ(sim_stats().copies_with_pageable_host, 1u);
  engine_->ForgetHostRanges(&session);
  EXPECT_EQ(sim_stats().unknown_unregisters, 0u);
}

// Issue 18 #7. A registration refused for want of a context (the first
// chunk prepared before any device was used) is tried again on the next use
// of the range, not remembered as failed for the mapping's life.
TEST_F(CudaEngine, ARegistrationRefusedForWantOfAContextIsRetried) {
  uint8_t* arena = Host(0);
  const int session = 0;
  sim_fail_call("cuMemHostRegister", 1, 201);  // CUDA_ERROR_INVALID_CONTEXT
  engine_->PrepareHostRange(&session, arena, kBytes);
  EXPECT_EQ(engine_->UnpinnedHostBytes(), kBytes);
  engine_->PrepareHostRange(&session, arena, kBytes);  // the next group in this chunk
  EXPECT_EQ(sim_stats().registered_ranges, 1u) << "the registration was never tried again";
  EXPECT_EQ(engine_->UnpinnedHostBytes(), 0u);
  engine_->ForgetHostRanges(&session);
  TakeLogRecords();
}

// Issue 18 #7. Every chunk that stays unpinned says so once (not only the
// first of the process), and its bytes are counted until it is unmapped.
TEST_F(CudaEngine, EachUnpinnedChunkIsLoggedOnceAndCounted) {
  uint8_t* a = Host(0);
  uint8_t* b = Host(0);
  const int session = 0;
  TakeLogRecords();
  for (uint8_t* chunk : {a, b}) {
    sim_fail_call("cuMemHostRegister", 1, 2);  // CUDA_ERROR_OUT_OF_MEMORY
    engine_->PrepareHostRange(&session, chunk, kBytes);
    engine_->PrepareHostRange(&session, chunk, kBytes);  // no second line
  }
  int lines = 0;
  for (const LogRecord& r : TakeLogRecords()) {
    if (r.message.find("CUDA_ERROR_OUT_OF_MEMORY") != std::string::npos) ++lines;
  }
  EXPECT_EQ(lines, 2) << "each chunk that stays unpinned is logged once";
  EXPECT_EQ(engine_->UnpinnedHostBytes(), 2 * kBytes);
  engine_->ForgetHostRanges(&session);
  EXPECT_EQ(engine_->UnpinnedHostBytes(), 0u);
}

// A copy the driver refuses is an error for the caller (which keeps the group
// on the device and counts it), never bytes that look fine; the token is
// dropped either way.
TEST_F(CudaEngine, AFailedCopyIsAnErrorAndLeaksNoEvent) {
  uint8_t* src = Device(0, 0x42);
  uint8_t* host = Host(0);
  Result<ReadyToken> ready = engine_->MarkReady(kGpu0, 0);
  ASSERT_TRUE(ready.ok());
  sim_fail_call("cuMemcpyDtoHAsync", 1, 999);
  Status out = engine_->CopyOut(kGpu0, src, host, kBytes, *ready);
  EXPECT_FALSE(out.ok());
  EXPECT_NE(out.message().find("CUDA_ERROR_UNKNOWN"), std::string::npos) << out.ToString();
  sim_fail_call("cuMemcpyHtoDAsync", 1, 999);
  uint8_t* dst = Device(0, 0);
  EXPECT_FALSE(engine_->CopyIn(kGpu0, host, dst, kBytes).ok());
  Result<ReadyToken> done = engine_->FinishCopyIn(kGpu0);
  ASSERT_TRUE(done.ok());
  engine_->SyncAndDropToken(*done);
  sim_fail_call("cuEventRecord", 1, 999);
  EXPECT_FALSE(engine_->MarkReady(kGpu0, 0).ok());
}

// cuda_engine_probe (the engine's loader alone, in a fresh process: the
// driver is loaded once per process) with the simulated libcuda.so.1 found
// by LD_LIBRARY_PATH, as a real one would be, and `env` set: "exit N: " and
// the line it printed.
std::string RunProbe(const std::string& env) {
  const std::string command = "env LD_LIBRARY_PATH=" MEMOFFLOAD_CUDA_SIM_DIR " " + env +
                              " " MEMOFFLOAD_BIN_DIR "/cuda_engine_probe 2>&1";
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return "popen failed";
  std::string text;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) text += buf;
  const int status = pclose(p);
  return "exit " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + ": " + text;
}

TEST(CudaEngineLoad, TheSimulatorIsFoundLikeARealDriver) {
  const std::string ok = RunProbe("");
  EXPECT_NE(ok.find("exit 0: cuda engine"), std::string::npos) << ok;
}

// Then the torch layer falls back to the host engine (CUDA storages stay on
// the device); the message says why.
TEST(CudaEngineLoad, NoDeviceOrAFailingInitIsUnavailableNamingTheCause) {
  const std::string init = RunProbe("CUDA_SIM_INIT_RESULT=100");
  EXPECT_NE(init.find("exit 3: UNAVAILABLE"), std::string::npos) << init;
  EXPECT_NE(init.find("cuInit failed: CUDA_ERROR_NO_DEVICE (100)"), std::string::npos) << init;
  const std::string none = RunProbe("CUDA_SIM_DEVICES=0");
  EXPECT_NE(none.find("exit 3: UNAVAILABLE"), std::string::npos) << none;
  EXPECT_NE(none.find("reports no device"), std::string::npos) << none;
  const std::string missing = RunProbe("LD_LIBRARY_PATH=/nonexistent");
  EXPECT_NE(missing.find("exit 3: UNAVAILABLE"), std::string::npos) << missing;
  EXPECT_NE(missing.find("libcuda.so.1"), std::string::npos) << missing;
}

}  // namespace
}  // namespace memoffload::torch
