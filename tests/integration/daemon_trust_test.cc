// Issue 29, item 1: a trainer verifies its daemon before it sends a byte.
// A second uid squats the victim's per-user runtime dir with a real
// memoffloadd of its own (its memory, its logs), or serves a broker socket
// planted in a dir the victim trusts: the victim's client refuses both with
// PERMISSION_DENIED, and still attaches to daemons it may trust (its own,
// root's, or a uid it names in MEMOFFLOAD_DAEMON_UID).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "daemon_process.h"

namespace memoffload::testing {
namespace {

constexpr uid_t kVictim = 61001;
constexpr uid_t kAttacker = 61002;

std::string Str(uid_t uid) { return std::to_string(uid); }

// memoffloadd run as `uid` (through setpriv) until the object goes.
class DaemonAs {
 public:
  DaemonAs(uid_t uid, const std::vector<std::string>& args, const std::string& log) {
    // The log is opened by root, before setpriv drops to `uid`.
    std::vector<std::string> argv = {"/bin/sh",
                                     "-c",
                                     "exec \"$@\" >" + log + " 2>&1",
                                     "sh",
                                     "/usr/bin/setpriv",
                                     "--reuid=" + Str(uid),
                                     "--regid=" + Str(uid),
                                     "--clear-groups",
                                     "/usr/bin/env",
                                     "-u",
                                     "XDG_RUNTIME_DIR",
                                     BinDir() + "/memoffloadd",
                                     "--arena-size=16MiB",
                                     "--chunk-size=8MiB",
                                     "--metrics-address=none",
                                     "--prefault-threads=1"};
    argv.insert(argv.end(), args.begin(), args.end());
    pid_ = Spawn(argv, nullptr);
  }
  ~DaemonAs() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      if (WaitFor(pid_, 10000) == -1) {
        kill(pid_, SIGKILL);
        WaitFor(pid_, 5000);
      }
    }
  }
  DaemonAs(const DaemonAs&) = delete;
  DaemonAs& operator=(const DaemonAs&) = delete;

 private:
  pid_t pid_ = -1;
};

// Waits for a socket at `path` (the daemon is up).
bool WaitForSocket(const std::string& path) {
  for (int i = 0; i < 500; ++i) {
    struct stat st;
    if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) return true;
    usleep(20000);
  }
  return false;
}

// A scratch dir (root's, 0755 so other uids can pass) removed with the object.
class Scratch {
 public:
  Scratch() {
    char name[] = "/tmp/memoffload-trust-XXXXXX";
    path_ = mkdtemp(name);
    chmod(path_.c_str(), 0755);
  }
  ~Scratch() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string Dir(const std::string& name, uid_t owner, mode_t mode) const {
    const std::string dir = path_ + "/" + name;
    mkdir(dir.c_str(), mode);
    chmod(dir.c_str(), mode);
    if (chown(dir.c_str(), owner, owner) != 0) ADD_FAILURE() << "chown " << dir;
    return dir;
  }

 private:
  std::string path_;
};

// offload_worker attach-as: the victim attaches and reserves 4 KiB with the
// environment `env` (KEY=VALUE, after MEMOFFLOAD_RUNTIME_DIR, XDG_RUNTIME_DIR
// and MEMOFFLOAD_DAEMON_UID are cleared). "OK" or "ERR <CODE> <message>".
std::string VictimAttaches(const std::vector<std::string>& env, const std::string& dir = "") {
  std::vector<std::string> argv = {"/usr/bin/env",    "-u", "MEMOFFLOAD_RUNTIME_DIR", "-u",
                                   "XDG_RUNTIME_DIR", "-u", "MEMOFFLOAD_DAEMON_UID"};
  argv.insert(argv.end(), env.begin(), env.end());
  argv.insert(argv.end(), {BinDir() + "/offload_worker", "attach-as", dir, Str(kVictim)});
  std::string out;
  RunCapture(argv, &out);
  return out;
}

bool SystemDaemonHere() {
  struct stat st;
  return lstat("/run/memoffload/broker.sock", &st) == 0;
}

// The attack of issue 29: without MEMOFFLOAD_RUNTIME_DIR and XDG_RUNTIME_DIR
// the victim's default is /tmp/memoffload-<uid>, which any user can create
// first and serve.
TEST(DaemonTrust, ASquattedPerUserRuntimeDirIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as two other uids";
  if (SystemDaemonHere()) GTEST_SKIP() << "a system daemon here takes discovery first";
  const std::string squatted = "/tmp/memoffload-" + Str(kVictim);
  std::error_code ignored;
  std::filesystem::remove_all(squatted, ignored);
  Scratch scratch;
  {
    DaemonAs attacker(
        kAttacker,
        {"--runtime-dir=" + squatted, "--socket-mode=0666", "--allowed-uids=" + Str(kVictim)},
        scratch.path() + "/attacker.log");
    ASSERT_TRUE(WaitForSocket(squatted + "/memoffload.sock"));
    const std::string out = VictimAttaches({});
    EXPECT_EQ(out.rfind("ERR PERMISSION_DENIED ", 0), 0u) << out;
    EXPECT_NE(out.find("runtime dir " + squatted + " belongs to uid " + Str(kAttacker)),
              std::string::npos)
        << out;
  }
  std::filesystem::remove_all(squatted, ignored);
}

// A broker socket that passes every file check (in the victim's own dir,
// owned by the victim) but is served by another uid: SO_PEERCRED refuses it,
// and the gRPC socket the attacker's broker names is never used.
TEST(DaemonTrust, ABrokerServedByAnotherUidIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as two other uids";
  Scratch scratch;
  const std::string mine = scratch.Dir("victim", kVictim, 0700);
  const std::string theirs = scratch.Dir("attacker", kAttacker, 0755);
  DaemonAs attacker(
      kAttacker,
      {"--runtime-dir=" + theirs + "/run", "--socket-mode=0666", "--allowed-uids=" + Str(kVictim)},
      theirs + "/daemon.log");
  ASSERT_TRUE(WaitForSocket(theirs + "/run/memoffload.sock"));
  ASSERT_EQ(rename((theirs + "/run/broker.sock").c_str(), (mine + "/broker.sock").c_str()), 0);
  ASSERT_EQ(lchown((mine + "/broker.sock").c_str(), kVictim, kVictim), 0);
  const std::string out = VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + mine});
  EXPECT_EQ(out.rfind("ERR PERMISSION_DENIED ", 0), 0u) << out;
  EXPECT_NE(out.find("runs as uid " + Str(kAttacker)), std::string::npos) << out;
}

// A runtime dir writable by others (a sticky /tmp-like dir named as the
// runtime dir itself) is refused, whoever serves it.
TEST(DaemonTrust, ARuntimeDirWritableByOthersIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as two other uids";
  Scratch scratch;
  const std::string shared = scratch.Dir("shared", 0, 01777);
  DaemonAs attacker(
      kAttacker,
      {"--runtime-dir=" + shared + "/run", "--socket-mode=0666", "--allowed-uids=" + Str(kVictim)},
      scratch.path() + "/attacker.log");
  ASSERT_TRUE(WaitForSocket(shared + "/run/memoffload.sock"));
  const std::string out = VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + shared + "/run"});
  EXPECT_EQ(out.rfind("ERR PERMISSION_DENIED ", 0), 0u) << out;
  EXPECT_NE(out.find("belongs to uid " + Str(kAttacker)), std::string::npos) << out;
}

// What the victim may trust still works: its own daemon in its default dir
// (made 0700), and a daemon of another uid that it names explicitly.
TEST(DaemonTrust, OwnDaemonAndANamedDaemonUidAreTrusted) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as two other uids";
  if (SystemDaemonHere()) GTEST_SKIP() << "a system daemon here takes discovery first";
  const std::string own = "/tmp/memoffload-" + Str(kVictim);
  std::error_code ignored;
  std::filesystem::remove_all(own, ignored);
  Scratch scratch;
  {
    DaemonAs victim(kVictim, {}, scratch.path() + "/victim.log");
    ASSERT_TRUE(WaitForSocket(own + "/memoffload.sock"));
    struct stat st;
    ASSERT_EQ(lstat(own.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u);
    EXPECT_EQ(VictimAttaches({}), "OK\n");
  }
  std::filesystem::remove_all(own, ignored);

  const std::string service = scratch.Dir("service", kAttacker, 0755);
  DaemonAs named(
      kAttacker,
      {"--runtime-dir=" + service + "/run", "--socket-mode=0666", "--allowed-uids=" + Str(kVictim)},
      service + "/daemon.log");
  ASSERT_TRUE(WaitForSocket(service + "/run/memoffload.sock"));
  const std::string refused = VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + service + "/run"});
  EXPECT_EQ(refused.rfind("ERR PERMISSION_DENIED ", 0), 0u) << refused;
  EXPECT_NE(refused.find("MEMOFFLOAD_DAEMON_UID=" + Str(kAttacker)), std::string::npos) << refused;
  EXPECT_EQ(VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + service + "/run",
                            "MEMOFFLOAD_DAEMON_UID=" + Str(kAttacker)}),
            "OK\n");
}

}  // namespace
}  // namespace memoffload::testing
