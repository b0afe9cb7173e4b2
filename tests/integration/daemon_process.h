// DaemonProcess: the real memoffloadd binary, started for a test in a fresh
// temporary runtime dir and stopped (SIGTERM, then SIGKILL) when destroyed.
#ifndef MEMOFFLOAD_TESTS_INTEGRATION_DAEMON_PROCESS_H_
#define MEMOFFLOAD_TESTS_INTEGRATION_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

// The torch tests include this header next to pip torch's own protobuf
// headers, which clash with the system's: they define
// MEMOFFLOAD_TEST_WITHOUT_PROTO and do not call Status().
#ifndef MEMOFFLOAD_TEST_WITHOUT_PROTO
#include "memoffload/v1/memoffload.pb.h"
#else
namespace memoffload::v1 {
class GetStatusResponse;
}  // namespace memoffload::v1
#endif

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
    // Empty: a fresh runtime dir under the scratch dir. Else this one (e.g.
    // the dir of a killed daemon, to restart "the" daemon).
    std::string runtime_dir;
    // Let other uids reach the sockets (scratch dir 0755, sockets 0666), so
    // the daemon's access policy is what decides.
    bool open_permissions = false;
    // When non-zero, the daemon runs with RLIMIT_MEMLOCK at this many bytes
    // and without CAP_IPC_LOCK (dropped from the bounding set before exec),
    // so even root cannot lock more: the mlock warning path.
    uint64_t memlock_limit_bytes = 0;
    // When non-zero, the daemon runs with RLIMIT_NOFILE (soft and hard) at
    // this many descriptors.
    uint64_t nofile_limit = 0;
    // The daemon runs without CAP_SYS_ADMIN and CAP_SYS_RESOURCE (dropped
    // from the bounding set before exec), as a non-root daemon does: the
    // kernel then bounds the fds it has in flight in Unix sockets by its
    // RLIMIT_NOFILE.
    bool drop_fd_caps = false;
  };

  // The scratch directory (parent of the runtime dir), for test files.
  const std::string& scratch_dir() const { return scratch_dir_; }

  // Starts the daemon and waits until it answers GetStatus. Returns nullptr
  // and fills *error (with the daemon's log) when it does not come up.
  static std::unique_ptr<DaemonProcess> Start(const Options& options, std::string* error);
  // Stops the daemon (SIGTERM) unless stopped already, then checks, as a
  // test failure (ADD_FAILURE): that it exited normally with status 0 unless
  // the test killed it on purpose (Stop(SIGKILL), AllowAbnormalExit), and
  // that its log holds no sanitizer report (see SanitizerReport).
  ~DaemonProcess();

  // Sends `signo` and waits up to timeout_ms; returns the wait status, or -1
  // on timeout (the daemon is then killed). Any signal but SIGKILL must make
  // the daemon exit with 0; anything else is a test failure (ADD_FAILURE).
  int Stop(int signo, int timeout_ms);
  // Waits up to timeout_ms for the daemon to exit on its own (e.g. after a
  // SIGTERM sent by the test); returns the wait status or -1 on timeout (the
  // daemon keeps running). Checks the exit status as Stop does.
  int Wait(int timeout_ms);
  // The daemon may exit with any status or signal (a test that expects it).
  void AllowAbnormalExit() { allow_abnormal_exit_ = true; }

  v1::GetStatusResponse Status() const;  // empty message when unreachable
  std::string Log() const;               // stderr of the daemon so far
  const std::string& runtime_dir() const { return runtime_dir_; }
  pid_t pid() const { return pid_; }

 private:
  DaemonProcess() = default;
  // Records a reaped wait status and checks it (see Stop).
  void Reaped(int status);
  pid_t pid_ = -1;
  bool allow_abnormal_exit_ = false;
  std::string runtime_dir_;
  std::string log_path_;
  std::string scratch_dir_;
};

// The lines of a daemon or client log that report a sanitizer finding
// (AddressSanitizer, LeakSanitizer, ThreadSanitizer, UBSan's "runtime
// error:"), joined; empty when there are none.
std::string SanitizerReport(const std::string& log);

// A daemon for tenant tests: sockets open to everyone and uid 65534 (the
// other tenant, driven through setpriv) admitted next to root.
DaemonProcess::Options TwoTenantOptions(const std::string& arena_size,
                                        const std::string& chunk_size);

// Runs a program with arguments; returns its pid. stdout goes to the pipe
// whose read end is stored in *stdout_fd when non-null (else inherited).
pid_t Spawn(const std::vector<std::string>& argv, int* stdout_fd);
// Waits for pid up to timeout_ms; returns the wait status or -1 on timeout.
int WaitFor(pid_t pid, int timeout_ms);
// Runs a program to completion (up to timeout_ms); returns its exit code (or
// -1 on timeout or signal) and its stdout in *out.
int RunCapture(const std::vector<std::string>& argv, std::string* out, int timeout_ms = 20000);
// GET over HTTP/1.0 on loopback with a deadline: the whole response, "" on
// failure.
std::string HttpGet(int port, const std::string& path, int timeout_ms = 5000);
// A TCP socket connected to 127.0.0.1:port (the caller closes it), or -1.
int ConnectLoopback(int port);
// A connected Unix stream socket to `path`, or -1.
int ConnectUnix(const std::string& path, bool nonblocking = false);
// The threads of process `pid` (its /proc tasks), or -1.
int ThreadCount(pid_t pid);
// Everything readable from fd until the peer closes it or timeout_ms passes.
std::string ReadUntilClosed(int fd, int timeout_ms = 5000);

}  // namespace memoffload::testing

#endif  // MEMOFFLOAD_TESTS_INTEGRATION_DAEMON_PROCESS_H_
