// HandedChunks: the record of the chunks handed out reads back as written
// and marked, and is refused (so every chunk counts as handed out) when it
// is another daemon's, of another arena, or damaged.
#include "app/handed_chunks.h"

#include <gtest/gtest.h>
#include <unistd.h>

namespace memoffload::daemon {
namespace {

TEST(HandedChunks, ReadsBackWhatWasWrittenAndMarked) {
  auto made = HandedChunks::Create({false, true, false, false, false}, 42);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  HandedChunks& record = **made;
  record.Mark(3);
  record.Mark(3);
  record.Mark(99);  // out of range: ignored
  Result<std::vector<bool>> read = ReadHandedChunks(record.fd(), 5, 42);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, (std::vector<bool>{false, true, false, true, false}));
}

TEST(HandedChunks, AnotherDaemonsOrAnotherArenasOrADamagedOneIsNotBelieved) {
  auto made = HandedChunks::Create(std::vector<bool>(4, false), 42);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  const int fd = (*made)->fd();
  EXPECT_EQ(ReadHandedChunks(fd, 4, 43).status().code(), StatusCode::kFailedPrecondition);
  // The newest journal is an older daemon's (generation 0): never believed.
  EXPECT_EQ(ReadHandedChunks(fd, 4, 0).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadHandedChunks(fd, 5, 42).status().code(), StatusCode::kDataLoss);
  const char two = 2;
  ASSERT_EQ(pwrite(fd, &two, 1, 24 + 1), 1);
  Result<std::vector<bool>> read = ReadHandedChunks(fd, 4, 42);
  ASSERT_EQ(read.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(read.status().message(), "chunk 1 has byte 2");
  ASSERT_EQ(pwrite(fd, "NOTHANDE", 8, 0), 8);
  EXPECT_EQ(ReadHandedChunks(fd, 4, 42).status().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace memoffload::daemon
