// The CUDA copy engine: D2H and H2D through the driver API on dedicated
// non-blocking streams per device, ordered with events against the trainer's
// stream. Host chunks are registered (page-locked for the device) once per
// process, as they are first used.
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "memoffload/torch/copy_engine.h"
#include "memoffload/torch/cuda_driver.h"

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
    if (st.ok()) st = cu_->Check(cu_->cuStreamSynchronize(s), "cuStreamSynchronize");
    cu_->cuEventDestroy(allocated);
    return st;
  }

  void PrepareHostRange(uint8_t* base, size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!registered_.insert(base).second) return;
    CuContext any = nullptr;
    if (!streams_.empty()) any = streams_.begin()->second.context;
    if (any != nullptr) cu_->cuCtxSetCurrent(any);
    const CuResult r = cu_->cuMemHostRegister(base, n, kCuMemHostRegisterPortable);
    if (r != kCudaSuccess && r != kCudaErrorHostMemoryAlreadyRegistered && !warned_register_) {
      warned_register_ = true;
      std::fprintf(stderr,
                   "memoffload: registering an arena chunk with CUDA failed (%s); copies use "
                   "pageable memory and are slower\n",
                   cu_->Check(r, "cuMemHostRegister").message().c_str());
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

  const CudaDriver* cu_;
  std::mutex mu_;
  std::map<int, DeviceStreams> streams_;  // GUARDED_BY(mu_); never erased
  std::set<uint8_t*> registered_;         // GUARDED_BY(mu_)
  bool warned_register_ = false;          // GUARDED_BY(mu_)
};

}  // namespace

Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine() {
  Result<const CudaDriver*> driver = LoadCudaDriver();
  if (!driver.ok()) return driver.status();
  return std::unique_ptr<CopyEngine>(new CudaCopyEngine(*driver));
}

}  // namespace memoffload::torch
