// Client::ForEachPiece, the one walk over an extent stream (Client::Write
// and Read, the torch layer's copies), against the real daemon with chunks
// small enough that a region spans several extents.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"

namespace memoffload::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

TEST(ClientForEachPiece, WalksTheRangeInOrderAndStopsAtTheFirstError) {
  std::string error;
  DaemonProcess::Options small_chunks;
  small_chunks.chunk_size = "4MiB";
  auto daemon = DaemonProcess::Start(small_chunks, &error);
  ASSERT_NE(daemon, nullptr) << error;
  client::AttachOptions options;
  options.runtime_dir = daemon->runtime_dir();
  options.job_id = "pieces";
  auto c = client::Client::Attach(options);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto r = (*c)->CreateRegion("pieces", 10 * kMiB);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const std::vector<Extent>& extents = r->extents;
  ASSERT_GE(extents.size(), 3u);
  const uint64_t offset = extents[0].length - 5;  // the last 5 bytes of the first extent
  const uint64_t length = 5 * kMiB;
  std::vector<uint64_t> sizes;
  uint64_t expect_done = 0;
  Status st =
      (*c)->ForEachPiece(extents, offset, length, [&](uint8_t* p, uint64_t done, uint64_t n) {
        EXPECT_EQ(done, expect_done);
        EXPECT_EQ(p, (*c)->Address(
                         Extent{extents[sizes.size()].chunk,
                                extents[sizes.size()].offset + (sizes.empty() ? offset : 0), n}));
        sizes.push_back(n);
        expect_done += n;
        return Status::Ok();
      });
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(std::accumulate(sizes.begin(), sizes.end(), uint64_t{0}), length);
  EXPECT_EQ(sizes.front(), 5u);

  int calls = 0;
  st = (*c)->ForEachPiece(extents, 0, 10 * kMiB, [&](uint8_t*, uint64_t, uint64_t) {
    return ++calls == 2 ? DeadlineExceeded("stop") : Status::Ok();
  });
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(calls, 2);

  const auto none = [](uint8_t*, uint64_t, uint64_t) { return Status::Ok(); };
  EXPECT_EQ((*c)->ForEachPiece(extents, 10 * kMiB - 1, 2, none).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->ForEachPiece({Extent{9999, 0, 16}}, 0, 16, none).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace memoffload::testing
