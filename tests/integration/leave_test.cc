// A draining daemon asks the sessions that hold placed state (kind "state")
// to leave, on their broker connection (a Notice), and only them; a client
// that has not read the notice yet still gets its next reply (issue 42).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "daemon_process.h"
#include "memoffload/client/client.h"

namespace memoffload::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::unique_ptr<client::Client> Attach(const DaemonProcess& d, SessionKind kind) {
  client::AttachOptions options;
  options.runtime_dir = d.runtime_dir();
  options.job_id = "leave";
  options.kind = kind;
  auto c = client::Client::Attach(options);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

// Holds one committed group of 1 MiB, as a placed block does.
void Hold(client::Client* c, uint64_t group) {
  ASSERT_TRUE(c->Reserve(group, 1 << 20).ok());
  ASSERT_TRUE(c->Commit(group, 1 << 20).ok());
}

bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

int Ctl(const DaemonProcess& d, const std::string& command) {
  std::string out;
  return RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", d.runtime_dir(), command}, &out);
}

TEST(Leave, ADrainAsksOnlyStateSessionsToLeave) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto state = Attach(*daemon, SessionKind::kState);
  auto activations = Attach(*daemon, SessionKind::kActivations);
  auto other = Attach(*daemon, SessionKind::kOther);
  ASSERT_TRUE(state && activations && other);
  Hold(state.get(), 1);
  Hold(activations.get(), 1);
  EXPECT_FALSE(state->leave_requested());
  ASSERT_EQ(Ctl(*daemon, "drain"), 0);
  ASSERT_TRUE(WaitFor([&] { return state->leave_requested(); }, std::chrono::seconds(1)))
      << daemon->Log();
  EXPECT_EQ(state->leave_message(), "memoffloadd is draining (memoffloadctl drain)");
  EXPECT_FALSE(activations->leave_requested());
  EXPECT_FALSE(other->leave_requested());
  EXPECT_FALSE(state->session_lost());
  EXPECT_NE(daemon->Log().find("to move its placed state out"), std::string::npos);
  // Once per connection: a second drain (after an undrain) sends nothing more.
  ASSERT_EQ(Ctl(*daemon, "undrain"), 0);
  ASSERT_EQ(Ctl(*daemon, "drain"), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  size_t asked = 0;
  for (size_t at = 0;
       (at = daemon->Log().find("to move its placed state out", at)) != std::string::npos; ++at) {
    ++asked;
  }
  EXPECT_EQ(asked, 1u) << daemon->Log();
}

TEST(Leave, AClientAskingBeforeItReadTheNoticeGetsItsReply) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto state = Attach(*daemon, SessionKind::kState);
  ASSERT_TRUE(state);
  Hold(state.get(), 1);
  ASSERT_EQ(Ctl(*daemon, "drain"), 0);
  ASSERT_TRUE(WaitFor(
      [&] { return daemon->Log().find("to move its placed state out") != std::string::npos; },
      std::chrono::seconds(1)));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the notice is on its way
  // An exchange on the lifeline (the keys; this daemon serves none) skips the
  // notice and reads its own reply; the daemon does not take the unread
  // notice for a slow reader's reply.
  Result<client::Client::LinkKeys> keys = state->ReplicationKeys();
  EXPECT_EQ(keys.status().code(), StatusCode::kNotFound) << keys.status().ToString();
  EXPECT_TRUE(state->leave_requested());
  EXPECT_FALSE(state->session_lost()) << daemon->Log();
  EXPECT_EQ(daemon->Log().find("before reading its last reply"), std::string::npos)
      << daemon->Log();
  // Its groups are still served until it leaves.
  EXPECT_TRUE(state->Prefetch(1).ok());
}

TEST(Leave, ASigtermDaemonExitsOnceItsStateSessionLeft) {
  std::string error;
  DaemonProcess::Options options;
  options.drain_timeout = "30s";
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto state = Attach(*daemon, SessionKind::kState);
  ASSERT_TRUE(state);
  Hold(state.get(), 1);
  kill(daemon->pid(), SIGTERM);
  ASSERT_TRUE(WaitFor([&] { return state->leave_requested(); }, std::chrono::seconds(1)))
      << daemon->Log();
  EXPECT_EQ(state->leave_message(), "memoffloadd is shutting down (SIGTERM)");
  state.reset();  // the client moved its blocks out and leaves
  const auto left = Clock::now();
  const int status = daemon->Wait(5000);
  ASSERT_NE(status, -1) << daemon->Log();
  EXPECT_LT(Clock::now() - left, std::chrono::seconds(1));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace memoffload::testing
