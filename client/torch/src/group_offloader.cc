#include "memoffload/torch/group_offloader.h"

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "group_offloader_impl.h"
#include "tensor_packing.h"

namespace memoffload::torch {
namespace {

std::unique_ptr<CopyEngine> MaybeCudaEngine(const OffloaderOptions& options) {
  if (!options.use_cuda) return nullptr;
  Result<std::unique_ptr<CopyEngine>> cuda = MakeCudaCopyEngine();
  if (!cuda.ok()) return nullptr;
  return std::move(cuda).value();
}

}  // namespace

GroupOffloader::Impl::Impl(const OffloaderOptions& options)
    : host_engine_(MakeHostCopyEngine()),
      cuda_engine_(MaybeCudaEngine(options)),
      link_(options, /*pinning_engine=*/cuda_engine_.get(), &stats_),
      transfer_(&link_, &stats_, cuda_engine_.get(), &mu_) {
  stats_.Count([this](OffloaderStats& s) { s.engine = cuda_engine_ ? "cuda" : "host"; });
}

GroupOffloader::Impl::~Impl() {
  std::vector<std::shared_ptr<Group>> groups;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, g] : groups_) groups.push_back(g);
    groups_.clear();
  }
  for (auto& g : groups) PostRelease(g);
  worker_.Flush();
  sink_->Close();
}

void GroupOffloader::Impl::AttachNow() {
  stats_.Count([](OffloaderStats& s) { ++s.blocking_rpcs; });
  worker_.Post([this] { link_.Ensure(/*force=*/true); });
  worker_.Flush();
}

Status GroupOffloader::Impl::BeginGroup(uint64_t key, int64_t slot, bool arena_views_allowed) {
  auto g = std::make_shared<Group>();
  g->key = key;
  g->slot = slot;
  g->arena_views_allowed = arena_views_allowed;
  g->prefetched = g->prefetch_promise.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (groups_.count(key) != 0) {
      return InvalidArgument("group key " + std::to_string(key) + " is already in use");
    }
    g->daemon_id = ++next_daemon_id_;
    if (slot >= 0) {
      auto it = learned_bytes_.find(slot);
      if (it != learned_bytes_.end()) g->planned_bytes = it->second;
    }
    groups_[key] = g;
  }
  stats_.CountWithSlot(slot, [](OffloaderStats& s, SlotStats& slot_stats) {
    ++s.groups;
    ++s.groups_live;
    ++slot_stats.groups;
    ++slot_stats.groups_live;
  });
  if (g->planned_bytes > 0) {
    const uint64_t bytes = g->planned_bytes;
    worker_.Post([this, g, bytes] { transfer_.Reserve(*g, bytes); });
  }
  return Status::Ok();
}

Result<int64_t> GroupOffloader::Impl::Add(uint64_t key, const at::Tensor& tensor,
                                          uintptr_t stream) {
  MEMOFFLOAD_RETURN_IF_ERROR(CheckPackable(tensor));
  CopyEngine* engine = EngineFor(tensor.device());  // null: kept in memory
  std::shared_ptr<Group> g;
  Packed packed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(key);
    if (it == groups_.end() || !it->second->open) {
      return FailedPrecondition("group " + std::to_string(key) + " is not open");
    }
    g = it->second;
    Result<Packed> added = PackLocked(*g, tensor, engine, stream);
    if (!added.ok()) return added.status();
    packed = std::move(added).value();
  }
  // Counted in skipped_bytes when the group closes, like any storage that
  // did not make it into the arena.
  if (!packed.kept.ok()) NoteKept(packed.kept);
  // The engine's MarkReady contract: FAILED_PRECONDITION is a stream that
  // is capturing a CUDA graph.
  const bool capturing = packed.kept.code() == StatusCode::kFailedPrecondition;
  bool copied_here = false;
  if (std::shared_ptr<StoredStorage> s = packed.copy_now) {
    // CPU: one memcpy on this thread, like a clone, instead of waking the
    // worker for every tensor; before the reservation is in place, Close
    // copies it (the source is held until Commit either way). A device
    // storage's copy starts now, on the engine's stream.
    copied_here = CopyOutInline(*g, *s);
    if (!copied_here && !s->device.is_cpu()) {
      worker_.Post([this, g, s] { transfer_.CopyOut(*g, *s); });
    }
  }
  stats_.CountTensor(packed.dedup, copied_here, capturing);
  return packed.index;
}

Status GroupOffloader::Impl::CloseGroup(uint64_t key) {
  std::shared_ptr<Group> g;
  bool release = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(key);
    if (it == groups_.end() || !it->second->open) {
      return FailedPrecondition("group " + std::to_string(key) + " is not open");
    }
    g = it->second;
    g->open = false;
    g->by_impl.clear();
    if (g->slot >= 0 && g->bump > 0) learned_bytes_[g->slot] = AlignUp(g->bump, kAlignBytes);
    // A BeginGroup group goes with its last entry; one without a live
    // entry (every saved tensor stayed in place, or was dropped while the
    // group was open) has none left to drop: it goes now (else it stayed
    // in groups_ for good). OffloadGroup's wait for the caller's
    // ReleaseGroup.
    if (g->arena_views_allowed && g->live == 0) {
      release = true;
      groups_.erase(it);
    }
  }
  worker_.Post([this, g] { transfer_.Close(*g); });
  if (release) PostRelease(g);
  return Status::Ok();
}

CopyEngine* GroupOffloader::Impl::EngineFor(c10::Device device) {
  if (device.is_cpu()) return host_engine_.get();
  if (cuda_engine_ && cuda_engine_->Handles(device)) return cuda_engine_.get();
  return nullptr;
}

void GroupOffloader::Impl::NoteKept(const Status& why) {
  const std::string reason = "kept in memory: " + why.message();  // the code: last_skip_code
  stats_.Count([&reason, &why](OffloaderStats& s) {
    s.last_skip_reason = reason;
    s.last_skip_code = why.code();
  });
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = logged_kept_.insert(why.message()).second;
  }
  if (first) {
    client::Log(client::LogLevel::kWarning, why.code(),
                "a saved tensor stays where it is (" + why.ToString() +
                    "); training goes on (logged once)");
  }
}

std::shared_ptr<GroupOffloader> GroupOffloader::Create(const OffloaderOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  impl->AttachNow();
  return std::shared_ptr<GroupOffloader>(new GroupOffloader(std::move(impl)));
}

GroupOffloader::GroupOffloader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GroupOffloader::~GroupOffloader() = default;

Status GroupOffloader::BeginGroup(uint64_t key, int64_t slot) {
  return impl_->BeginGroup(key, slot);
}
Result<int64_t> GroupOffloader::Add(uint64_t key, const at::Tensor& tensor, uintptr_t stream) {
  return impl_->Add(key, tensor, stream);
}
Status GroupOffloader::CloseGroup(uint64_t key) { return impl_->CloseGroup(key); }
void GroupOffloader::PrefetchGroup(uint64_t key) { impl_->PrefetchGroup(key); }
Result<at::Tensor> GroupOffloader::Get(uint64_t key, int64_t entry, uintptr_t stream) {
  return impl_->Get(key, entry, stream);
}
Status GroupOffloader::DropEntry(uint64_t key, int64_t entry) {
  return impl_->DropEntry(key, entry);
}
void GroupOffloader::ReleaseGroup(uint64_t key) { impl_->ReleaseGroup(key); }
bool GroupOffloader::WouldNotWait(uint64_t key) { return impl_->WouldNotWait(key); }
std::optional<Result<at::Tensor>> GroupOffloader::GetIfReady(uint64_t key, int64_t entry) {
  return impl_->GetIfReady(key, entry);
}

Status GroupOffloader::OffloadGroup(uint64_t key, const std::vector<at::Tensor>& tensors,
                                    uintptr_t stream, int64_t slot) {
  MEMOFFLOAD_RETURN_IF_ERROR(impl_->BeginGroup(key, slot, /*arena_views_allowed=*/false));
  for (const at::Tensor& t : tensors) {
    Result<int64_t> added = impl_->Add(key, t, stream);
    if (!added.ok()) {
      impl_->ReleaseGroup(key);
      return added.status();
    }
  }
  return impl_->CloseGroup(key);
}

Result<std::vector<at::Tensor>> GroupOffloader::GetGroup(uint64_t key, uintptr_t stream) {
  return impl_->GetGroup(key, stream);
}
void GroupOffloader::Flush() { impl_->Flush(); }
OffloaderStats GroupOffloader::stats() const { return impl_->stats(); }
SlotStats GroupOffloader::slot_stats(int64_t first_slot, int64_t end_slot) const {
  return impl_->slot_stats(first_slot, end_slot);
}
uint64_t GroupOffloader::TakeArenaHeldPeak() { return impl_->TakeArenaHeldPeak(); }

}  // namespace memoffload::torch
