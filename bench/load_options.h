// memoffload-bench load: the options shared by the parent (load_bench.cc)
// and its client processes (load_worker.cc).
#ifndef MEMOFFLOAD_BENCH_LOAD_OPTIONS_H_
#define MEMOFFLOAD_BENCH_LOAD_OPTIONS_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace memoffload::bench {

inline constexpr int kMethods = 4;
inline constexpr const char* kMethodNames[kMethods] = {"Reserve", "Commit", "Prefetch", "Release"};
enum MethodIndex { kReserve, kCommit, kPrefetch, kRelease };

struct LoadOptions {
  std::string runtime_dir;
  int clients = 4;
  double seconds = 5;
  bool json = false;
  uint64_t max_bytes = 0;
  uint64_t min_group = 4096;
  uint64_t max_group = 4 << 20;
  int window = 4;
  std::string job_id = "memoffload-bench-load";
  uint64_t seed = 1;
  bool baseline = false;
  std::string floor_socket;  // worker side: call the floor service here
  int index = 0;             // worker only
  int pairs = 1;             // parent: (daemon, floor) pairs with --baseline
  // The chunks are first claimed for the bench's tenant and every client
  // maps and populates them at attach (untimed), as in a trainer that ran
  // for a while. Without it, each client fills its page tables on first
  // use, inside the timed window. (It lowers the clients' CPU per call at
  // 256 clients but not the p99 ratio: docs/history/request_path.md.)
  bool warm = false;
  // The floor's clients do the load worker's copies between their calls
  // (grpc_floor.h).
  bool floor_copies = false;
  // The load's clients copy nothing: Reserve, Commit, Prefetch and Release
  // with the same sizes, but no write into the arena, read back or verify.
  // What is left is the request path alone, which the plain floor
  // measures the trivial counterpart of (docs/request_path.md).
  bool no_copies = false;
};

// Bytes of group g are source[offset(g) .. offset(g) + bytes): every group has
// distinct contents without generating data on the hot path.
inline constexpr uint64_t kShiftSpan = 65536;
inline uint64_t SourceOffset(uint64_t group_id) { return (group_id * 4099) % kShiftSpan; }

// A worker's data and group sizes, the same for the load worker and the
// --floor-copies floor worker of one index and seed: max_group + kShiftSpan
// random bytes (group g's start at SourceOffset(g)) and sizes log-uniform in
// [min_group, max_group].
class WorkerData {
 public:
  explicit WorkerData(const LoadOptions& o);
  uint64_t NextSize();
  const uint8_t* BytesOf(uint64_t group_id) const {
    return source_.data() + SourceOffset(group_id);
  }

 private:
  uint64_t max_group_;
  std::mt19937_64 rng_;
  std::vector<uint8_t> source_;
  std::uniform_real_distribution<double> log_size_;
};

// A worker's side of a phase's barriers (load_bench.cc, RunPhase), for the
// load worker and the floor's alike. After its timed window a worker says
// TIMED and waits for the parent's word, which comes once every worker's
// window is over: what follows (the final drain, the report) falls in
// nobody's window. After END it stays until the parent closes its stdin, so
// that no exit (unmapping the arena, the daemon reclaiming the session)
// does either. False when the parent went away.
bool WaitForEveryWindowToEnd();
void StayUntilTheParentCloses();

// Prints the usage with `message`; returns 2.
int Usage(const char* message);

// Parses flags shared by `load` and `load-worker`; false with *error set on
// a bad flag.
bool ParseFlags(int argc, char** argv, LoadOptions* o, std::string* error);

}  // namespace memoffload::bench

#endif  // MEMOFFLOAD_BENCH_LOAD_OPTIONS_H_
