// torch's caching allocator as the CUDA engine's DeviceAllocator, reached
// through c10's registries: the device guard of the device type (current
// device and stream, recordStream) and the allocator registered for it.
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <exception>
#include <string>

#include "memoffload/torch/copy_engine.h"

namespace memoffload::torch {
namespace {

// A cudaStream_t as a c10 stream: torch names an external stream by its
// pointer (c10::cuda::getStreamFromExternal), the legacy stream by id 0.
c10::Stream StreamOf(c10::Device device, uintptr_t stream) {
  return c10::Stream(c10::Stream::UNSAFE, device, static_cast<c10::StreamId>(stream));
}

class TorchDeviceAllocator final : public DeviceAllocator {
 public:
  Result<c10::DataPtr> Allocate(c10::Device device, size_t n, uintptr_t stream) override {
    try {
      const c10::impl::DeviceGuardImplInterface* guard =
          c10::impl::getDeviceGuardImpl(device.type());
      // The allocator serves the current stream of the current device: make
      // them the wanted ones for the call, then put them back.
      const c10::Device previous_device = guard->exchangeDevice(device);
      const c10::Stream previous_stream = guard->exchangeStream(StreamOf(device, stream));
      c10::DataPtr data;
      std::string failure;
      try {
        data = c10::GetAllocator(device.type())->allocate(n);
      } catch (const std::exception& ex) {
        failure = ex.what();
      }
      guard->exchangeStream(previous_stream);
      guard->uncheckedSetDevice(previous_device);
      if (!failure.empty())
        return Internal("allocating " + std::to_string(n) + " bytes failed: " + failure);
      return data;
    } catch (const std::exception& ex) {
      return Internal(std::string("allocating device memory for a copy back failed: ") + ex.what());
    }
  }

  Status RecordStream(const c10::DataPtr& data, uintptr_t stream) override {
    try {
      c10::impl::getDeviceGuardImpl(data.device().type())
          ->recordDataPtrOnStream(data, StreamOf(data.device(), stream));
      return Status::Ok();
    } catch (const std::exception& ex) {
      return Internal(std::string("recording a stream's use of a restored storage failed: ") +
                      ex.what());
    }
  }
};

}  // namespace

std::unique_ptr<DeviceAllocator> MakeTorchDeviceAllocator() {
  return std::make_unique<TorchDeviceAllocator>();
}

}  // namespace memoffload::torch
