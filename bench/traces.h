// Allocation traces for the allocator benchmark: seeded, deterministic
// sequences of reserve/release events sized like real activation offload.
//
// Every trace is generated until the bytes it holds live exceed the arena
// capacity, so any allocator replaying it must fail at some request; the
// benchmark measures how full the arena was at that first failure.
#ifndef MEMOFFLOAD_BENCH_TRACES_H_
#define MEMOFFLOAD_BENCH_TRACES_H_

#include <cstdint>
#include <string>
#include <vector>

namespace memoffload::bench {

struct TraceEvent {
  enum class Kind : uint8_t { kReserve, kRelease };
  Kind kind = Kind::kReserve;
  // Request id, dense from 0 in reserve order; a release names an earlier
  // reserve and every id is released at most once.
  uint32_t id = 0;
  uint64_t bytes = 0;  // requested size (reserve only)
  // Who asks (reserve only): the rank on the llama traces, id % 8 on random.
  // The restricted replay treats each as a tenant owning its own chunks.
  uint8_t tenant = 0;
};

// Tenants (ranks) per trace.
inline constexpr uint32_t kTraceTenants = 8;

struct Trace {
  std::string name;
  uint64_t capacity_bytes = 0;  // arena the trace is meant to fill
  uint64_t chunk_bytes = 0;     // chunk size of that arena
  uint64_t page_bytes = 4096;
  uint32_t reserve_count = 0;
  std::vector<TraceEvent> events;
};

// Decoder-only transformer with SwiGLU MLP and grouped-query attention.
struct ModelShape {
  uint64_t hidden = 0;
  uint64_t intermediate = 0;
  uint64_t heads = 0;
  uint64_t kv_heads = 0;
  uint64_t layers = 0;
  uint64_t tensor_parallel = 1;  // sharded tensors are divided by this
};

// Bytes one layer saves for backward for `tokens` tokens on one rank, in
// bf16 (2 bytes) except the fp32 softmax log-sum-exp:
//   2 * tokens * (4*hidden                        norm inputs and outputs
//                 + (2*heads + 2*kv_heads) * head_dim / tp    q, k, v, o
//                 + 3 * intermediate / tp)        gate, up, silu(gate)*up
//   + 4 * tokens * heads / tp                     log-sum-exp
// with head_dim = hidden / heads and no sequence parallelism.
uint64_t LayerActivationBytes(const ModelShape& shape, uint64_t tokens);

// Llama-2-7B (32 layers, hidden 4096, intermediate 11008, 32 heads), eight
// data-parallel ranks, each with its own sequence lengths; 512 GiB arena.
// The microbatch schedule is described in traces.cc (MakeLlamaTrace).
Trace MakeLlama7bTrace(uint64_t seed);
// Llama-2-70B (80 layers, hidden 8192, intermediate 28672, 64 heads, 8 kv
// heads) sharded over eight tensor-parallel ranks, which all see the same
// sequence lengths; 768 GiB arena.
Trace MakeLlama70bTp8Trace(uint64_t seed);
// Log-uniform sizes from 4 KiB to 256 MiB; before each reserve, with
// probability 0.3 a uniformly chosen live request is released; 64 GiB arena.
// All arenas use 1 GiB chunks and 4 KiB pages.
Trace MakeRandomTrace(uint64_t seed);

// All traces in reporting order: llama-7b, llama-70b-tp8, random.
std::vector<Trace> MakeAllTraces(uint64_t seed);

}  // namespace memoffload::bench

#endif  // MEMOFFLOAD_BENCH_TRACES_H_
