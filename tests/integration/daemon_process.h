// DaemonProcess: the real memoffloadd binary, started for a test in a fresh
// temporary runtime dir and stopped (SIGTERM, then SIGKILL) when destroyed.
#ifndef MEMOFFLOAD_TESTS_INTEGRATION_DAEMON_PROCESS_H_
#define MEMOFFLOAD_TESTS_INTEGRATION_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "memoffload/v1/memoffload.pb.h"

namespace memoffload::testing {

// Directory holding memoffloadd, memoffloadctl and the test helpers.
std::string BinDir();

class DaemonProcess {
 public:
  struct Options {
    // Empty: no flag (the config file or the default decides).
    std::string arena_size = "256MiB";
    std::string chunk_size = "64MiB";
    std::string metrics_address = "none";
    std::string drain_timeout = "3s";
    std::vector<std::string> extra_args;
    // Let other uids reach the sockets (scratch dir 0755, sockets 0666), so
    // the daemon's access policy is what decides.
    bool open_permissions = false;
  };

  // The scratch directory (parent of the runtime dir), for test files.
  const std::string& scratch_dir() const { return scratch_dir_; }

  // Starts the daemon and waits until it answers GetStatus. Returns nullptr
  // and fills *error (with the daemon's log) when it does not come up.
  static std::unique_ptr<DaemonProcess> Start(const Options& options, std::string* error);
  ~DaemonProcess();

  // Sends `signo` and waits up to timeout_ms; returns the wait status, or -1
  // on timeout (the daemon is then killed).
  int Stop(int signo, int timeout_ms);

  v1::GetStatusResponse Status() const;  // empty message when unreachable
  std::string Log() const;               // stderr of the daemon so far
  const std::string& runtime_dir() const { return runtime_dir_; }
  pid_t pid() const { return pid_; }

 private:
  DaemonProcess() = default;
  pid_t pid_ = -1;
  std::string runtime_dir_;
  std::string log_path_;
  std::string scratch_dir_;
};

// Runs a program with arguments; returns its pid. stdout goes to the pipe
// whose read end is stored in *stdout_fd when non-null (else inherited).
pid_t Spawn(const std::vector<std::string>& argv, int* stdout_fd);
// Waits for pid up to timeout_ms; returns the wait status or -1 on timeout.
int WaitFor(pid_t pid, int timeout_ms);
// Runs a program to completion (up to timeout_ms); returns its exit code (or
// -1 on timeout or signal) and its stdout in *out.
int RunCapture(const std::vector<std::string>& argv, std::string* out, int timeout_ms = 20000);

}  // namespace memoffload::testing

#endif  // MEMOFFLOAD_TESTS_INTEGRATION_DAEMON_PROCESS_H_
