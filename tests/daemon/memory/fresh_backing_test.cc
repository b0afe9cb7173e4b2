// FreshBacking (daemon/memory/fresh_backing.cc): new memfds never faulted on the
// caller's thread, a spare kept ready once tenants change, and retired
// memfds counted as stale exactly while another process keeps them.
#include "memory/fresh_backing.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "memoffload/shared_mem/fd_passing.h"

namespace memoffload::daemon {
namespace {

constexpr uint64_t kChunk = 1 << 20;

template <typename Pred>
bool WaitUntil(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

FreshBackingOptions Options() {
  FreshBackingOptions o;
  o.chunk_size_bytes = kChunk;
  o.spares = 1;
  o.scan_interval = std::chrono::milliseconds(20);
  return o;
}

TEST(FreshBackingTest, SparesAreMadeOnlyOnceTenantsChangeAndServeTheNextChange) {
  FreshBacking fresh(Options());
  EXPECT_EQ(fresh.Stats().spares, 0u);  // nothing changed tenant: no RAM spent
  auto first = fresh.Take(kChunk);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ((*first)->size_bytes(), kChunk);
  EXPECT_EQ(fresh.Stats().taken_unfaulted, 1u);
  ASSERT_TRUE(WaitUntil([&] { return fresh.Stats().spares == 1; }));
  auto second = fresh.Take(kChunk);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(fresh.Stats().taken, 2u);
  EXPECT_EQ(fresh.Stats().taken_unfaulted, 1u);  // the spare served it
  for (const auto& c : {*first, *second}) {
    EXPECT_TRUE(
        std::all_of(c->data(), c->data() + c->size_bytes(), [](uint8_t b) { return b == 0; }));
  }
  // Another size (a short last chunk) is never a spare: made on the spot.
  auto odd = fresh.Take(kChunk / 2);
  ASSERT_TRUE(odd.ok());
  EXPECT_EQ((*odd)->size_bytes(), kChunk / 2);
}

TEST(FreshBackingTest, RetiredBackingIsStaleWhileAnotherProcessKeepsIt) {
  FreshBacking fresh(Options());
  auto taken = fresh.Take(kChunk);
  ASSERT_TRUE(taken.ok());
  std::shared_ptr<Chunk> c = std::move(taken).value();
  std::memset(c->data(), 0xA1, c->size_bytes());
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Keeps the inherited mapping (and fd) of the old backing.
    char one = 1;
    if (write(ready[1], &one, 1) != 1) _exit(1);
    while (true) pause();
  }
  char one = 0;
  ASSERT_EQ(read(ready[0], &one, 1), 1);
  fresh.Retire(std::move(c));  // the daemon's last reference
  FreshBackingStats s = fresh.ScanNow();
  EXPECT_EQ(s.stale_backings, 1u);
  EXPECT_EQ(s.stale_bytes, kChunk);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  close(ready[0]);
  close(ready[1]);
  EXPECT_TRUE(WaitUntil([&] { return fresh.Stats().stale_bytes == 0; }));
}

// The arena's first backings are named memoffload-chunk-N, not like the
// fresh ones; a process that kept only the mapping (fd closed) of one of
// them keeps it just the same.
TEST(FreshBackingTest, RetiredArenaChunkKeptOnlyByAMappingIsStale) {
  FreshBacking fresh(Options());
  Result<Chunk> created = Chunk::Create("memoffload-chunk-0", kChunk, false);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto c = std::make_shared<Chunk>(std::move(created).value());
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(c->fd());  // only the inherited mapping stays
    char one = 1;
    if (write(ready[1], &one, 1) != 1) _exit(1);
    while (true) pause();
  }
  char one = 0;
  ASSERT_EQ(read(ready[0], &one, 1), 1);
  fresh.Retire(std::move(c));
  EXPECT_EQ(fresh.ScanNow().stale_backings, 1u);
  EXPECT_EQ(fresh.ScanNow().stale_bytes, kChunk);  // a second scan keeps it
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  close(ready[0]);
  close(ready[1]);
  EXPECT_EQ(fresh.ScanNow().stale_bytes, 0u);
}

// The daemon as a user that may not read the keeper's /proc entries (the
// systemd unit runs it as memoffload, with ProtectProc=invisible): the
// process the backing was handed to counts as keeping it while it lives.
TEST(FreshBackingTest, RecipientTheDaemonCannotSeeKeepsItsBackingStaleUntilItExits) {
  ASSERT_EQ(geteuid(), 0u) << "runs the daemon side as uid 65534: needs root";
  int to_keeper[2], ready[2], results[2], go[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, to_keeper), 0);
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(results), 0);
  ASSERT_EQ(pipe(go), 0);
  const pid_t keeper = fork();  // root: maps the backing it is sent
  ASSERT_GE(keeper, 0);
  if (keeper == 0) {
    std::string payload;
    std::vector<int> fds;
    if (!RecvFrame(to_keeper[1], &payload, &fds).ok() || fds.size() != 1) _exit(1);
    if (mmap(nullptr, kChunk, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0) == MAP_FAILED) {
      _exit(1);
    }
    close(fds[0]);  // only the mapping stays
    char one = 1;
    if (write(ready[1], &one, 1) != 1) _exit(1);
    while (true) pause();
  }
  const pid_t daemon_side = fork();
  ASSERT_GE(daemon_side, 0);
  if (daemon_side == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    uint8_t out[3] = {0, 0, 0};
    {
      FreshBacking fresh(Options());
      auto taken = fresh.Take(kChunk);
      if (!taken.ok() || !SendFrame(to_keeper[0], "fd", {(*taken)->fd()}).ok()) _exit(3);
      char one = 0;
      if (read(ready[0], &one, 1) != 1) _exit(4);
      auto unnamed = fresh.Take(kChunk);
      if (!unnamed.ok()) _exit(5);
      fresh.Retire(std::move(taken).value(), {keeper});
      out[0] = static_cast<uint8_t>(fresh.ScanNow().stale_backings);
      if (read(go[0], &one, 1) != 1) _exit(6);  // the keeper is dead
      out[1] = static_cast<uint8_t>(fresh.ScanNow().stale_backings);
      // Handed to a process whose maps the scan reads (this one; it does not
      // keep it): judged by its maps, so gone at the first scan.
      fresh.Retire(std::move(unnamed).value(), {getpid()});
      out[2] = static_cast<uint8_t>(fresh.ScanNow().stale_backings);
    }
    _exit(write(results[1], out, sizeof(out)) == sizeof(out) ? 0 : 7);
  }
  uint8_t out[3] = {9, 9, 9};
  // Let it scan while the keeper lives, then end the keeper.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  kill(keeper, SIGKILL);
  waitpid(keeper, nullptr, 0);
  char one = 1;
  ASSERT_EQ(write(go[1], &one, 1), 1);
  ASSERT_EQ(read(results[0], out, sizeof(out)), static_cast<ssize_t>(sizeof(out)));
  int status = 0;
  waitpid(daemon_side, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(out[0], 1) << "a live recipient the daemon cannot see did not count as keeping it";
  EXPECT_EQ(out[1], 0) << "the recipient exited, yet its backing still counts";
  EXPECT_EQ(out[2], 0) << "a recipient whose maps the scan reads (not keeping it) still counts";
  for (int fd :
       {to_keeper[0], to_keeper[1], ready[0], ready[1], results[0], results[1], go[0], go[1]}) {
    close(fd);
  }
}

// The scan's per-recipient look at /proc (a poll and an open, slow on a
// loaded node) runs without FreshBacking's lock: Take, which SessionTable
// calls under its own lock from a Reserve, never waits for it.
TEST(FreshBackingTest, TakeDoesNotWaitForTheProcLookOfAScan) {
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> first{true};
  FreshBackingOptions options = Options();
  options.scan_interval = std::chrono::hours(1);  // one scan: the one Retire wakes
  options.proc_shows = [&](pid_t) {
    if (first.exchange(false)) {
      entered.set_value();
      released.wait();  // the scan stays in its /proc look until released
    }
    return true;
  };
  FreshBacking fresh(options);
  auto taken = fresh.Take(kChunk);
  ASSERT_TRUE(taken.ok());
  fresh.Retire(std::move(taken).value(), {getpid()});  // a live recipient
  ASSERT_EQ(entered.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "the scan never looked at the recipient";
  auto take = std::async(std::launch::async, [&] { return fresh.Take(kChunk).ok(); });
  const bool answered = take.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  release.set_value();
  EXPECT_TRUE(answered) << "Take waited for the scan's look at /proc";
  EXPECT_TRUE(take.get());
  // Its maps were readable and showed nothing: not stale.
  EXPECT_EQ(fresh.ScanNow().stale_backings, 0u);
}

TEST(FreshBackingTest, RetiredBackingNobodyKeepsIsNotStale) {
  FreshBacking fresh(Options());
  auto taken = fresh.Take(kChunk);
  ASSERT_TRUE(taken.ok());
  fresh.Retire(std::move(taken).value());
  EXPECT_EQ(fresh.ScanNow().stale_bytes, 0u);
}

}  // namespace
}  // namespace memoffload::daemon
