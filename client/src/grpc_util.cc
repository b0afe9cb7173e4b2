#include "grpc_util.h"

namespace memoffload::client {

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& socket_path) {
  grpc::ChannelArguments args;
  // Reconnect quickly after a daemon restart; the default backoff grows to 2 min.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel("unix:" + socket_path, grpc::InsecureChannelCredentials(), args);
}

Status FromGrpc(const grpc::Status& status, const std::string& socket_path) {
  if (status.ok()) return Status::Ok();
  std::string message = status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    message = "memoffloadd at unix:" + socket_path + " did not answer: " + message;
  }
  return Status(static_cast<StatusCode>(status.error_code()), message);
}

}  // namespace memoffload::client
