#include "daemon_channel.h"

#include <fcntl.h>
#include <grpcpp/create_channel_posix.h>
#include <poll.h>
#include <unistd.h>

#include "grpc_util.h"
#include "memoffload/common/runtime_dir.h"

namespace memoffload::client {

Result<std::unique_ptr<DaemonChannel>> DaemonChannel::Open(const TrustedRuntimeDir& dir) {
  std::unique_ptr<DaemonChannel> channel(new DaemonChannel());
  channel->socket_path_ = GrpcSocketPath(dir.resolved);
  absl::MutexLock lock(&channel->mu_);
  channel->dir_ = dir;
  MEMOFFLOAD_RETURN_IF_ERROR(channel->Connect(/*reverify=*/false));
  return channel;
}

DaemonChannel::~DaemonChannel() {
  absl::MutexLock lock(&mu_);
  if (watch_fd_ >= 0) close(watch_fd_);
}

TrustedRuntimeDir DaemonChannel::dir() const {
  absl::MutexLock lock(&mu_);
  return dir_;
}

Status DaemonChannel::Connect(bool reverify) {
  if (reverify) {
    Result<TrustedRuntimeDir> again = VerifyRuntimeDir(dir_.choice);
    if (!again.ok()) return again.status();
    dir_ = std::move(again).value();
  }
  Result<int> fd = ConnectVerified(dir_, kGrpcSocketName);
  if (!fd.ok()) return fd.status();
  const int watch = fcntl(*fd, F_DUPFD_CLOEXEC, 0);
  if (watch < 0) {
    const int err = errno;
    close(*fd);
    return ErrnoStatus("dup of the gRPC socket", err);
  }
  if (watch_fd_ >= 0) close(watch_fd_);
  watch_fd_ = watch;
  failed_ = false;
  // gRPC owns *fd from here (it closes it with the channel's transport).
  stub_ = v1::Offload::NewStub(
      grpc::CreateCustomInsecureChannelFromFd("localhost", *fd, DaemonChannelArguments()));
  return Status::Ok();
}

bool DaemonChannel::Broken() const {
  pollfd p{watch_fd_, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0;
}

Result<std::shared_ptr<v1::Offload::Stub>> DaemonChannel::Stub() {
  absl::MutexLock lock(&mu_);
  if (failed_ || Broken()) MEMOFFLOAD_RETURN_IF_ERROR(Connect(/*reverify=*/true));
  return stub_;
}

void DaemonChannel::Failed(const std::shared_ptr<v1::Offload::Stub>& stub) {
  absl::MutexLock lock(&mu_);
  if (stub == stub_) failed_ = true;
}

void DaemonChannel::Renew() {
  absl::MutexLock lock(&mu_);
  failed_ = true;
}

}  // namespace memoffload::client
