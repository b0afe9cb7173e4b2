#include "app/process_setup.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <random>
#include <vector>

#include "base/log.h"
#include "core/session_token.h"

namespace memoffload::daemon {

Result<gid_t> ResolveGroup(const std::string& name) {
  if (name.empty()) return static_cast<gid_t>(-1);
  std::vector<char> buf(16384);
  group gr{};
  group* found = nullptr;
  if (getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    char* end = nullptr;
    unsigned long gid = std::strtoul(name.c_str(), &end, 10);
    if (*end == '\0' && !name.empty()) return static_cast<gid_t>(gid);
    return InvalidArgument("server.socket_group: no group named '" + name + "'");
  }
  return found->gr_gid;
}

rlimit RaiseSoftDescriptorLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return lim;
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) getrlimit(RLIMIT_NOFILE, &lim);
  }
  return lim;
}

void RaiseDescriptorLimit(const DaemonConfig& config) {
  const rlimit lim = RaiseSoftDescriptorLimit();
  if (lim.rlim_max == 0) return;  // getrlimit failed
  const uint64_t needed = 2 * config.max_connections + 256;
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < needed) {
    MO_LOG_WARN(
        "the descriptor limit (%llu) is below what server.max_connections = %llu on two sockets "
        "needs (about %llu): a connection flood can exhaust descriptors (the daemon then backs "
        "off and recovers, and /readyz says 503); raise LimitNOFILE or lower max_connections",
        static_cast<unsigned long long>(lim.rlim_cur),
        static_cast<unsigned long long>(config.max_connections),
        static_cast<unsigned long long>(needed));
  }
}

Status WriteAdminToken(const std::string& dir, const std::string& token) {
  const std::string path = dir + "/" + kAdminTokenName;
  const std::string temp = path + ".new";
  unlink(temp.c_str());
  int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return ErrnoStatus("creating " + temp, errno);
  const bool ok = write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size());
  close(fd);
  // Whole or not at all: a reader never sees a missing or empty token.
  if (!ok || rename(temp.c_str(), path.c_str()) != 0) {
    unlink(temp.c_str());
    return Internal("writing " + path + " failed");
  }
  return Status::Ok();
}

uint64_t RandomInstanceId() {
  std::random_device rd;
  uint64_t id = 0;
  while (id == 0) id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return id;
}

}  // namespace memoffload::daemon
