// HostBlocks (client/host_blocks.h) against the real daemon: blocks are
// contiguous, exactly page-rounded, counted by the daemon as committed
// bytes of the session, refused with the daemon's code and message when a
// quota or the chunk size says no, freed by Free, by the destructor, and by
// the daemon when the process holding them dies.
#include "memoffload/client/host_blocks.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"

namespace memoffload::testing {
namespace {

using client::HostBlock;
using client::HostBlocks;

constexpr uint64_t kMiB = 1 << 20;

std::unique_ptr<DaemonProcess> StartDaemon(std::vector<std::string> extra = {}) {
  DaemonProcess::Options options;
  options.arena_size = "256MiB";
  options.chunk_size = "16MiB";
  options.extra_args = std::move(extra);
  std::string error;
  auto d = DaemonProcess::Start(options, &error);
  EXPECT_NE(d, nullptr) << error;
  return d;
}

std::shared_ptr<client::Client> Attach(const DaemonProcess& d) {
  client::AttachOptions options;
  options.runtime_dir = d.runtime_dir();
  options.job_id = "train";
  options.rank = 0;
  auto c = client::Client::Attach(options);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::shared_ptr<client::Client>(std::move(c).value()) : nullptr;
}

TEST(HostBlocks, AreContiguousExactAndCountedAsCommitted) {
  auto d = StartDaemon();
  ASSERT_NE(d, nullptr);
  auto blocks = std::make_unique<HostBlocks>(Attach(*d));
  const uint64_t page = blocks->client()->page_bytes();
  // Sizes that a power-of-two allocator would nearly double.
  const std::vector<uint64_t> sizes = {1, 5 * kMiB + 17, 9 * kMiB, 16 * kMiB};
  std::vector<HostBlock> held;
  uint64_t expected = 0;
  for (uint64_t size : sizes) {
    Result<HostBlock> b = blocks->Allocate(size);
    ASSERT_TRUE(b.ok()) << size << ": " << b.status().ToString();
    EXPECT_EQ(b->held_bytes, (size + page - 1) / page * page);
    // Writable over its whole size, and it keeps what was written.
    std::memset(b->address, static_cast<int>(held.size() + 1), size);
    held.push_back(*b);
    expected += b->held_bytes;
  }
  for (size_t i = 0; i < held.size(); ++i) {
    EXPECT_EQ(held[i].address[0], i + 1);
    EXPECT_EQ(held[i].address[held[i].size_bytes - 1], i + 1);
    EXPECT_TRUE(blocks->Holds(held[i].address));
    EXPECT_TRUE(blocks->Holds(held[i].address + held[i].size_bytes - 1));
  }
  int on_the_stack = 0;
  EXPECT_FALSE(blocks->Holds(&on_the_stack));
  v1::GetStatusResponse s = d->Status();
  EXPECT_EQ(s.committed_bytes(), expected);
  EXPECT_EQ(s.reserved_bytes(), 0u);
  EXPECT_EQ(blocks->stats().held_bytes, expected);
  EXPECT_EQ(blocks->stats().blocks, sizes.size());

  ASSERT_TRUE(blocks->Free(held[1].group_id).ok());
  EXPECT_FALSE(blocks->Holds(held[1].address));
  EXPECT_EQ(blocks->Free(held[1].group_id).code(), StatusCode::kNotFound);
  EXPECT_EQ(d->Status().committed_bytes(), expected - held[1].held_bytes);
  blocks.reset();  // frees the rest
  EXPECT_EQ(d->Status().used_bytes(), 0u);
}

TEST(HostBlocks, RefusalsKeepTheDaemonsCodeAndMessage) {
  auto d = StartDaemon({"--session-max-bytes=24MiB"});
  ASSERT_NE(d, nullptr);
  HostBlocks blocks(Attach(*d));
  // Larger than a chunk: never contiguous.
  Result<HostBlock> big = blocks.Allocate(16 * kMiB + 1);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("larger than a chunk"), std::string::npos)
      << big.status().message();
  ASSERT_TRUE(blocks.Allocate(16 * kMiB).ok());
  Result<HostBlock> over = blocks.Allocate(9 * kMiB);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("session limit"), std::string::npos)
      << over.status().message();
  EXPECT_EQ(blocks.Allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(blocks.stats().refused, 3u);
  EXPECT_EQ(blocks.stats().blocks, 1u);
}

TEST(HostBlocks, TheDaemonFreesThemWhenTheProcessDies) {
  auto d = StartDaemon();
  ASSERT_NE(d, nullptr);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    client::AttachOptions options;
    options.runtime_dir = d->runtime_dir();
    options.job_id = "train";
    auto c = client::Client::Attach(options);
    if (!c.ok()) _exit(2);
    HostBlocks blocks(std::shared_ptr<client::Client>(std::move(c).value()));
    if (!blocks.Allocate(12 * kMiB).ok()) _exit(3);
    const char one = 1;
    if (write(ready[1], &one, 1) != 1) _exit(4);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char got = 0;
  ASSERT_EQ(read(ready[0], &got, 1), 1);
  close(ready[0]);
  EXPECT_EQ(d->Status().committed_bytes(), 12 * kMiB);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (d->Status().used_bytes() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(d->Status().used_bytes(), 0u) << "not freed within 1 s of the SIGKILL";
}

}  // namespace
}  // namespace memoffload::testing
