// The CUDA copy engine: D2H and H2D through the driver API on dedicated
// non-blocking streams per device, ordered with events against the trainer's
// stream. Host chunks are registered (page-locked for the device) once per
// process, as they are first used.
#include <cstring>
#include <map>
#include <mutex>

#include "memoffload/torch/copy_engine.h"
#include "memoffload/torch/cuda_driver.h"
#include "memoffload/torch/log.h"

namespace memoffload::torch {
namespace {

struct DeviceStreams {
  CuContext context = nullptr;
  CuStream d2h = nullptr;
  CuStream h2d = nullptr;
};

class CudaCopyEngine final : public CopyEngine {
 public:
  explicit CudaCopyEngine(const CudaDriver* driver) : cu_(driver) {}

  const char* name() const override { return "cuda"; }
  bool Handles(c10::Device device) const override { return device.is_cuda() || device.is_cpu(); }

  Result<ReadyToken> MarkReady(c10::Device device, uintptr_t stream) override {
    if (device.is_cpu()) return ReadyToken{0};
    Result<DeviceStreams*> streams = Streams(device);
    if (!streams.ok()) return streams.status();
    CuEvent event = nullptr;
    MEMOFFLOAD_RETURN_IF_ERROR(
        cu_->Check(cu_->cuEventCreate(&event, kCuEventDisableTiming), "cuEventCreate"));
    Status st =
        cu_->Check(cu_->cuEventRecord(event, reinterpret_cast<CuStream>(stream)), "cuEventRecord");
    if (!st.ok()) {
      cu_->cuEventDestroy(event);
      return st;
    }
    return reinterpret_cast<ReadyToken>(event);
  }

  void DropToken(ReadyToken token) override {
    if (token != 0) cu_->cuEventDestroy(reinterpret_cast<CuEvent>(token));
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
    Status st = Status::Ok();
    if (ready != 0) {
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

  Status CopyIn(c10::Device device, const uint8_t* src, void* dst, size_t n) override {
    if (device.is_cpu()) {
      if (n != 0) std::memcpy(dst, src, n);
      return Status::Ok();
    }
    Result<DeviceStreams*> streams = Streams(device);
    if (!streams.ok()) return streams.status();
    CuStream s = (*streams)->h2d;
    // `dst` was just allocated by the caching allocator on the legacy default
    // stream, where kernels still queued may use the block's previous life:
    // the copy waits for them.
    CuEvent allocated = nullptr;
    MEMOFFLOAD_RETURN_IF_ERROR(
        cu_->Check(cu_->cuEventCreate(&allocated, kCuEventDisableTiming), "cuEventCreate"));
    Status st = cu_->Check(cu_->cuEventRecord(allocated, nullptr), "cuEventRecord");
    if (st.ok()) st = cu_->Check(cu_->cuStreamWaitEvent(s, allocated, 0), "cuStreamWaitEvent");
    if (st.ok() && n != 0) {
      st = cu_->Check(cu_->cuMemcpyHtoDAsync(reinterpret_cast<CuDevicePtr>(dst), src, n, s),
                      "cuMemcpyHtoDAsync");
    }
    // Destroying a recorded event is safe: the driver keeps what the wait
    // needs until it completes.
    cu_->cuEventDestroy(allocated);
    return st;
  }

  Result<ReadyToken> FinishCopyIn(c10::Device device) override {
    if (device.is_cpu()) return ReadyToken{0};
    Result<DeviceStreams*> streams = Streams(device);
    if (!streams.ok()) return streams.status();
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
    return reinterpret_cast<ReadyToken>(done);
  }

  Status WaitOnStream(ReadyToken token, uintptr_t stream) override {
    if (token == 0) return Status::Ok();
    return cu_->Check(cu_->cuStreamWaitEvent(reinterpret_cast<CuStream>(stream),
                                             reinterpret_cast<CuEvent>(token), 0),
                      "cuStreamWaitEvent");
  }

  void SyncAndDropToken(ReadyToken token) override {
    if (token == 0) return;
    cu_->cuEventSynchronize(reinterpret_cast<CuEvent>(token));
    DropToken(token);
  }

  void PrepareHostRange(const void* owner, uint8_t* base, size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    // Keyed by address while `owner` keeps the range mapped: ForgetHostRanges
    // removes the entry before the unmap, so a new mapping that lands on the
    // same address is registered again.
    if (!registered_.emplace(base, Registration{owner, false}).second) return;
    SetAnyContextLocked();
    const CuResult r = cu_->cuMemHostRegister(base, n, kCuMemHostRegisterPortable);
    if (r == kCudaSuccess) {
      registered_[base].by_us = true;
    } else if (r != kCudaErrorHostMemoryAlreadyRegistered && !warned_register_) {
      warned_register_ = true;
      const Status st = cu_->Check(r, "cuMemHostRegister");
      Log(LogLevel::kWarning, st.code(),
          "registering an arena chunk with CUDA failed (" + st.message() +
              "); copies use pageable memory and are slower");
    }
  }

  void ForgetHostRanges(const void* owner) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = registered_.begin(); it != registered_.end();) {
      if (it->second.owner != owner) {
        ++it;
        continue;
      }
      if (it->second.by_us) {
        SetAnyContextLocked();
        cu_->cuMemHostUnregister(it->first);
      }
      it = registered_.erase(it);
    }
  }

 private:
  // Makes the device's primary context current on the calling thread and
  // returns its streams, created on first use.
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
      MEMOFFLOAD_RETURN_IF_ERROR(cu_->Check(cu_->cuCtxSetCurrent(s.context), "cuCtxSetCurrent"));
      MEMOFFLOAD_RETURN_IF_ERROR(
          cu_->Check(cu_->cuStreamCreate(&s.d2h, kCuStreamNonBlocking), "cuStreamCreate"));
      MEMOFFLOAD_RETURN_IF_ERROR(
          cu_->Check(cu_->cuStreamCreate(&s.h2d, kCuStreamNonBlocking), "cuStreamCreate"));
      it = streams_.emplace(index, s).first;
    }
    MEMOFFLOAD_RETURN_IF_ERROR(
        cu_->Check(cu_->cuCtxSetCurrent(it->second.context), "cuCtxSetCurrent"));
    return &it->second;
  }

  // Registration calls need a current context; any device's primary context
  // will do (the registration is portable).
  void SetAnyContextLocked() {
    if (!streams_.empty()) cu_->cuCtxSetCurrent(streams_.begin()->second.context);
  }

  struct Registration {
    const void* owner = nullptr;  // the session whose mapping it is
    bool by_us = false;           // cuMemHostRegister succeeded: unregister
  };

  const CudaDriver* cu_;
  std::mutex mu_;
  std::map<int, DeviceStreams> streams_;         // GUARDED_BY(mu_); never erased
  std::map<uint8_t*, Registration> registered_;  // GUARDED_BY(mu_)
  bool warned_register_ = false;                 // GUARDED_BY(mu_)
};

}  // namespace

Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine() {
  Result<const CudaDriver*> driver = LoadCudaDriver();
  if (!driver.ok()) return driver.status();
  return std::unique_ptr<CopyEngine>(new CudaCopyEngine(*driver));
}

}  // namespace memoffload::torch
