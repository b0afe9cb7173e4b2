#include "traces.h"

#include <cmath>
#include <utility>

namespace memoffload::bench {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kRanks = 8;
constexpr uint64_t kMinTokens = 512;
constexpr uint64_t kMaxTokens = 8192;
constexpr uint64_t kTokenStep = 128;
// The llama traces keep one more microbatch in flight every this many
// microbatches.
constexpr uint64_t kMicrobatchesPerWindowStep = 8;

// SplitMix64: small, fast, and the same sequence on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n).
  uint64_t Below(uint64_t n) { return Next() % n; }
  // Uniform in [0, 1).
  double Unit() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

uint64_t RandomTokens(Rng& rng) {
  return kMinTokens + kTokenStep * rng.Below((kMaxTokens - kMinTokens) / kTokenStep + 1);
}

// Appends events and tracks live bytes so generation can stop once the
// trace holds more than the arena.
class TraceBuilder {
 public:
  explicit TraceBuilder(Trace* trace) : trace_(trace) {}
  uint32_t Reserve(uint64_t bytes, uint32_t tenant) {
    const uint32_t id = trace_->reserve_count++;
    trace_->events.push_back(
        {TraceEvent::Kind::kReserve, id, bytes, static_cast<uint8_t>(tenant % kTraceTenants)});
    live_bytes_ += bytes;
    sizes_.push_back(bytes);
    return id;
  }
  void Release(uint32_t id) {
    trace_->events.push_back({TraceEvent::Kind::kRelease, id, 0, 0});
    live_bytes_ -= sizes_[id];
  }
  bool Overfull() const { return live_bytes_ > trace_->capacity_bytes; }

 private:
  Trace* trace_;
  uint64_t live_bytes_ = 0;
  std::vector<uint64_t> sizes_;
};

// One-forward-one-backward schedule with a growing window: microbatch k
// runs its forward (every layer 0..L-1, the ranks' reserves interleaved
// round robin within a layer), then the oldest microbatches run their
// backward (layers L-1..0, releases interleaved the same way) until at most
// 1 + k / kMicrobatchesPerWindowStep stay in flight. Releases of one
// microbatch leave holes sized by its sequence lengths, which the next
// forward, with other lengths, has to pack into.
Trace MakeLlamaTrace(const char* name, const ModelShape& shape, bool ranks_share_tokens,
                     uint64_t capacity_bytes, uint64_t seed) {
  Trace trace;
  trace.name = name;
  trace.capacity_bytes = capacity_bytes;
  trace.chunk_bytes = kGiB;
  TraceBuilder builder(&trace);
  Rng rng(seed);
  // in_flight[i][l * kRanks + r]: reserve id of layer l on rank r.
  std::vector<std::vector<uint32_t>> in_flight;
  for (uint64_t k = 0; !builder.Overfull(); ++k) {
    uint64_t tokens[kRanks];
    const uint64_t shared = RandomTokens(rng);
    for (uint64_t r = 0; r < kRanks; ++r) {
      tokens[r] = ranks_share_tokens ? shared : RandomTokens(rng);
    }
    std::vector<uint32_t> ids;
    for (uint64_t l = 0; l < shape.layers && !builder.Overfull(); ++l) {
      for (uint64_t r = 0; r < kRanks; ++r) {
        ids.push_back(
            builder.Reserve(LayerActivationBytes(shape, tokens[r]), static_cast<uint32_t>(r)));
      }
    }
    in_flight.push_back(std::move(ids));
    const uint64_t window = 1 + k / kMicrobatchesPerWindowStep;
    while (!builder.Overfull() && in_flight.size() > window) {
      const std::vector<uint32_t>& oldest = in_flight.front();
      for (size_t i = oldest.size(); i-- > 0;) builder.Release(oldest[i]);
      in_flight.erase(in_flight.begin());
    }
  }
  return trace;
}

}  // namespace

uint64_t LayerActivationBytes(const ModelShape& shape, uint64_t tokens) {
  const uint64_t tp = shape.tensor_parallel;
  const uint64_t head_dim = shape.hidden / shape.heads;
  const uint64_t elements_per_token = 4 * shape.hidden +
                                      (2 * shape.heads + 2 * shape.kv_heads) * head_dim / tp +
                                      3 * shape.intermediate / tp;
  return 2 * tokens * elements_per_token + 4 * tokens * shape.heads / tp;
}

Trace MakeLlama7bTrace(uint64_t seed) {
  const ModelShape shape{4096, 11008, 32, 32, 32, 1};
  return MakeLlamaTrace("llama-7b", shape, /*ranks_share_tokens=*/false, 512 * kGiB, seed ^ 0x7B);
}

Trace MakeLlama70bTp8Trace(uint64_t seed) {
  const ModelShape shape{8192, 28672, 64, 8, 80, 8};
  return MakeLlamaTrace("llama-70b-tp8", shape, /*ranks_share_tokens=*/true, 768 * kGiB,
                        seed ^ 0x70B);
}

Trace MakeRandomTrace(uint64_t seed) {
  Trace trace;
  trace.name = "random";
  trace.capacity_bytes = 64 * kGiB;
  trace.chunk_bytes = kGiB;
  TraceBuilder builder(&trace);
  Rng rng(seed ^ 0x5EED);
  const double log_min = std::log(4096.0);
  const double log_max = std::log(256.0 * 1024 * 1024);
  std::vector<uint32_t> live;
  while (!builder.Overfull()) {
    if (!live.empty() && rng.Unit() < 0.3) {
      const size_t k = rng.Below(live.size());
      builder.Release(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
    const double log_bytes = log_min + rng.Unit() * (log_max - log_min);
    const uint64_t bytes = static_cast<uint64_t>(std::llround(std::exp(log_bytes)));
    live.push_back(builder.Reserve(bytes, trace.reserve_count % kTraceTenants));
  }
  return trace;
}

std::vector<Trace> MakeAllTraces(uint64_t seed) {
  std::vector<Trace> traces;
  traces.push_back(MakeLlama7bTrace(seed));
  traces.push_back(MakeLlama70bTp8Trace(seed));
  traces.push_back(MakeRandomTrace(seed));
  return traces;
}

}  // namespace memoffload::bench
