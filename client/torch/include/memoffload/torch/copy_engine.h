// CopyEngine: moves bytes between tensor storages and the arena (host memory
// mapped from the daemon's chunks).
//
// Two engines exist: the host engine (memcpy, CPU storages) and the CUDA
// engine (driver API loaded with dlopen; dedicated D2H and H2D streams ordered
// with events against the trainer's stream). The GroupOffloader picks the
// engine by the storage's device.
//
// Threads: MarkReady runs on the training thread (it captures the point of the
// trainer's stream after which a storage's content is final). Everything else
// runs on the offloader's worker thread, and returns only when the copy is
// complete, so the caller may drop the source as soon as it returns.
#ifndef MEMOFFLOAD_TORCH_COPY_ENGINE_H_
#define MEMOFFLOAD_TORCH_COPY_ENGINE_H_

#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "memoffload/shared_mem/status.h"

namespace memoffload::torch {

// An opaque point on a device stream (the CUDA engine: a CUevent); 0 when
// the engine needs none.
using ReadyToken = uintptr_t;

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual const char* name() const = 0;
  virtual bool Handles(c10::Device device) const = 0;

  // Training thread: the storage's content is final once the work queued so
  // far on `stream` (a cudaStream_t as integer; 0 is the legacy default
  // stream) is done. The token must be passed to exactly one CopyOut or
  // DropToken.
  virtual Result<ReadyToken> MarkReady(c10::Device device, uintptr_t stream) = 0;
  virtual void DropToken(ReadyToken token) = 0;

  // Worker: copies `n` bytes from `src` (memory of `device`) into host `dst`
  // once `ready` is reached. Returns when the bytes are in `dst`; consumes
  // `ready`.
  virtual Status CopyOut(c10::Device device, const void* src, uint8_t* dst, size_t n,
                         ReadyToken ready) = 0;
  // Worker: copies `n` bytes from host `src` into `dst` (memory of `device`,
  // freshly allocated by the worker). Returns when the bytes are in `dst`.
  virtual Status CopyIn(c10::Device device, const uint8_t* src, void* dst, size_t n) = 0;

  // Worker: the host range [base, base + n) (one arena chunk) is about to be
  // used for copies. The CUDA engine registers it with the driver once per
  // process; a failure only makes copies slower, so it is logged, not returned.
  virtual void PrepareHostRange(uint8_t* base, size_t n) = 0;
};

// memcpy for CPU storages. Never fails to create.
std::unique_ptr<CopyEngine> MakeHostCopyEngine();

// CUDA storages through the driver API, CPU storages by memcpy. UNAVAILABLE
// when libcuda.so.1 cannot be loaded or there is no device.
Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine();

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_COPY_ENGINE_H_
