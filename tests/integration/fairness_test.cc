// No tenant can starve another (issue 13, items 4 and 5) against the real
// daemon: another uid's waiter does not refuse a Reserve that fits, waiting
// costs no daemon thread and ends with the shortfall named, a waiter whose
// caller cancels is dropped at once (issue 29), and the limits on waiters,
// extents per Reserve and groups per session hold.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <thread>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/common/runtime_dir.h"
#include "memoffload/v1/memoffload.grpc.pb.h"
#include "raw_attach.h"

namespace memoffload::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;
using Clock = std::chrono::steady_clock;

// Reads from fd until EOF or `until` appears, for up to timeout_ms.
std::string ReadUntil(int fd, const std::string& until, int timeout_ms) {
  std::string out;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline && (until.empty() || out.find(until) == std::string::npos)) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Polls `condition` until it holds or timeout_ms passes.
template <typename F>
bool WaitUntil(F condition, int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!condition()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

std::unique_ptr<client::Client> AttachRoot(const DaemonProcess& daemon) {
  client::AttachOptions attach;
  attach.runtime_dir = daemon.runtime_dir();
  auto c = client::Client::Attach(attach);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

// Seen before the fix: 0 of 245 plain Reserves of another tenant succeeded
// while one waiter could not fit ("behind 1 earlier waiting reserve").
TEST(Fairness, AnotherTenantsWaiterDoesNotRefuseReservesThatFit) {
  std::string error;
  DaemonProcess::Options options = TwoTenantOptions("64MiB", "16MiB");
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;

  // Tenant B (uid 65534) takes one chunk, then waits for the go file.
  const std::string go_file = daemon->scratch_dir() + "/go";
  int out_fd = -1;
  const pid_t b = Spawn({BinDir() + "/offload_worker", "reserve-loop-as", daemon->runtime_dir(),
                         "65534", go_file, "200", std::to_string(kMiB)},
                        &out_fd);
  ASSERT_GT(b, 0);
  std::string out = ReadUntil(out_fd, "READY", 20000);
  ASSERT_NE(out.find("READY"), std::string::npos) << out << daemon->Log();

  // Tenant A (root) holds the other three chunks and waits for 32 MiB more.
  auto a = AttachRoot(*daemon);
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(a->Reserve(1, 48 * kMiB).ok());
  std::atomic<bool> a_served{false};
  std::thread waiter([&] {
    client::ReserveOptions wait;
    wait.wait_for_space = true;
    wait.wait_timeout_ms = 20000;
    auto r = a->Reserve(2, 32 * kMiB, wait);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    a_served = r.ok();
  });
  ASSERT_TRUE(WaitUntil([&] { return daemon->Status().waiting_reserves() == 1; }, 10000));

  // B's plain Reserves that fit in its own chunk all succeed meanwhile.
  { std::ofstream(go_file) << "go"; }
  out += ReadUntil(out_fd, "\n", 30000);
  out += ReadUntil(out_fd, "", 200);
  close(out_fd);
  EXPECT_EQ(WaitFor(b, 10000), 0);
  EXPECT_NE(out.find("OK 200 FAIL 0"), std::string::npos) << out;
  EXPECT_EQ(daemon->Status().waiting_reserves(), 1u) << "A's waiter should still wait";

  // A's waiter is served once A's own bytes come back.
  const Status released = a->Release(1);
  EXPECT_TRUE(released.ok()) << released.ToString() << "\n" << daemon->Log();
  waiter.join();
  EXPECT_TRUE(a_served);
}

// Issue 29: a waiting Reserve whose caller cancelled stayed queued until
// quotas.max_wait, and, aged, kept its bytes free from every other tenant:
// another uid's Reserve that fitted was refused the whole time. The caller
// here is a raw gRPC client (its session stays open) that cancels its call.
// Seen before the fix: the waiter still queued after 5 s, and uid 65534's
// 16 MiB refused with "32.00 MiB available (...; 48.00 MiB kept free for an
// older waiting reserve of another tenant".
TEST(Fairness, ACancelledWaiterIsDroppedAtOnceAndHoldsNoBytesFromAnotherTenant) {
  std::string error;
  DaemonProcess::Options options = TwoTenantOptions("64MiB", "16MiB");
  options.extra_args.push_back("--reserve-aging=0s");  // every waiter is aged at once
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  int lifeline = -1;
  auto me = RawAttach(daemon->runtime_dir(), "a", &lifeline);
  ASSERT_TRUE(me.ok()) << me.status().ToString();
  auto stub = v1::Offload::NewStub(grpc::CreateChannel(
      "unix:" + GrpcSocketPath(daemon->runtime_dir()), grpc::InsecureChannelCredentials()));
  auto request = [&](uint64_t group, uint64_t bytes, bool wait) {
    v1::ReserveRequest req;
    req.mutable_session()->set_session_id(me->session_id);
    req.mutable_session()->set_session_token(me->session_token);
    req.set_group_id(group);
    req.set_size_bytes(bytes);
    req.set_wait_for_space(wait);
    return req;
  };
  {
    grpc::ClientContext ctx;
    v1::ReserveResponse resp;
    const grpc::Status held = stub->Reserve(&ctx, request(1, 32 * kMiB, false), &resp);
    ASSERT_TRUE(held.ok()) << held.error_message();
  }
  // 48 MiB do not fit in the 32 MiB left: it waits (no deadline: until
  // quotas.max_wait, 30 s).
  grpc::ClientContext wait_ctx;
  const v1::ReserveRequest wait_req = request(2, 48 * kMiB, true);
  v1::ReserveResponse wait_resp;
  std::promise<grpc::Status> answered;
  stub->async()->Reserve(&wait_ctx, &wait_req, &wait_resp,
                         [&answered](grpc::Status st) { answered.set_value(std::move(st)); });
  ASSERT_TRUE(WaitUntil([&] { return daemon->Status().waiting_reserves() == 1; }, 10000));
  wait_ctx.TryCancel();
  EXPECT_EQ(answered.get_future().get().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitUntil([&] { return daemon->Status().waiting_reserves() == 0; }, 5000))
      << daemon->Status().waiting_reserves() << " waiting 5 s after the cancel";

  // Another uid's Reserve that fits is served now.
  std::string out;
  EXPECT_EQ(RunCapture({BinDir() + "/offload_worker", "job-as", daemon->runtime_dir(), "65534", "b",
                        std::to_string(16 * kMiB), "0"},
                       &out),
            0)
      << out;
  EXPECT_EQ(out.rfind("RESERVED " + std::to_string(16 * kMiB), 0), 0u) << out;
  close(lifeline);
}

// Seen before the fix: 1024 waiters took 1036 daemon threads and all got
// DEADLINE_EXCEEDED.
TEST(Fairness, ThousandWaitersHoldNoThreadAndHearTheShortfallBeforeTheirDeadline) {
  std::string error;
  DaemonProcess::Options options;
  options.arena_size = "64MiB";
  options.chunk_size = "16MiB";
  options.extra_args = {"--max-waiting-reserves-per-tenant=1024"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto a = AttachRoot(*daemon);
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(a->Reserve(1, 64 * kMiB).ok());
  const int threads_before = ThreadCount(daemon->pid());

  constexpr int kWaiters = 1024;
  std::vector<Status> answers(kWaiters, Status::Ok());
  std::vector<std::thread> callers;
  callers.reserve(kWaiters);
  for (int i = 0; i < kWaiters; ++i) {
    callers.emplace_back([&, i] {
      client::ReserveOptions wait;
      wait.wait_for_space = true;
      wait.wait_timeout_ms = 8000;
      auto r = a->Reserve(100 + i, kMiB, wait);
      answers[i] = r.ok() ? Status::Ok() : r.status();
    });
  }
  ASSERT_TRUE(WaitUntil([&] { return daemon->Status().waiting_reserves() == kWaiters; }, 8000))
      << daemon->Status().waiting_reserves() << " waiting";
  const int threads_waiting = ThreadCount(daemon->pid());
  // One more is over quotas.max_waiting_reserves (1024) and hears so at once.
  client::ReserveOptions wait;
  wait.wait_for_space = true;
  wait.wait_timeout_ms = 8000;
  auto over = a->Reserve(99, kMiB, wait);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("quotas.max_waiting_reserves is 1024"), std::string::npos)
      << over.status().message();
  for (std::thread& t : callers) t.join();

  std::printf("daemon threads: %d before, %d with %d waiters\n", threads_before, threads_waiting,
              kWaiters);
  EXPECT_LT(threads_waiting, threads_before + 32);
  int exhausted = 0;
  for (const Status& st : answers) {
    if (st.code() == StatusCode::kResourceExhausted &&
        st.message().find("until the deadline") != std::string::npos &&
        st.message().find("short by") != std::string::npos) {
      ++exhausted;
    } else {
      ADD_FAILURE() << st.ToString();
      break;
    }
  }
  EXPECT_EQ(exhausted, kWaiters);
  EXPECT_EQ(daemon->Status().waiting_reserves(), 0u);
}

// Seen before the fix: a fragmented arena returned 31,672 extents; a reply
// above the client's receive limit left the space reserved.
TEST(Limits, AReserveOverTheExtentLimitFailsAndReservesNothing) {
  std::string error;
  DaemonProcess::Options options;
  options.arena_size = "64MiB";
  options.chunk_size = "64MiB";
  options.extra_args = {"--max-extents-per-reserve=4"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto a = AttachRoot(*daemon);
  ASSERT_NE(a, nullptr);
  for (uint64_t g = 1; g <= 16; ++g) ASSERT_TRUE(a->Reserve(g, 4 * kMiB).ok());
  for (uint64_t g = 1; g <= 16; g += 2) ASSERT_TRUE(a->Release(g).ok());
  // Eight separate 4 MiB holes: 32 MiB would take eight extents.
  const v1::GetStatusResponse before = daemon->Status();
  auto r = a->Reserve(100, 32 * kMiB);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("quotas.max_extents_per_reserve (4)"), std::string::npos)
      << r.status().message();
  const v1::GetStatusResponse after = daemon->Status();
  EXPECT_EQ(after.used_bytes(), before.used_bytes());
  EXPECT_EQ(after.groups(), before.groups());
  EXPECT_TRUE(a->Reserve(101, 16 * kMiB).ok());  // four extents: within the limit
}

TEST(Limits, GroupsPerSessionAreBounded) {
  std::string error;
  DaemonProcess::Options options;
  options.arena_size = "64MiB";
  options.chunk_size = "64MiB";
  options.extra_args = {"--max-groups-per-session=8"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto a = AttachRoot(*daemon);
  ASSERT_NE(a, nullptr);
  for (uint64_t g = 1; g <= 8; ++g) ASSERT_TRUE(a->Reserve(g, 4096).ok());
  auto r = a->Reserve(9, 4096);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("quotas.max_groups_per_session is 8"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(daemon->Status().groups(), 8u);
  ASSERT_TRUE(a->Release(1).ok());
  EXPECT_TRUE(a->Reserve(9, 4096).ok());
}

}  // namespace
}  // namespace memoffload::testing
