#include "grpc_floor.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdlib>

#include "latency_stats.h"
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

int RunGrpcFloorWorker(const std::string& socket_path, double seconds) {
  auto stub = v1::Offload::NewStub(
      grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetStatusResponse resp;
    if (!stub->GetStatus(&ctx, v1::GetStatusRequest(), &resp).ok()) return 1;
  }
  std::printf("READY\n");
  std::fflush(stdout);
  char go = 0;
  if (read(STDIN_FILENO, &go, 1) != 1) return 1;
  MethodStats stats;
  const CpuTime cpu0 = SelfCpu();
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  while (Clock::now() < deadline) {
    grpc::ClientContext ctx;
    v1::GetStatusResponse resp;
    const auto t0 = Clock::now();
    const bool ok = stub->GetStatus(&ctx, v1::GetStatusRequest(), &resp).ok();
    stats.Record(Clock::now() - t0);
    ok ? ++stats.ops : ++stats.errors;
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  PrintMethodStats(0, stats);
  PrintCpu(SelfCpu() - cpu0);
  std::printf("S 0 0 0 %.6f\nEND\n", elapsed);
  std::fflush(stdout);
  return 0;
}

}  // namespace memoffload::bench
