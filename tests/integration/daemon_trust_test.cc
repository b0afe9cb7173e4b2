// Issue 29, item 1: a trainer verifies its daemon before it sends a byte.
// A second uid squats the victim's per-user runtime dir with a real
// memoffloadd of its own (its memory, its logs), or serves a broker socket
// planted in a dir the victim trusts: the victim's client refuses both with
// PERMISSION_DENIED, and still attaches to daemons it may trust (its own,
// root's, or a uid it names in MEMOFFLOAD_DAEMON_UID).
#include "memoffload/client/daemon_trust.h"

#include <grp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/admin.h"
#include "memoffload/client/client.h"
#include "memoffload/v1/memoffload.pb.h"

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

// Issue 38: the runtime dir was checked by where it resolved to, then
// reached by the path as given. So a symlink `rt` in a dir another uid owns
// passed when it pointed at a real daemon's dir, and flipping it between
// the check and the connect (gRPC also reconnects by the path later) sent a
// session's id and bearer token to the attacker's socket.
//
// uid kAttacker owns <scratch>/attacker. A link rt there that leads to the
// victim's real runtime dir is refused, naming the attacker's dir. Then an
// attacker process serves both sockets in <scratch>/attacker/fake and flips
// rt between that and the real dir about every millisecond while the victim
// attaches through rt 20 times: every attach is refused, and not one byte
// reaches the attacker's sockets.
class FlippingAttacker {
 public:
  FlippingAttacker(const std::string& dir, const std::string& real) {
    int pipe_fds[2];
    if (pipe(pipe_fds) != 0) return;
    pid_ = fork();
    if (pid_ != 0) {
      close(pipe_fds[1]);
      heard_fd_ = pipe_fds[0];
      return;
    }
    close(pipe_fds[0]);
    if (setgroups(0, nullptr) != 0 || setgid(kAttacker) != 0 || setuid(kAttacker) != 0) _exit(2);
    const std::string fake = dir + "/fake";
    mkdir(fake.c_str(), 0755);
    std::vector<pollfd> fds;
    for (const char* name : {"/broker.sock", "/memoffload.sock"}) {
      const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      const std::string path = fake + name;
      std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
      if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 64) != 0) {
        _exit(3);
      }
      chmod(path.c_str(), 0666);
      fds.push_back({fd, POLLIN, 0});
    }
    const size_t listeners = fds.size();
    for (uint64_t flip = 0;; ++flip) {
      const std::string tmp = dir + "/rt.tmp";
      unlink(tmp.c_str());
      if (symlink((flip % 2 == 0 ? real : fake).c_str(), tmp.c_str()) == 0) {
        rename(tmp.c_str(), (dir + "/rt").c_str());
      }
      if (poll(fds.data(), fds.size(), 1) <= 0) continue;  // a flip about every ms
      for (size_t i = 0; i < fds.size(); ++i) {
        if ((fds[i].revents & POLLIN) == 0) continue;
        if (i < listeners) {
          const int conn = accept4(fds[i].fd, nullptr, nullptr, SOCK_NONBLOCK);
          if (conn >= 0) fds.push_back({conn, POLLIN, 0});
          continue;
        }
        char buf[4096];
        const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
        if (n > 0 && write(pipe_fds[1], buf, static_cast<size_t>(n)) < 0) _exit(4);
      }
    }
  }
  ~FlippingAttacker() { Stop(); }
  // Stops the attacker; returns what its sockets were sent.
  std::string Stop() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      WaitFor(pid_, 5000);
      pid_ = -1;
    }
    std::string heard;
    if (heard_fd_ >= 0) {
      heard = ReadUntilClosed(heard_fd_, 2000);
      close(heard_fd_);
      heard_fd_ = -1;
    }
    return heard;
  }

 private:
  pid_t pid_ = -1;
  int heard_fd_ = -1;
};

TEST(DaemonTrust, ASymlinkedRuntimeDirInAnotherUidsDirIsRefusedAndAFlipNeverReachesIt) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as two other uids";
  Scratch scratch;
  const std::string victim_dir = scratch.Dir("victim", kVictim, 0755);
  const std::string real = victim_dir + "/run";
  DaemonAs victim(kVictim, {"--runtime-dir=" + real}, victim_dir + "/daemon.log");
  ASSERT_TRUE(WaitForSocket(real + "/memoffload.sock"));
  ASSERT_EQ(VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + real}), "OK\n");
  const std::string theirs = scratch.Dir("attacker", kAttacker, 0755);
  // A link that leads to the real daemon, but that its owner can change.
  const std::string rt = theirs + "/rt";
  ASSERT_EQ(symlink(real.c_str(), rt.c_str()), 0);
  ASSERT_EQ(lchown(rt.c_str(), kAttacker, kAttacker), 0);
  const std::string steady = VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + rt});
  EXPECT_EQ(steady.rfind("ERR PERMISSION_DENIED ", 0), 0u) << steady;
  EXPECT_NE(steady.find("directory " + theirs + " on its way belongs to uid " + Str(kAttacker)),
            std::string::npos)
      << steady;
  // The hint to trust that uid says it is only for a uid that runs the daemon.
  EXPECT_NE(steady.find("only if uid " + Str(kAttacker) + " runs your daemon, and you trust it"),
            std::string::npos)
      << steady;
  ASSERT_EQ(unlink(rt.c_str()), 0);
  FlippingAttacker attacker(theirs, real);
  for (int i = 0; i < 20; ++i) {
    const std::string out = VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + theirs + "/rt"});
    EXPECT_EQ(out.rfind("ERR PERMISSION_DENIED ", 0), 0u) << i << ": " << out;
    EXPECT_NE(out.find("directory " + theirs + " on its way belongs to uid " + Str(kAttacker)),
              std::string::npos)
        << out;
  }
  const std::string heard = attacker.Stop();
  EXPECT_EQ(heard.size(), 0u) << "the attacker's sockets were sent " << heard.size() << " bytes";
}

// Symlinks that only root, the user or the named daemon uid can change are
// followed, and the sockets are reached by where they lead: a link in the
// victim's own dir attaches. A link another uid made in a sticky dir (as in
// /tmp) is that uid's to replace, so it is refused, naming the link.
TEST(DaemonTrust, SymlinksOnlyTrustedUsersCanChangeAreFollowed) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as two other uids";
  Scratch scratch;
  const std::string victim_dir = scratch.Dir("victim", kVictim, 0700);
  const std::string real = victim_dir + "/run";
  DaemonAs victim(kVictim, {"--runtime-dir=" + real}, scratch.path() + "/daemon.log");
  ASSERT_TRUE(WaitForSocket(real + "/memoffload.sock"));
  const std::string own_link = victim_dir + "/current";
  ASSERT_EQ(symlink("run", own_link.c_str()), 0);
  ASSERT_EQ(lchown(own_link.c_str(), kVictim, kVictim), 0);
  EXPECT_EQ(VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + own_link}), "OK\n");
  const std::string sticky = scratch.Dir("shared", 0, 01777);
  const std::string their_link = sticky + "/memoffload";
  ASSERT_EQ(symlink(real.c_str(), their_link.c_str()), 0);
  ASSERT_EQ(lchown(their_link.c_str(), kAttacker, kAttacker), 0);
  const std::string out = VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + their_link});
  EXPECT_EQ(out.rfind("ERR PERMISSION_DENIED ", 0), 0u) << out;
  EXPECT_NE(
      out.find("symlink " + their_link + " in " + sticky + " belongs to uid " + Str(kAttacker)),
      std::string::npos)
      << out;
  ASSERT_EQ(lchown(their_link.c_str(), kVictim, kVictim), 0);  // the victim's own link there
  EXPECT_EQ(VictimAttaches({"MEMOFFLOAD_RUNTIME_DIR=" + their_link}), "OK\n");
}

// gRPC dialled the socket's path again whenever its connection broke. Now
// every connection is made by the client over the runtime dir verified
// again: after a restart under a parent another uid can now write, the admin
// client refuses to reconnect, and reconnects once the parent is fixed.
TEST(DaemonTrust, EveryReconnectVerifiesTheRuntimeDirAgain) {
  std::string error;
  auto first = DaemonProcess::Start({}, &error);
  ASSERT_NE(first, nullptr) << error;
  const std::string dir = first->runtime_dir();
  const std::string parent = first->scratch_dir();
  auto admin = client::AdminClient::Connect(dir, 5000);
  ASSERT_TRUE(admin.ok()) << admin.status().ToString();
  auto before = (*admin)->GetStatus();
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  first->Stop(SIGKILL, 5000);
  DaemonProcess::Options again;
  again.runtime_dir = dir;
  auto second = DaemonProcess::Start(again, &error);
  ASSERT_NE(second, nullptr) << error;
  struct stat st;
  ASSERT_EQ(stat(parent.c_str(), &st), 0);
  ASSERT_EQ(chmod(parent.c_str(), 0777), 0);
  auto refused = (*admin)->GetStatus();
  chmod(parent.c_str(), st.st_mode & 07777);
  EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("directory " + parent + " on its way has mode 0777"),
            std::string::npos)
      << refused.status().message();
  auto after = (*admin)->GetStatus();
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_NE(after->instance_id(), before->instance_id());
}

// Issue 38's review. The connect had no deadline: a daemon that is stopped
// (SIGSTOP) with its listen queue full hung every call of the client, with
// its lock held, for ever. Here the "daemon" is a socket of this test that
// never accepts, with a queue of one, filled first.
TEST(DaemonTrust, ADaemonThatAcceptsNothingIsUnavailableWithinTheDeadline) {
  Scratch scratch;
  const std::string run = scratch.Dir("run", 0, 0755);
  const std::string sock = run + "/memoffload.sock";
  const int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, sock.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 0), 0);
  std::vector<int> queued;
  for (int i = 0; i < 16; ++i) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      break;
    }
    queued.push_back(fd);
  }
  ASSERT_FALSE(queued.empty());
  auto outcome = std::async(std::launch::async, [&] {
    const auto start = std::chrono::steady_clock::now();
    auto admin = client::AdminClient::Connect(run, 1000);
    return std::make_pair(admin.ok() ? Status::Ok() : admin.status(),
                          std::chrono::steady_clock::now() - start);
  });
  ASSERT_EQ(outcome.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "the client waited on a daemon that accepts nothing";
  const auto [status, took] = outcome.get();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
  EXPECT_NE(status.message().find("did not accept a connection within"), std::string::npos)
      << status.message();
  EXPECT_LT(took, std::chrono::seconds(5));
  for (int fd : queued) close(fd);
  close(listener);
}

// A runtime dir whose resolved path is longer than a socket address holds
// (108 bytes) is reached through a descriptor of the dir; before, the
// resolved path was refused as too long although a short link to it worked.
TEST(DaemonTrust, ARuntimeDirWithALongResolvedPathIsReachedByALink) {
  Scratch scratch;
  const std::string deep = scratch.Dir(std::string(120, 'd'), 0, 0755);
  const std::string link = scratch.path() + "/s";
  ASSERT_EQ(symlink(deep.c_str(), link.c_str()), 0);
  std::string error;
  DaemonProcess::Options options;
  options.runtime_dir = link + "/run";
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto admin = client::AdminClient::Connect(link + "/run", 5000);
  ASSERT_TRUE(admin.ok()) << admin.status().ToString();
  auto status = (*admin)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  client::AttachOptions attach;
  attach.runtime_dir = link + "/run";
  auto c = client::Client::Attach(attach);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE((*c)->Reserve(1, 4096).ok());
}

// /run/memoffload can only be made by root, so its owner (root or the
// unit's user) is trusted whoever it is. A /run/memoffload that is a
// symlink to a dir another uid owns is that dir: the rules of an explicit
// dir apply, not "any owner".
TEST(DaemonTrust, TheSystemDirsAnyOwnerRuleIsForTheRealDirOnly) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as another uid";
  Scratch scratch;
  const std::string theirs = scratch.Dir("theirs", kAttacker, 0755);
  const std::string link = scratch.path() + "/memoffload";
  ASSERT_EQ(symlink(theirs.c_str(), link.c_str()), 0);
  RuntimeDirChoice choice{link, RuntimeDirSource::kSystem};
  Result<client::TrustedRuntimeDir> dir = client::VerifyRuntimeDir(choice);
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.status().code(), StatusCode::kPermissionDenied) << dir.status().ToString();
  EXPECT_NE(dir.status().message().find("belongs to uid " + Str(kAttacker)), std::string::npos)
      << dir.status().message();
}

}  // namespace
}  // namespace memoffload::testing
