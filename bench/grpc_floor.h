// The plain gRPC floor for memoffload-bench load --baseline: a trivial unary
// service (GetStatus answered at once, nothing else) on its own Unix socket,
// and a worker that calls it in a loop. What memoffloadd adds to a request is
// its latency over this floor, measured in the same run with the same clients.
#ifndef MEMOFFLOAD_BENCH_GRPC_FLOOR_H_
#define MEMOFFLOAD_BENCH_GRPC_FLOOR_H_

#include <memory>
#include <string>

#include "memoffload/common/status.h"

namespace memoffload::bench {

// Serves the floor service from a private temporary directory until
// destroyed (then removes the socket and the directory).
class GrpcFloorServer {
 public:
  static Result<std::unique_ptr<GrpcFloorServer>> Start();
  ~GrpcFloorServer();
  const std::string& socket_path() const { return socket_path_; }

 private:
  class Impl;
  GrpcFloorServer() = default;
  std::unique_ptr<Impl> impl_;
  std::string dir_;
  std::string socket_path_;
};

struct LoadOptions;

// Worker side: waits for "go" on stdin after printing READY, calls the floor
// at o.floor_socket for o.seconds, and reports as method 0 in the load
// bench's line format. With o.floor_copies each client also does the load
// worker's copies between its calls: per cycle, the same group sizes (same
// seed), written into a private pre-faulted buffer between two calls and,
// o.window groups later, read back and compared between two more. The
// ratio to that floor leaves out what the copies cost on a saturated
// machine, and how their uneven bursts spread the clients' turns.
int RunGrpcFloorWorker(const LoadOptions& o);

}  // namespace memoffload::bench

#endif  // MEMOFFLOAD_BENCH_GRPC_FLOOR_H_
