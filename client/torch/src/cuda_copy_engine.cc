// The CUDA copy engine: D2H and H2D through the driver API on dedicated
// non-blocking streams per device, ordered with events against the trainer's
// stream. Host chunks are registered (page-locked for the device) once per
// process, as they are first used.
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "memoffload/client/log.h"
#include "memoffload/torch/copy_engine.h"
#include "memoffload/torch/cuda_driver.h"

namespace memoffload::torch {
namespace {

struct DeviceStreams {
  CuContext context = nullptr;
  CuStream d2h = nullptr;
  CuStream h2d = nullptr;
};

// Makes a device's context current on this thread for the scope, then
// restores the one that was (none, on a fresh autograd thread). The
// trainer's threads call MarkReady and WaitOnStream: torch's own calls on
// them rely on their current context, and a thread without one would make
// a legacy-stream call fail or land on another GPU.
//
// The thread's stream capture mode is relaxed for the scope too: while the
// trainer captures a CUDA graph in global mode (torch.cuda.graph's default),
// an allocation (cudaMalloc behind the caching allocator), a registration or
// a synchronisation from a thread in global mode would invalidate the
// capture. None of the engine's work goes into a capture.
class ScopedContext {
 public:
  ScopedContext(const CudaDriver* cu, CuContext context) : cu_(cu) {
    saved_ = cu_->cuCtxGetCurrent(&previous_) == kCudaSuccess;
    status_ = cu_->Check(cu_->cuCtxSetCurrent(context), "cuCtxSetCurrent");
    relaxed_ = cu_->cuThreadExchangeStreamCaptureMode(&mode_) == kCudaSuccess;
  }
  ~ScopedContext() {
    if (relaxed_) cu_->cuThreadExchangeStreamCaptureMode(&mode_);
    if (saved_) cu_->cuCtxSetCurrent(previous_);
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  const Status& status() const { return status_; }

 private:
  const CudaDriver* cu_;
  CuContext previous_ = nullptr;
  bool saved_ = false;
  int mode_ = kCuStreamCaptureModeRelaxed;  // the thread's own while relaxed_
  bool relaxed_ = false;
  Status status_;
};

class CudaCopyEngine final : public CopyEngine {
 public:
  CudaCopyEngine(const CudaDriver* driver, std::unique_ptr<DeviceAllocator> allocator)
      : cu_(driver), allocator_(std::move(allocator)) {}

  const char* name() const override { return "cuda"; }
  bool Handles(c10::Device device) const override { return device.is_cuda() || device.is_cpu(); }

  Result<ReadyToken> MarkReady(c10::Device device, uintptr_t stream) override {
    if (device.is_cpu()) return ReadyToken{0};
    Result<DeviceStreams*> streams = Streams(device);
    if (!streams.ok()) return streams.status();
    ScopedContext current(cu_, (*streams)->context);
    MEMOFFLOAD_RETURN_IF_ERROR(current.status());
    // An event recorded on a capturing stream is a node of the graph, and
    // CopyOut's wait on it would pull the D2H stream into the capture.
    int capture = kCuStreamCaptureStatusNone;
    MEMOFFLOAD_RETURN_IF_ERROR(
        cu_->Check(cu_->cuStreamIsCapturing(reinterpret_cast<CuStream>(stream), &capture),
                   "cuStreamIsCapturing"));
    if (capture != kCuStreamCaptureStatusNone) {
      return FailedPrecondition("the stream is capturing a CUDA graph");
    }
    CuEvent event = nullptr;
    MEMOFFLOAD_RETURN_IF_ERROR(
        cu_->Check(cu_->cuEventCreate(&event, kCuEventDisableTiming), "cuEventCreate"));
    Status st =
        cu_->Check(cu_->cuEventRecord(event, reinterpret_cast<CuStream>(stream)), "cuEventRecord");
    if (!st.ok()) {
      cu_->cuEventDestroy(event);
      return st;
    }
    return Remember(event, (*streams)->context);
  }

  void DropToken(ReadyToken token) override {
    if (token == 0) return;
    CuContext context = Forget(token);
    ScopedContext current(cu_, context);
    cu_->cuEventDestroy(reinterpret_cast<CuEvent>(token));
  }

  Status CopyOut(c10::Device device, const void* src, uint8_t* dst, size_t n,
                 ReadyToken ready) override {
    if (device.is_cpu()) {
      if (n != 0) std::memcpy(dst, src, n);
      return Status::Ok();
    }
    Result<DeviceStreams*> streams = Streams(device);
    if (!streams.ok()) {
      DropToken(ready);
      return streams.status();
    }
    CuStream s = (*streams)->d2h;
    ScopedContext current(cu_, (*streams)->context);
    Status st = current.status();
    if (st.ok() && ready != 0) {
      st = cu_->Check(cu_->cuStreamWaitEvent(s, reinterpret_cast<CuEvent>(ready), 0),
                      "cuStreamWaitEvent");
    }
    if (st.ok() && n != 0) {
      st = cu_->Check(cu_->cuMemcpyDtoHAsync(dst, reinterpret_cast<CuDevicePtr>(src), n, s),
                      "cuMemcpyDtoHAsync");
    }
    if (st.ok()) st = cu_->Check(cu_->cuStreamSynchronize(s), "cuStreamSynchronize");
    DropToken(ready);
    return st;
  }

  Result<c10::DataPtr> AllocateForCopyIn(c10::Device device, size_t n) override {
    Result<DeviceStreams*> streams = Streams(device);
    if (!streams.ok()) return streams.status();
    ScopedContext current(cu_, (*streams)->context);
    MEMOFFLOAD_RETURN_IF_ERROR(current.status());
    return allocator_->Allocate(device, n, reinterpret_cast<uintptr_t>((*streams)->h2d));
  }

  Status RecordUse(c10::Device device, const c10::DataPtr& data, uintptr_t stream) override {
    if (device.is_cpu()) return Status::Ok();
    return allocator_->RecordStream(data, stream);
  }

  Status CopyIn(c10::Device device, const uint8_t* src, void* dst, size_t n) override {
    if (device.is_cpu()) {
      if (n != 0) std::memcpy(dst, src, n);
      return Status::Ok();
    }
    Result<DeviceStreams*> streams = Streams(device);
    if (!streams.ok()) return streams.status();
    CuStream s = (*streams)->h2d;
    ScopedContext current(cu_, (*streams)->context);
    MEMOFFLOAD_RETURN_IF_ERROR(current.status());
    // `dst` came from AllocateForCopyIn, for this stream: nothing to wait for.
    if (n == 0) return Status::Ok();
    return cu_->Check(cu_->cuMemcpyHtoDAsync(reinterpret_cast<CuDevicePtr>(dst), src, n, s),
                      "cuMemcpyHtoDAsync");
  }

  Result<ReadyToken> FinishCopyIn(c10::Device device) override {
    if (device.is_cpu()) return ReadyToken{0};
    Result<DeviceStreams*> streams = Streams(device);
    if (!streams.ok()) return streams.status();
    ScopedContext current(cu_, (*streams)->context);
    MEMOFFLOAD_RETURN_IF_ERROR(current.status());
    CuEvent done = nullptr;
    MEMOFFLOAD_RETURN_IF_ERROR(
        cu_->Check(cu_->cuEventCreate(&done, kCuEventDisableTiming), "cuEventCreate"));
    Status st = cu_->Check(cu_->cuEventRecord(done, (*streams)->h2d), "cuEventRecord");
    if (!st.ok()) {
      // Nothing to wait on: make the copies complete before returning.
      cu_->cuEventDestroy(done);
      Status sync = cu_->Check(cu_->cuStreamSynchronize((*streams)->h2d), "cuStreamSynchronize");
      if (!sync.ok()) return sync;
      return ReadyToken{0};
    }
    return Remember(done, (*streams)->context);
  }

  // `stream` belongs to the token's device (stream 0: that device's legacy
  // stream), whatever the calling thread's current context.
  Status WaitOnStream(ReadyToken token, uintptr_t stream) override {
    if (token == 0) return Status::Ok();
    CuContext context = ContextOf(token);
    if (context == nullptr) return Internal("WaitOnStream: a token this engine did not make");
    ScopedContext current(cu_, context);
    MEMOFFLOAD_RETURN_IF_ERROR(current.status());
    return cu_->Check(cu_->cuStreamWaitEvent(reinterpret_cast<CuStream>(stream),
                                             reinterpret_cast<CuEvent>(token), 0),
                      "cuStreamWaitEvent");
  }

  void SyncAndDropToken(ReadyToken token) override {
    if (token == 0) return;
    {
      ScopedContext current(cu_, ContextOf(token));
      const Status st = cu_->Check(cu_->cuEventSynchronize(reinterpret_cast<CuEvent>(token)),
                                   "cuEventSynchronize");
      if (!st.ok()) {
        client::Log(client::LogLevel::kError, st.code(),
                    "waiting for a copy back to the GPU failed (" + st.message() +
                        "); the device may still read the arena range being released");
      }
    }
    DropToken(token);
  }

  // Registrations have their own lock, not mu_: pinning a 1 GiB chunk takes
  // long, and the training thread's MarkReady takes mu_.
  void PrepareHostRange(const void* owner, uint8_t* base, size_t n) override {
    std::lock_guard<std::mutex> lock(reg_mu_);
    // Keyed by address while `owner` keeps the range mapped: ForgetHostRanges
    // removes the entry before the unmap, so a new mapping that lands on the
    // same address is registered again.
    auto [it, fresh] = registered_.emplace(base, Registration{owner, n});
    Registration& reg = it->second;
    if (!fresh && !reg.retry) return;
    if (fresh) unpinned_bytes_ += n;
    CuContext context = AnyContext();
    CuResult r = kCudaErrorInvalidContext;
    if (context != nullptr) {
      ScopedContext current(cu_, context);
      r = cu_->cuMemHostRegister(base, n, kCuMemHostRegisterPortable);
      if (r == kCudaErrorHostMemoryAlreadyRegistered) {
        // Not by this mapping (it had no entry): left by an earlier mapping
        // at this address whose unregister failed. It would point the driver
        // at that mapping's pages; replace it.
        client::Log(client::LogLevel::kWarning, StatusCode::kOk,
                    "a CUDA registration of an earlier arena mapping was still in place at a new "
                    "mapping's address; replacing it");
        r = cu_->cuMemHostUnregister(base);
        if (r == kCudaSuccess) r = cu_->cuMemHostRegister(base, n, kCuMemHostRegisterPortable);
      }
    }
    if (r == kCudaSuccess) {
      reg.by_us = true;
      reg.retry = false;
      unpinned_bytes_ -= n;
      return;
    }
    // Without a context (no device retained yet, or none current) the
    // registration is tried again at the next use of the range; any other
    // refusal holds for the mapping's life. Each range says so once.
    reg.retry = r == kCudaErrorInvalidContext;
    if (reg.logged) return;
    reg.logged = true;
    const Status st = context == nullptr ? Unavailable("no CUDA context to register with")
                                         : cu_->Check(r, "cuMemHostRegister");
    client::Log(client::LogLevel::kWarning, st.code(),
                "registering an arena chunk of " + std::to_string(n) + " bytes with CUDA failed (" +
                    st.message() + "); copies through it use pageable memory and are slower" +
                    (reg.retry ? " until a later attempt succeeds" : "") +
                    " (counted in stats()[\"unpinned_bytes\"])");
  }

  uint64_t UnpinnedHostBytes() const override { return unpinned_bytes_.load(); }

  void ForgetHostRanges(const void* owner) override {
    std::lock_guard<std::mutex> lock(reg_mu_);
    for (auto it = registered_.begin(); it != registered_.end();) {
      if (it->second.owner != owner) {
        ++it;
        continue;
      }
      if (it->second.by_us) {
        ScopedContext current(cu_, AnyContext());
        const Status st = cu_->Check(cu_->cuMemHostUnregister(it->first), "cuMemHostUnregister");
        if (!st.ok()) {
          // The next mapping at this address replaces it (PrepareHostRange).
          client::Log(client::LogLevel::kWarning, st.code(),
                      "unregistering an arena chunk from CUDA failed: " + st.message());
        }
      }
      if (!it->second.by_us) unpinned_bytes_ -= it->second.bytes;
      it = registered_.erase(it);
    }
  }

 private:
  // The device's primary context and streams, created on first use.
  Result<DeviceStreams*> Streams(c10::Device device) {
    std::lock_guard<std::mutex> lock(mu_);
    const int index = device.has_index() ? device.index() : 0;
    auto it = streams_.find(index);
    if (it == streams_.end()) {
      DeviceStreams s;
      CuDevice dev = 0;
      MEMOFFLOAD_RETURN_IF_ERROR(cu_->Check(cu_->cuDeviceGet(&dev, index), "cuDeviceGet"));
      MEMOFFLOAD_RETURN_IF_ERROR(
          cu_->Check(cu_->cuDevicePrimaryCtxRetain(&s.context, dev), "cuDevicePrimaryCtxRetain"));
      ScopedContext current(cu_, s.context);
      MEMOFFLOAD_RETURN_IF_ERROR(current.status());
      MEMOFFLOAD_RETURN_IF_ERROR(
          cu_->Check(cu_->cuStreamCreate(&s.d2h, kCuStreamNonBlocking), "cuStreamCreate"));
      MEMOFFLOAD_RETURN_IF_ERROR(
          cu_->Check(cu_->cuStreamCreate(&s.h2d, kCuStreamNonBlocking), "cuStreamCreate"));
      it = streams_.emplace(index, s).first;
    }
    return &it->second;
  }

  // The token's context, kept until it is dropped.
  ReadyToken Remember(CuEvent event, CuContext context) {
    std::lock_guard<std::mutex> lock(mu_);
    token_contexts_[event] = context;
    return reinterpret_cast<ReadyToken>(event);
  }
  CuContext ContextOf(ReadyToken token) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = token_contexts_.find(reinterpret_cast<CuEvent>(token));
    return it == token_contexts_.end() ? nullptr : it->second;
  }
  CuContext Forget(ReadyToken token) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = token_contexts_.find(reinterpret_cast<CuEvent>(token));
    if (it == token_contexts_.end()) return nullptr;
    CuContext context = it->second;
    token_contexts_.erase(it);
    return context;
  }

  // Registration calls need a current context; any device's primary context
  // will do (the registration is portable): a device in use, else device 0's.
  CuContext AnyContext() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!streams_.empty()) return streams_.begin()->second.context;
    if (any_context_ == nullptr) {
      CuDevice dev = 0;
      if (cu_->cuDeviceGet(&dev, 0) == kCudaSuccess) {
        cu_->cuDevicePrimaryCtxRetain(&any_context_, dev);
      }
    }
    return any_context_;
  }

  struct Registration {
    const void* owner = nullptr;  // the session whose mapping it is
    size_t bytes = 0;
    bool by_us = false;   // cuMemHostRegister succeeded: unregister
    bool retry = false;   // refused for want of a context: try at the next use
    bool logged = false;  // its failure was logged
  };

  const CudaDriver* cu_;
  const std::unique_ptr<DeviceAllocator> allocator_;
  std::mutex mu_;
  std::map<int, DeviceStreams> streams_;         // GUARDED_BY(mu_); never erased
  std::map<CuEvent, CuContext> token_contexts_;  // GUARDED_BY(mu_); live tokens
  CuContext any_context_ = nullptr;              // GUARDED_BY(mu_)
  std::mutex reg_mu_;                            // taken before mu_, never after
  std::map<uint8_t*, Registration> registered_;  // GUARDED_BY(reg_mu_)
  std::atomic<uint64_t> unpinned_bytes_{0};      // written under reg_mu_
};

}  // namespace

Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine(std::unique_ptr<DeviceAllocator> allocator) {
  Result<const CudaDriver*> driver = LoadCudaDriver();
  if (!driver.ok()) return driver.status();
  if (allocator == nullptr) allocator = MakeTorchDeviceAllocator();
  return std::unique_ptr<CopyEngine>(new CudaCopyEngine(*driver, std::move(allocator)));
}

}  // namespace memoffload::torch
