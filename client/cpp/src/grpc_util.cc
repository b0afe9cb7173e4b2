#include "grpc_util.h"

#include "memoffload/common/runtime_dir.h"

namespace memoffload::client {

grpc::ChannelArguments DaemonChannelArguments() {
  grpc::ChannelArguments args;
  // No gRPC retry filter: it keeps every call's messages so that it could
  // replay them; without it a call's p50 under load is 6-9% lower
  // (docs/history/request_path.md).
  // Nothing is lost: no call has a retry policy, and a call that fails
  // before it reaches the daemon is UNAVAILABLE, which the client already
  // handles (attach again after a restart).
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  return args;
}

bool TransportFailed(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE &&
         status.error_details() != kDaemonStatusDetails;
}

Status FromGrpc(const grpc::Status& status, const std::string& socket_path) {
  if (status.ok()) return Status::Ok();
  std::string message = status.error_message();
  // gRPC's own UNAVAILABLE or DEADLINE_EXCEEDED (nobody answered in time);
  // the daemon marks the statuses it returns itself (shutting down,
  // draining), and those keep their message as it is.
  const bool from_daemon = status.error_details() == kDaemonStatusDetails;
  if (!from_daemon && (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                       status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)) {
    message = "memoffloadd at unix:" + socket_path + " did not answer: " + message;
  }
  return Status(static_cast<StatusCode>(status.error_code()), message);
}

}  // namespace memoffload::client
