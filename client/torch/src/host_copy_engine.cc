// The host copy engine: CPU storages, plain memcpy on the worker thread.
#include <cstring>

#include "memoffload/torch/copy_engine.h"

namespace memoffload::torch {
namespace {

class HostCopyEngine final : public CopyEngine {
 public:
  const char* name() const override { return "host"; }
  bool Handles(c10::Device device) const override { return device.is_cpu(); }
  Result<ReadyToken> MarkReady(c10::Device, uintptr_t) override { return ReadyToken{0}; }
  void DropToken(ReadyToken) override {}
  Status CopyOut(c10::Device, const void* src, uint8_t* dst, size_t n, ReadyToken) override {
    if (n != 0) std::memcpy(dst, src, n);
    return Status::Ok();
  }
  Result<c10::DataPtr> AllocateForCopyIn(c10::Device device, size_t) override {
    return InvalidArgument("the host engine restores CPU storages only, not " + device.str());
  }
  Status RecordUse(c10::Device, const c10::DataPtr&, uintptr_t) override { return Status::Ok(); }
  Status CopyIn(c10::Device, const uint8_t* src, void* dst, size_t n) override {
    if (n != 0) std::memcpy(dst, src, n);
    return Status::Ok();
  }
  Result<ReadyToken> FinishCopyIn(c10::Device) override { return ReadyToken{0}; }
  Status WaitOnStream(ReadyToken, uintptr_t) override { return Status::Ok(); }
  void SyncAndDropToken(ReadyToken) override {}
  void PrepareHostRange(const void*, uint8_t*, size_t) override {}
  uint64_t UnpinnedHostBytes() const override { return 0; }
  void ForgetHostRanges(const void*) override {}
};

}  // namespace

std::unique_ptr<CopyEngine> MakeHostCopyEngine() { return std::make_unique<HostCopyEngine>(); }

}  // namespace memoffload::torch
