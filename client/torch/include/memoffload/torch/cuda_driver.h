// CudaDriver: the few CUDA driver API entry points memoffload uses, resolved
// at run time with dlopen("libcuda.so.1").
//
// There is no link-time CUDA dependency and no CUDA header is needed: the
// types and prototypes below are declared here, with the driver's ABI (all
// handles are opaque pointers, results are int, sizes are size_t). On a
// machine without the driver Load() fails with UNAVAILABLE and callers fall
// back to the host copy engine.
#ifndef MEMOFFLOAD_TORCH_CUDA_DRIVER_H_
#define MEMOFFLOAD_TORCH_CUDA_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "memoffload/common/status.h"

namespace memoffload::torch {

// Opaque driver handles, ABI-compatible with CUcontext, CUstream, CUevent.
using CuResult = int;
using CuDevice = int;
using CuContext = struct CuContextOpaque*;
using CuStream = struct CuStreamOpaque*;
using CuEvent = struct CuEventOpaque*;
using CuDevicePtr = unsigned long long;  // NOLINT: the driver's CUdeviceptr

inline constexpr CuResult kCudaSuccess = 0;
inline constexpr CuResult kCudaErrorInvalidContext = 201;
inline constexpr CuResult kCudaErrorNotReady = 600;
inline constexpr CuResult kCudaErrorHostMemoryAlreadyRegistered = 712;
inline constexpr unsigned kCuStreamNonBlocking = 0x1;
inline constexpr unsigned kCuEventDisableTiming = 0x2;
inline constexpr unsigned kCuMemHostRegisterPortable = 0x1;
inline constexpr int kCuStreamCaptureStatusNone = 0;
inline constexpr int kCuStreamCaptureModeRelaxed = 2;

// Function table filled by Load(). Members are null until then.
struct CudaDriver {
  CuResult (*cuInit)(unsigned) = nullptr;
  CuResult (*cuGetErrorString)(CuResult, const char**) = nullptr;
  CuResult (*cuDeviceGetCount)(int*) = nullptr;
  CuResult (*cuDeviceGet)(CuDevice*, int) = nullptr;
  CuResult (*cuDevicePrimaryCtxRetain)(CuContext*, CuDevice) = nullptr;
  CuResult (*cuCtxSetCurrent)(CuContext) = nullptr;
  CuResult (*cuCtxGetCurrent)(CuContext*) = nullptr;
  CuResult (*cuStreamCreate)(CuStream*, unsigned) = nullptr;
  CuResult (*cuStreamSynchronize)(CuStream) = nullptr;
  CuResult (*cuStreamWaitEvent)(CuStream, CuEvent, unsigned) = nullptr;
  CuResult (*cuEventCreate)(CuEvent*, unsigned) = nullptr;
  CuResult (*cuEventRecord)(CuEvent, CuStream) = nullptr;
  CuResult (*cuEventSynchronize)(CuEvent) = nullptr;
  CuResult (*cuEventDestroy)(CuEvent) = nullptr;
  CuResult (*cuMemcpyDtoHAsync)(void*, CuDevicePtr, size_t, CuStream) = nullptr;
  CuResult (*cuMemcpyHtoDAsync)(CuDevicePtr, const void*, size_t, CuStream) = nullptr;
  CuResult (*cuMemHostRegister)(void*, size_t, unsigned) = nullptr;
  CuResult (*cuMemHostUnregister)(void*) = nullptr;
  CuResult (*cuStreamIsCapturing)(CuStream, int*) = nullptr;  // *status: kCuStreamCaptureStatus*
  CuResult (*cuThreadExchangeStreamCaptureMode)(int*) = nullptr;

  // "cuFoo failed: CUDA_ERROR_... (code)"; kOk for kCudaSuccess.
  Status Check(CuResult result, const char* what) const;
};

// The process-wide driver table, loaded on first call. UNAVAILABLE (with the
// dlerror text) when libcuda.so.1 or one of the symbols is missing, or when
// cuInit fails (no device). Thread-safe.
Result<const CudaDriver*> LoadCudaDriver();

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_CUDA_DRIVER_H_
