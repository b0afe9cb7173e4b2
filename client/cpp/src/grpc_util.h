// Helpers shared by the client's gRPC users (internal).
#ifndef MEMOFFLOAD_CLIENT_SRC_GRPC_UTIL_H_
#define MEMOFFLOAD_CLIENT_SRC_GRPC_UTIL_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "memoffload/common/status.h"

namespace memoffload::client {

// The arguments of every channel to the daemon (DaemonChannel).
grpc::ChannelArguments DaemonChannelArguments();

// Whether a failed call's status is gRPC's own UNAVAILABLE (its transport
// failed), not one the daemon returned.
bool TransportFailed(const grpc::Status& status);

// Converts a gRPC status; UNAVAILABLE gets the socket path added so the user
// sees where the client looked.
Status FromGrpc(const grpc::Status& status, const std::string& socket_path);

inline void SetDeadline(grpc::ClientContext* ctx, int timeout_ms) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
}

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_SRC_GRPC_UTIL_H_
