#include "daemon_process.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "memoffload/client/admin.h"

namespace memoffload::testing {

std::string BinDir() {
  const char* env = std::getenv("MEMOFFLOAD_BIN_DIR");
  return env != nullptr && env[0] != '\0' ? env : MEMOFFLOAD_BIN_DIR;
}

pid_t Spawn(const std::vector<std::string>& argv, int* stdout_fd) {
  int pipe_fds[2] = {-1, -1};
  if (stdout_fd != nullptr && pipe2(pipe_fds, O_CLOEXEC) != 0) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    if (stdout_fd != nullptr) dup2(pipe_fds[1], STDOUT_FILENO);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  if (stdout_fd != nullptr) {
    close(pipe_fds[1]);
    *stdout_fd = pipe_fds[0];
  }
  return pid;
}

int WaitFor(pid_t pid, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0) return -1;
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int RunCapture(const std::vector<std::string>& argv, std::string* out, int timeout_ms) {
  int fd = -1;
  pid_t pid = Spawn(argv, &fd);
  out->clear();
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out->append(buf, static_cast<size_t>(n));
  close(fd);
  int status = WaitFor(pid, timeout_ms);
  if (status == -1) {
    kill(pid, SIGKILL);
    WaitFor(pid, 1000);
    return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::unique_ptr<DaemonProcess> DaemonProcess::Start(const Options& options, std::string* error) {
  std::unique_ptr<DaemonProcess> d(new DaemonProcess());
  char scratch[] = "/tmp/memoffload-test-XXXXXX";
  if (mkdtemp(scratch) == nullptr) {
    *error = "mkdtemp failed";
    return nullptr;
  }
  d->scratch_dir_ = scratch;
  d->runtime_dir_ = options.runtime_dir.empty() ? d->scratch_dir_ + "/run" : options.runtime_dir;
  d->log_path_ = d->scratch_dir_ + "/daemon.log";
  std::vector<std::string> argv = {BinDir() + "/memoffloadd", "--runtime-dir=" + d->runtime_dir_,
                                   "--metrics-address=" + options.metrics_address,
                                   "--drain-timeout=" + options.drain_timeout};
  if (!options.arena_size.empty()) argv.push_back("--arena-size=" + options.arena_size);
  if (!options.chunk_size.empty()) argv.push_back("--chunk-size=" + options.chunk_size);

  if (options.open_permissions) {
    chmod(d->scratch_dir_.c_str(), 0755);
    argv.push_back("--socket-mode=0666");
  }
  argv.insert(argv.end(), options.extra_args.begin(), options.extra_args.end());
  d->pid_ = fork();
  if (d->pid_ == 0) {
    int log = open(d->log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    dup2(log, STDERR_FILENO);
    dup2(log, STDOUT_FILENO);
    if (options.nofile_limit != 0) {
      const rlimit lim{options.nofile_limit, options.nofile_limit};
      if (setrlimit(RLIMIT_NOFILE, &lim) != 0) {
        dprintf(STDERR_FILENO, "test: cannot set RLIMIT_NOFILE: %s\n", std::strerror(errno));
        _exit(126);
      }
    }
    if (options.memlock_limit_bytes != 0) {
      const rlimit lim{options.memlock_limit_bytes, options.memlock_limit_bytes};
      if (setrlimit(RLIMIT_MEMLOCK, &lim) != 0 ||
          (prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0 && errno != EINVAL)) {
        dprintf(STDERR_FILENO, "test: cannot lower RLIMIT_MEMLOCK or drop CAP_IPC_LOCK: %s\n",
                std::strerror(errno));
        _exit(126);
      }
    }
    if (options.nofile_limit != 0) {
      const rlimit lim{options.nofile_limit, options.nofile_limit};
      if (setrlimit(RLIMIT_NOFILE, &lim) != 0) {
        dprintf(STDERR_FILENO, "test: cannot set RLIMIT_NOFILE: %s\n", std::strerror(errno));
        _exit(126);
      }
    }
    if (options.drop_fd_caps) {
      for (int cap : {CAP_SYS_ADMIN, CAP_SYS_RESOURCE}) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL) {
          dprintf(STDERR_FILENO, "test: cannot drop capability %d: %s\n", cap,
                  std::strerror(errno));
          _exit(126);
        }
      }
    }
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(d->pid_, &status, WNOHANG) == d->pid_) {
      d->pid_ = -1;
      *error = "memoffloadd exited during start-up:\n" + d->Log();
      return nullptr;
    }
    if (std::filesystem::exists(d->runtime_dir_ + "/broker.sock") && d->Status().chunks() > 0) {
      return d;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  *error = "memoffloadd did not become ready within 30 s:\n" + d->Log();
  return nullptr;
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) Stop(SIGTERM, 10000);
  const std::string report = SanitizerReport(Log());
  if (!report.empty()) {
    ADD_FAILURE() << "memoffloadd (log " << log_path_ << ") reported:\n"
                  << report << "\nfull log:\n"
                  << Log();
  }
  std::error_code ignored;
  std::filesystem::remove_all(scratch_dir_, ignored);
}

void DaemonProcess::Reaped(int status) {
  pid_ = -1;
  if (allow_abnormal_exit_) return;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string how =
        WIFEXITED(status)     ? "exited with status " + std::to_string(WEXITSTATUS(status))
        : WIFSIGNALED(status) ? "was killed by signal " + std::to_string(WTERMSIG(status))
                              : "ended with wait status " + std::to_string(status);
    ADD_FAILURE() << "memoffloadd " << how << " (expected a clean exit with 0); log:\n" << Log();
  }
}

int DaemonProcess::Stop(int signo, int timeout_ms) {
  if (pid_ <= 0) return -1;
  if (signo == SIGKILL) allow_abnormal_exit_ = true;  // killed on purpose
  kill(pid_, signo);
  int status = WaitFor(pid_, timeout_ms);
  if (status == -1) {
    kill(pid_, SIGKILL);
    WaitFor(pid_, 5000);
    pid_ = -1;
    if (!allow_abnormal_exit_) {
      ADD_FAILURE() << "memoffloadd did not exit within " << timeout_ms << " ms of signal " << signo
                    << " and was killed; log:\n"
                    << Log();
    }
    return -1;
  }
  Reaped(status);
  return status;
}

int DaemonProcess::Wait(int timeout_ms) {
  if (pid_ <= 0) return -1;
  int status = WaitFor(pid_, timeout_ms);
  if (status != -1) Reaped(status);
  return status;
}

std::string SanitizerReport(const std::string& log) {
  std::string out;
  std::istringstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("Sanitizer") != std::string::npos ||
        line.find("runtime error:") != std::string::npos) {
      out += line + "\n";
    }
  }
  return out;
}

v1::GetStatusResponse DaemonProcess::Status() const {
  auto admin = client::AdminClient::Connect(runtime_dir_, 2000);
  if (!admin.ok()) return {};
  auto status = (*admin)->GetStatus();
  return status.ok() ? *status : v1::GetStatusResponse();
}

std::string DaemonProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

DaemonProcess::Options TwoTenantOptions(const std::string& arena_size,
                                        const std::string& chunk_size) {
  DaemonProcess::Options options;
  options.arena_size = arena_size;
  options.chunk_size = chunk_size;
  options.open_permissions = true;
  options.extra_args = {"--allowed-uids=65534"};
  return options;
}

int ConnectUnix(const std::string& path, bool nonblocking) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int ThreadCount(pid_t pid) {
  DIR* dir = opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
  if (dir == nullptr) return -1;
  int count = 0;
  while (dirent* e = readdir(dir)) count += e->d_name[0] == '.' ? 0 : 1;
  closedir(dir);
  return count;
}

int ConnectLoopback(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string ReadUntilClosed(int fd, int timeout_ms) {
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// GET over HTTP/1.0 with a deadline: the whole response, "" on failure.
std::string HttpGet(int port, const std::string& path, int timeout_ms) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return "";
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  if (write(fd, req.data(), req.size()) < 0) {
    close(fd);
    return "";
  }
  std::string out = ReadUntilClosed(fd, timeout_ms);
  close(fd);
  return out;
}

}  // namespace memoffload::testing
