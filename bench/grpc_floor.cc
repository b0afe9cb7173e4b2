#include "grpc_floor.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <vector>

#include "latency_stats.h"
#include "load_options.h"
#include "memoffload/v1/memoffload.grpc.pb.h"

namespace memoffload::bench {

class GrpcFloorServer::Impl final : public v1::Offload::Service {
 public:
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::GetStatusResponse*) override {
    return grpc::Status::OK;
  }
  std::unique_ptr<grpc::Server> server;
};

Result<std::unique_ptr<GrpcFloorServer>> GrpcFloorServer::Start() {
  std::unique_ptr<GrpcFloorServer> f(new GrpcFloorServer());
  char dir[] = "/tmp/memoffload-floor-XXXXXX";
  if (mkdtemp(dir) == nullptr) return ErrnoStatus("mkdtemp", errno);
  f->dir_ = dir;
  f->socket_path_ = f->dir_ + "/floor.sock";
  f->impl_ = std::make_unique<Impl>();
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + f->socket_path_, grpc::InsecureServerCredentials());
  builder.RegisterService(f->impl_.get());
  f->impl_->server = builder.BuildAndStart();
  if (f->impl_->server == nullptr) {
    return Unavailable("cannot serve the gRPC floor on " + f->socket_path_);
  }
  return f;
}

GrpcFloorServer::~GrpcFloorServer() {
  if (impl_ && impl_->server) impl_->server->Shutdown();
  unlink(socket_path_.c_str());
  if (!dir_.empty()) rmdir(dir_.c_str());
}

int RunGrpcFloorWorker(const LoadOptions& o) {
  auto stub = v1::Offload::NewStub(
      grpc::CreateChannel("unix:" + o.floor_socket, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetStatusResponse resp;
    if (!stub->GetStatus(&ctx, v1::GetStatusRequest(), &resp).ok()) return 1;
  }
  // The load worker's data and sizes, and a ring of `window` slots; none
  // for the plain floor, whose clients carry no data.
  std::optional<WorkerData> data;
  std::vector<uint8_t> slots, readback;
  if (o.floor_copies) {
    data.emplace(o);
    slots.assign(o.max_group * o.window, 1);  // faulted now, not in the window
    readback.assign(o.max_group, 1);
  }
  std::printf("READY\n");
  std::fflush(stdout);
  char go = 0;
  if (read(STDIN_FILENO, &go, 1) != 1) return 1;
  MethodStats stats;
  auto call = [&] {
    grpc::ClientContext ctx;
    v1::GetStatusResponse resp;
    const auto t0 = Clock::now();
    const bool ok = stub->GetStatus(&ctx, v1::GetStatusRequest(), &resp).ok();
    stats.Record(Clock::now() - t0);
    ok ? ++stats.ops : ++stats.errors;
  };
  struct Held {
    uint64_t group, bytes;
  };
  std::deque<Held> held;
  double copy_seconds = 0;
  uint64_t mismatches = 0, next_group = 1;
  const CpuTime cpu0 = SelfCpu();
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.seconds));
  while (Clock::now() < deadline) {
    if (!o.floor_copies) {
      call();
      continue;
    }
    const uint64_t g = next_group++;
    const uint64_t bytes = data->NextSize();
    uint8_t* slot = slots.data() + (g % o.window) * o.max_group;
    call();  // as Reserve
    double c0 = ThreadCpuSeconds();
    std::memcpy(slot, data->BytesOf(g), bytes);
    copy_seconds += ThreadCpuSeconds() - c0;
    call();  // as Commit
    held.push_back({g, bytes});
    if (static_cast<int>(held.size()) < o.window) continue;
    const Held h = held.front();
    held.pop_front();
    call();  // as Prefetch
    c0 = ThreadCpuSeconds();
    std::memcpy(readback.data(), slots.data() + (h.group % o.window) * o.max_group, h.bytes);
    mismatches += std::memcmp(readback.data(), data->BytesOf(h.group), h.bytes) != 0;
    copy_seconds += ThreadCpuSeconds() - c0;
    call();  // as Release
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  CpuTime cpu = SelfCpu() - cpu0;
  cpu.copy = copy_seconds;
  stats.errors += mismatches;  // a bench bug: the slots are never shared
  if (!WaitForEveryWindowToEnd()) return 1;
  PrintMethodStats(0, stats);
  PrintCpu(cpu);
  std::printf("S 0 0 0 %.6f\nEND\n", elapsed);
  StayUntilTheParentCloses();
  return 0;
}

}  // namespace memoffload::bench
