// PrepareChunk: registers the arena chunk an extent of `client` lands in
// with a CUDA engine, at the chunk's own size from the attach reply (the
// last chunk may be smaller). The engine registers each mapping's range
// once, so calling this for every extent costs a lookup. False when the
// attach reply has no size or mapping for the chunk (a daemon bug): copies
// through it stay pageable.
#ifndef MEMOFFLOAD_TORCH_SRC_CHUNK_PINNING_H_
#define MEMOFFLOAD_TORCH_SRC_CHUNK_PINNING_H_

#include <cstdint>

#include "memoffload/client/client.h"
#include "memoffload/torch/copy_engine.h"

namespace memoffload::torch {

inline bool PrepareChunk(CopyEngine* engine, const client::Client& client, uint32_t chunk) {
  const uint64_t chunk_bytes = client.chunk_size_bytes(chunk);
  uint8_t* base = chunk_bytes > 0 ? client.Address(Extent{chunk, 0, chunk_bytes}) : nullptr;
  if (base == nullptr) return false;
  engine->PrepareHostRange(&client, base, chunk_bytes);
  return true;
}

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_CHUNK_PINNING_H_
