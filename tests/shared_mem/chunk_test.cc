#include "memoffload/shared_mem/chunk.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "memoffload/shared_mem/units.h"

namespace memoffload {
namespace {

TEST(Chunk, CreatedChunkIsSharedWithAMapping) {
  Result<Chunk> c = Chunk::Create("test", 4 * kMiB, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE(c->Prefault(0, 4 * kMiB).ok());
  c->data()[12345] = 0x5a;
  Result<Chunk> m = Chunk::Map(dup(c->fd()), 4 * kMiB, true);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->data()[12345], 0x5a);
  m->data()[999] = 0x11;  // writes through the second mapping are visible
  EXPECT_EQ(c->data()[999], 0x11);
}

TEST(Chunk, SealedAgainstShrinkAndGrow) {
  Result<Chunk> c = Chunk::Create("sealed", kMiB, false);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(ftruncate(c->fd(), 4096), 0);
  EXPECT_NE(ftruncate(c->fd(), 2 * kMiB), 0);
  const int seals = fcntl(c->fd(), F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_GROW);
}

TEST(Chunk, RejectsBadSizes) {
  EXPECT_EQ(Chunk::Create("bad", 0, false).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Chunk::Create("bad", 1000, false).status().code(), StatusCode::kInvalidArgument);
  Result<Chunk> c = Chunk::Create("small", kMiB, false);
  ASSERT_TRUE(c.ok());
  // Mapping more than the memfd holds is refused.
  EXPECT_EQ(Chunk::Map(dup(c->fd()), 2 * kMiB, false).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_FALSE(c->Prefault(0, 2 * kMiB).ok());
}

TEST(Chunk, PrefaultKeepsContents) {
  Result<Chunk> c = Chunk::Create("keep", kMiB, false);
  ASSERT_TRUE(c.ok());
  c->data()[4096 * 3] = 77;
  ASSERT_TRUE(c->Prefault(0, kMiB).ok());
  EXPECT_EQ(c->data()[4096 * 3], 77);
}

TEST(Chunk, MoveTransfersOwnership) {
  Result<Chunk> c = Chunk::Create("move", kMiB, false);
  ASSERT_TRUE(c.ok());
  Chunk a = std::move(c).value();
  const int fd = a.fd();
  Chunk b = std::move(a);
  EXPECT_FALSE(a.valid());
  EXPECT_EQ(b.fd(), fd);
  EXPECT_GE(fcntl(fd, F_GETFD), 0);
}

}  // namespace
}  // namespace memoffload
