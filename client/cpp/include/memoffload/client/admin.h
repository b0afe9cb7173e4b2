// AdminClient: operator queries (status, sessions, regions) and the admin
// writes (drain, region delete) over the gRPC socket, without attaching a
// session. Used by memoffloadctl and tests.
#ifndef MEMOFFLOAD_CLIENT_ADMIN_H_
#define MEMOFFLOAD_CLIENT_ADMIN_H_

#include <memory>
#include <string>

#include "memoffload/common/status.h"
#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::client {

class AdminClient {
 public:
  // `runtime_dir` resolves like AttachOptions::runtime_dir. Fails with
  // UNAVAILABLE, naming the socket tried, when no daemon answers there.
  static Result<std::unique_ptr<AdminClient>> Connect(const std::string& runtime_dir,
                                                      int timeout_ms = 5000);
  ~AdminClient();

  Result<v1::GetStatusResponse> GetStatus();
  Result<v1::ListSessionsResponse> ListSessions();
  Result<v1::GetConfigResponse> GetConfig();
  // Starts (drain=true) or ends draining. Reads the admin token from
  // <runtime dir>/admin.token: PERMISSION_DENIED, naming the file, when this
  // process may not read it.
  Result<v1::DrainResponse> Drain(bool drain);
  // Every checkpoint region of the node whose name starts with prefix.
  Result<v1::ListRegionsResponse> ListRegions(const std::string& prefix = "");
  // Deletes a committed region of (uid, job id), with the admin token.
  Result<v1::DeleteRegionResponse> DeleteRegion(uint32_t uid, const std::string& job_id,
                                                const std::string& name);

  const std::string& socket_path() const;

 private:
  // <runtime dir>/admin.token: PERMISSION_DENIED naming it when unreadable,
  // UNAVAILABLE when no daemon runs there either.
  Result<std::string> ReadAdminToken();
  class Impl;
  explicit AdminClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_ADMIN_H_
