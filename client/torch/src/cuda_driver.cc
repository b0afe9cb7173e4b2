#include "memoffload/torch/cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace memoffload::torch {
namespace {

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr) {
    *missing = name;
    return false;
  }
  return true;
}

Result<const CudaDriver*> LoadOnce() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    return Unavailable(std::string("CUDA driver not loaded: ") + (err ? err : "libcuda.so.1"));
  }
  static CudaDriver driver;
  std::string missing;
  // Versioned names where the driver exports several (the _v2 ABI).
  const bool ok =
      Resolve(lib, "cuInit", &driver.cuInit, &missing) &&
      Resolve(lib, "cuGetErrorString", &driver.cuGetErrorString, &missing) &&
      Resolve(lib, "cuDeviceGetCount", &driver.cuDeviceGetCount, &missing) &&
      Resolve(lib, "cuDeviceGet", &driver.cuDeviceGet, &missing) &&
      Resolve(lib, "cuDevicePrimaryCtxRetain", &driver.cuDevicePrimaryCtxRetain, &missing) &&
      Resolve(lib, "cuCtxSetCurrent", &driver.cuCtxSetCurrent, &missing) &&
      Resolve(lib, "cuCtxGetCurrent", &driver.cuCtxGetCurrent, &missing) &&
      Resolve(lib, "cuStreamCreate", &driver.cuStreamCreate, &missing) &&
      Resolve(lib, "cuStreamSynchronize", &driver.cuStreamSynchronize, &missing) &&
      Resolve(lib, "cuStreamWaitEvent", &driver.cuStreamWaitEvent, &missing) &&
      Resolve(lib, "cuEventCreate", &driver.cuEventCreate, &missing) &&
      Resolve(lib, "cuEventRecord", &driver.cuEventRecord, &missing) &&
      Resolve(lib, "cuEventSynchronize", &driver.cuEventSynchronize, &missing) &&
      Resolve(lib, "cuEventDestroy_v2", &driver.cuEventDestroy, &missing) &&
      Resolve(lib, "cuMemcpyDtoHAsync_v2", &driver.cuMemcpyDtoHAsync, &missing) &&
      Resolve(lib, "cuMemcpyHtoDAsync_v2", &driver.cuMemcpyHtoDAsync, &missing) &&
      Resolve(lib, "cuMemHostRegister_v2", &driver.cuMemHostRegister, &missing) &&
      Resolve(lib, "cuMemHostUnregister", &driver.cuMemHostUnregister, &missing) &&
      Resolve(lib, "cuStreamIsCapturing", &driver.cuStreamIsCapturing, &missing) &&
      Resolve(lib, "cuThreadExchangeStreamCaptureMode", &driver.cuThreadExchangeStreamCaptureMode,
              &missing);
  if (!ok) return Unavailable("CUDA driver lacks symbol " + missing);
  MEMOFFLOAD_RETURN_IF_ERROR(driver.Check(driver.cuInit(0), "cuInit"));
  int count = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(driver.Check(driver.cuDeviceGetCount(&count), "cuDeviceGetCount"));
  if (count == 0) return Unavailable("CUDA driver reports no device");
  return static_cast<const CudaDriver*>(&driver);
}

}  // namespace

Status CudaDriver::Check(CuResult result, const char* what) const {
  if (result == kCudaSuccess) return Status::Ok();
  const char* text = nullptr;
  if (cuGetErrorString != nullptr) cuGetErrorString(result, &text);
  return Unavailable(std::string(what) + " failed: " + (text ? text : "unknown CUDA error") + " (" +
                     std::to_string(result) + ")");
}

Result<const CudaDriver*> LoadCudaDriver() {
  static std::once_flag once;
  static Result<const CudaDriver*> loaded = Unavailable("not loaded");
  std::call_once(once, [] { loaded = LoadOnce(); });
  return loaded;
}

}  // namespace memoffload::torch
