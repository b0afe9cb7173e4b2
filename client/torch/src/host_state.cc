#include "host_state.h"

#include <string>
#include <utility>

#include "chunk_pinning.h"
#include "memoffload/client/log.h"

namespace memoffload::torch {

Result<std::shared_ptr<HostStateStore>> HostStateStore::Attach(const client::AttachOptions& options,
                                                               bool use_cuda) {
  std::shared_ptr<CopyEngine> engine;
  if (use_cuda) {
    Result<std::unique_ptr<CopyEngine>> cuda = MakeCudaCopyEngine();
    if (cuda.ok()) engine = std::move(cuda).value();
  }
  Result<std::unique_ptr<client::Client>> attached = client::Client::Attach(options);
  if (!attached.ok()) return attached.status();
  // The chunks' CUDA registrations go before the mapping does (the last
  // holder of the client is the last tensor's block, or the store).
  std::shared_ptr<client::Client> client(std::move(attached).value().release(),
                                         [engine](client::Client* c) {
                                           if (engine != nullptr) engine->ForgetHostRanges(c);
                                           delete c;
                                         });
  return std::shared_ptr<HostStateStore>(
      new HostStateStore(std::make_shared<client::HostBlocks>(std::move(client)), engine));
}

HostStateStore::HostStateStore(std::shared_ptr<client::HostBlocks> blocks,
                               std::shared_ptr<CopyEngine> engine)
    : blocks_(std::move(blocks)), engine_(std::move(engine)) {}

std::string HostStateStore::MoveReason() const {
  const client::Client& c = *blocks_->client();
  if (c.session_lost()) {
    return "memoffloadd ended session " + std::to_string(c.session_id()) +
           " (it restarted, stopped or dropped the connection)";
  }
  if (c.leave_requested()) return c.leave_message();
  return "";
}

uint64_t HostStateStore::unpinned_bytes() const {
  return engine_ == nullptr ? 0 : engine_->UnpinnedHostBytes();
}

Result<at::Tensor> HostStateStore::Empty(uint64_t nbytes) {
  Result<client::HostBlock> block = blocks_->Allocate(nbytes);
  if (!block.ok()) return block.status();
  if (engine_ != nullptr) PrepareChunk(engine_.get(), *blocks_->client(), block->chunk);
  std::shared_ptr<client::HostBlocks> blocks = blocks_;
  const uint64_t group = block->group_id;
  auto give_back = [blocks, group](void*) {
    if (Status st = blocks->Free(group); !st.ok()) {
      client::Log(client::LogLevel::kWarning, st.code(),
                  "giving a state tensor's arena block back failed: " + st.message() +
                      " (the daemon frees it when this process ends)");
    }
  };
  try {
    return at::from_blob(block->address, {static_cast<int64_t>(nbytes)}, give_back,
                         at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  } catch (const std::exception& e) {
    give_back(nullptr);
    return Internal(std::string("wrapping an arena block as a tensor: ") + e.what());
  }
}

}  // namespace memoffload::torch
