// Attach latency next to a raw Unix-socket floor (attach_latency.cc).
#ifndef MEMOFFLOAD_BENCH_ATTACH_LATENCY_H_
#define MEMOFFLOAD_BENCH_ATTACH_LATENCY_H_

#include <string>

#include "memoffload/client/client.h"

namespace memoffload::bench {

struct AttachLatency {
  int samples = 0;
  double p50_ms = 0;  // connect to the first writable extent
  double p99_ms = 0;
  double call_p50_ms = 0;   // of which Client::Attach returned (the rest: Reserve, mapping)
  double floor_p50_ms = 0;  // raw Unix-socket connect + sendmsg + reply with an fd
  double floor_p99_ms = 0;
};

// `samples` interleaved pairs; the floor's socket lives in scratch_dir.
Result<AttachLatency> MeasureAttachLatency(const client::AttachOptions& options,
                                           const std::string& scratch_dir, int samples);

}  // namespace memoffload::bench

#endif  // MEMOFFLOAD_BENCH_ATTACH_LATENCY_H_
