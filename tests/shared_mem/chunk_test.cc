#include "memoffload/shared_mem/chunk.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "memoffload/common/units.h"

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

// Pages of [data, data + length) that this process has mapped and resident.
size_t ResidentPages(const uint8_t* data, uint64_t length) {
  const uint64_t page = SystemPageBytes();
  std::vector<unsigned char> v((length + page - 1) / page);
  if (mincore(const_cast<uint8_t*>(data), length, v.data()) != 0) return 0;
  size_t n = 0;
  for (unsigned char b : v) n += b & 1;
  return n;
}

TEST(Chunk, PrefaultInPiecesFaultsEveryPageOfAnUnevenRangeAndKeepsContents) {
  const uint64_t page = SystemPageBytes();
  const uint64_t size = 5 * Chunk::kMmapLockPiece + 3 * page;  // not a whole number of pieces
  Result<Chunk> c = Chunk::Create("pieces", size, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  c->data()[size - 1] = 9;
  ASSERT_TRUE(c->Prefault(page, size - page, Chunk::kMmapLockPiece).ok());
  EXPECT_EQ(ResidentPages(c->data() + page, size - page), (size - page) / page);
  EXPECT_EQ(c->data()[size - 1], 9);
}

TEST(Chunk, ResetUnmapsTheWholeMapping) {
  const uint64_t size = 3 * Chunk::kMmapLockPiece + 4 * SystemPageBytes();
  Result<Chunk> c = Chunk::Create("unmap", size, false);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c->Prefault(0, size).ok());
  uint8_t* data = c->data();
  { Chunk gone = std::move(c).value(); }
  // Every page of the old range, the tail after the last whole piece
  // included, is unmapped: mincore says ENOMEM for any unmapped page.
  const uint64_t page = SystemPageBytes();
  for (uint64_t off = 0; off < size; off += page) {
    unsigned char v = 0;
    ASSERT_EQ(mincore(data + off, page, &v), -1) << "page at " << off << " still mapped";
    ASSERT_EQ(errno, ENOMEM);
  }
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

namespace memoffload {
namespace {

// PagesOf reads every asked mapping from one pass over /proc/self/smaps
// (the kernel walks all page tables for each read), in the order asked.
TEST(ChunkPages, PagesOfReportsEachMappingInOnePass) {
  Result<Chunk> a = Chunk::Create("pages-a", 4 << 20, false);
  Result<Chunk> b = Chunk::Create("pages-b", 2 << 20, false);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(a->Prefault(0, 4 << 20).ok());
  Result<std::vector<MappingPages>> pages = PagesOf({b->data(), a->data()});
  ASSERT_TRUE(pages.ok()) << pages.status().ToString();
  ASSERT_EQ(pages->size(), 2u);
  EXPECT_EQ((*pages)[0].size_bytes, 2u << 20);
  EXPECT_EQ((*pages)[1].size_bytes, 4u << 20);
  EXPECT_EQ((*pages)[1].rss_bytes, 4u << 20);  // pre-faulted
  EXPECT_EQ((*pages)[0].rss_bytes, 0u);
  // Every mapping starts 2 MiB-aligned (for transparent huge pages).
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % (2 << 20), 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % (2 << 20), 0u);
  int local = 0;
  EXPECT_EQ(PagesOf({&local}).status().code(), StatusCode::kNotFound);
}

TEST(ChunkPages, SelectedWordOfASysfsChoice) {
  EXPECT_EQ(SelectedWord("always within_size advise [never] deny force\n"), "never");
  EXPECT_EQ(SelectedWord("[inherit] advise"), "inherit");
  EXPECT_EQ(SelectedWord("no choice"), "");
  EXPECT_TRUE((ShmemThpSetting{"advise", "inherit"}).allows_advised());
  EXPECT_FALSE((ShmemThpSetting{"advise", "never"}).allows_advised());
  EXPECT_TRUE((ShmemThpSetting{"never", "advise"}).allows_advised());
  EXPECT_FALSE((ShmemThpSetting{"deny", "inherit"}).allows_advised());
}

}  // namespace
}  // namespace memoffload
