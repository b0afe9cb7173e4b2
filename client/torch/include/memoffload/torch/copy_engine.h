// CopyEngine: moves bytes between tensor storages and the arena (host memory
// mapped from the daemon's chunks).
//
// Two engines exist: the host engine (memcpy, CPU storages) and the CUDA
// engine (driver API loaded with dlopen; dedicated D2H and H2D streams ordered
// with events against the trainer's stream). The GroupOffloader picks the
// engine by the storage's device.
//
// Threads: MarkReady and WaitOnStream run on the training thread (they order
// the engine's streams against the trainer's). CopyOut runs on the
// offloader's worker thread and returns only when the copy is complete, so
// the caller may drop the source as soon as it returns. CopyIn only queues
// the copy back; FinishCopyIn's token tells when it is done, the consumer's
// stream waits on it, and the arena range is released only after it.
#ifndef MEMOFFLOAD_TORCH_COPY_ENGINE_H_
#define MEMOFFLOAD_TORCH_COPY_ENGINE_H_

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "memoffload/common/status.h"

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
  // DropToken. FAILED_PRECONDITION (and nothing recorded) while `stream` is
  // capturing a CUDA graph: the storage must stay where it is.
  virtual Result<ReadyToken> MarkReady(c10::Device device, uintptr_t stream) = 0;
  virtual void DropToken(ReadyToken token) = 0;

  // Worker: copies `n` bytes from `src` (memory of `device`) into host `dst`
  // once `ready` is reached. Returns when the bytes are in `dst`; consumes
  // `ready`.
  virtual Status CopyOut(c10::Device device, const void* src, uint8_t* dst, size_t n,
                         ReadyToken ready) = 0;
  // Worker (or a training thread, for a second backward): `n` bytes of
  // `device` memory (not CPU) for a copy back (CopyIn's `dst`). The CUDA
  // engine allocates them for its H2D stream, whatever the calling thread's
  // current stream: the caching allocator hands that stream only blocks
  // whose previous life is behind it in stream order (or recorded and done),
  // so the copy needs no wait on the trainer's streams and overlaps their
  // work. Dropping the memory while its copy is queued is safe for the same
  // reason: its block serves only later copies on that stream.
  virtual Result<c10::DataPtr> AllocateForCopyIn(c10::Device device, size_t n) = 0;
  // Training thread: work queued from now on on `stream` (the consumer's)
  // reads `data` (from AllocateForCopyIn): its block is not handed out again
  // before that work is done, whenever the storage dies.
  virtual Status RecordUse(c10::Device device, const c10::DataPtr& data, uintptr_t stream) = 0;
  // Worker (or a training thread, for a second backward): queues a copy of
  // `n` bytes from host `src` into `dst` (memory of `device` from
  // AllocateForCopyIn). The CUDA engine copies on its H2D stream; the bytes
  // are in `dst` once the token of the next FinishCopyIn is reached. The
  // host engine copies before returning.
  virtual Status CopyIn(c10::Device device, const uint8_t* src, void* dst, size_t n) = 0;
  // The point after every CopyIn queued so far for `device` (the CUDA
  // engine: an event recorded on its H2D stream); 0 when they are complete
  // already. The token must be passed to exactly one SyncAndDropToken or
  // DropToken.
  virtual Result<ReadyToken> FinishCopyIn(c10::Device device) = 0;
  // Training thread: work queued from now on on `stream` (a cudaStream_t as
  // integer; 0: legacy default) waits for `token`, without blocking the
  // thread. Does not consume the token.
  virtual Status WaitOnStream(ReadyToken token, uintptr_t stream) = 0;
  // Blocks until `token` is reached, then drops it (before the host memory a
  // copy reads is given back to the daemon).
  virtual void SyncAndDropToken(ReadyToken token) = 0;

  // Worker: the host range [base, base + n) (one arena chunk, mapped by the
  // session `owner`) is about to be used for copies. The CUDA engine
  // registers it with the driver once per mapping; a failure only makes
  // copies slower, so it is logged, not returned.
  virtual void PrepareHostRange(const void* owner, uint8_t* base, size_t n) = 0;
  // Bytes of the ranges prepared (and not forgotten) that are not registered
  // with the driver: copies through them are pageable. Any thread; never
  // waits for a registration in progress.
  virtual uint64_t UnpinnedHostBytes() const = 0;
  // The mappings of `owner` are about to be unmapped: unregisters every range
  // registered for it, so that a later mapping at the same address (a new
  // session after a reconnect) is registered afresh. Any thread.
  virtual void ForgetHostRanges(const void* owner) = 0;
};

// Device memory as torch's CUDA caching allocator hands it out: a trainer's
// CUDA engine uses torch's (MakeTorchDeviceAllocator); a test supplies its
// own over the simulated driver. Any thread.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  // `n` bytes of `device` memory for work queued on `stream` (a cudaStream_t
  // as integer; 0: legacy default). As torch's caching allocator: a block
  // freed is handed out again for the stream it was allocated for at once
  // (that stream's order protects its previous life), and for no other
  // stream; a block whose uses on other streams were recorded
  // (RecordStream) waits until that work is done.
  virtual Result<c10::DataPtr> Allocate(c10::Device device, size_t n, uintptr_t stream) = 0;
  // Work queued from now on on `stream` uses `data` (from Allocate; torch's
  // recordStream).
  virtual Status RecordStream(const c10::DataPtr& data, uintptr_t stream) = 0;
};

// torch's allocator for the device type, reached through c10 (no link-time
// CUDA dependency): INTERNAL from Allocate when torch has no CUDA support.
std::unique_ptr<DeviceAllocator> MakeTorchDeviceAllocator();

// memcpy for CPU storages. Never fails to create.
std::unique_ptr<CopyEngine> MakeHostCopyEngine();

// CUDA storages through the driver API, CPU storages by memcpy. UNAVAILABLE
// when libcuda.so.1 cannot be loaded or there is no device.
// `allocator` gives the memory of restored storages (null: torch's).
Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine(
    std::unique_ptr<DeviceAllocator> allocator = nullptr);

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_COPY_ENGINE_H_
