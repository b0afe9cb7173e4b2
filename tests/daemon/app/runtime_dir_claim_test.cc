// RuntimeDirClaim: one claim per dir, and a claim removes only the files it
// created that are still the same files.
#include "app/runtime_dir_claim.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace memoffload::daemon {
namespace {

class RuntimeDirClaimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char name[] = "/tmp/memoffload-claim-XXXXXX";
    ASSERT_NE(mkdtemp(name), nullptr);
    scratch_ = name;
    dir_ = scratch_ + "/run";
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(scratch_, ignored);
  }
  std::string scratch_;
  std::string dir_;
};

TEST_F(RuntimeDirClaimTest, SecondClaimIsRefusedNamingTheHoldersPid) {
  auto first = RuntimeDirClaim::Claim(dir_);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = RuntimeDirClaim::Claim(dir_);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("another memoffloadd (pid " + std::to_string(getpid()) +
                                           ") is already serving"),
            std::string::npos)
      << second.status().message();
  first->reset();
  EXPECT_TRUE(RuntimeDirClaim::Claim(dir_).ok());
}

// lifecycle.take_over = "auto" takes the node over exactly while a daemon
// holds the lock, and a probe leaves no lock behind.
TEST_F(RuntimeDirClaimTest, HeldWhileAClaimLives) {
  EXPECT_FALSE(RuntimeDirClaim::Held(dir_));  // no dir yet
  auto claim = RuntimeDirClaim::Claim(dir_);
  ASSERT_TRUE(claim.ok()) << claim.status().ToString();
  EXPECT_TRUE(RuntimeDirClaim::Held(dir_));
  EXPECT_TRUE(RuntimeDirClaim::Held(dir_));
  const std::string lock = dir_ + "/" + kInstanceLockName;
  claim->reset();
  ASSERT_TRUE(std::filesystem::exists(scratch_));
  std::filesystem::create_directory(dir_);
  std::ofstream(lock) << "4242\n";  // a stale lock file of a dead daemon
  EXPECT_FALSE(RuntimeDirClaim::Held(dir_));
  auto again = RuntimeDirClaim::Claim(dir_);  // the probe held nothing
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

// flock needs only a read-only fd: a lock file others may open is one they
// may hold. A fresh one is 0600; one of an earlier version (0644), which
// another uid may have kept open, is replaced, so its old fd holds nothing.
TEST_F(RuntimeDirClaimTest, TheLockIsPrivateAndAnOpenOldOneIsReplaced) {
  const std::string lock = dir_ + "/" + kInstanceLockName;
  {
    auto claim = RuntimeDirClaim::Claim(dir_);
    ASSERT_TRUE(claim.ok()) << claim.status().ToString();
    struct stat st {};
    ASSERT_EQ(stat(lock.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0600u);
  }
  std::filesystem::create_directory(dir_);
  std::ofstream(lock) << "1\n";
  ASSERT_EQ(chmod(lock.c_str(), 0644), 0);
  const int kept = open(lock.c_str(), O_RDONLY | O_CLOEXEC);  // another uid's, kept open
  ASSERT_GE(kept, 0);
  struct stat old_file {
  }, now{};
  ASSERT_EQ(fstat(kept, &old_file), 0);
  {
    auto claim = RuntimeDirClaim::Claim(dir_);
    ASSERT_TRUE(claim.ok()) << claim.status().ToString();
    ASSERT_EQ(stat(lock.c_str(), &now), 0);
    EXPECT_EQ(now.st_mode & 07777, 0600u);
    EXPECT_NE(now.st_ino, old_file.st_ino);
    EXPECT_NE(flock(kept, LOCK_EX | LOCK_NB), 0);  // the old file stays locked meanwhile
    EXPECT_TRUE(RuntimeDirClaim::Held(dir_));
  }
  // Holding the old file blocks nobody.
  ASSERT_EQ(flock(kept, LOCK_EX | LOCK_NB), 0);
  EXPECT_FALSE(RuntimeDirClaim::Held(dir_));
  EXPECT_TRUE(RuntimeDirClaim::Claim(dir_).ok());
  close(kept);
}

TEST_F(RuntimeDirClaimTest, RemovesOnlyItsOwnFilesAndTheDirItCreated) {
  {
    auto claim = RuntimeDirClaim::Claim(dir_);
    ASSERT_TRUE(claim.ok());
    Result<int> fd = (*claim)->ListenUnix(dir_ + "/broker.sock", 0660, static_cast<gid_t>(-1));
    ASSERT_TRUE(fd.ok()) << fd.status().ToString();
    close(*fd);
    std::ofstream(dir_ + "/admin.token") << "x";
    (*claim)->Own(dir_ + "/admin.token");
    // Someone else's file now stands where ours was.
    ASSERT_EQ(unlink((dir_ + "/admin.token").c_str()), 0);
    std::ofstream(dir_ + "/admin.token") << "theirs";
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/broker.sock"));
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/admin.token"));
  EXPECT_TRUE(std::filesystem::exists(dir_));  // not empty: kept
  ASSERT_EQ(unlink((dir_ + "/admin.token").c_str()), 0);
  {
    auto claim = RuntimeDirClaim::Claim(dir_);  // exists now: not created by it
    ASSERT_TRUE(claim.ok());
  }
  EXPECT_TRUE(std::filesystem::exists(dir_));
  std::filesystem::remove_all(dir_);
  { ASSERT_TRUE(RuntimeDirClaim::Claim(dir_).ok()); }
  EXPECT_FALSE(std::filesystem::exists(dir_)) << "a claim that created the dir removes it";
}

TEST_F(RuntimeDirClaimTest, RefusesADirWritableByOthers) {
  ASSERT_EQ(mkdir(dir_.c_str(), 0755), 0);
  ASSERT_EQ(chmod(dir_.c_str(), 0775), 0);
  auto claim = RuntimeDirClaim::Claim(dir_);
  ASSERT_FALSE(claim.ok());
  EXPECT_NE(claim.status().message().find("has mode 0775"), std::string::npos)
      << claim.status().message();
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
}

}  // namespace
}  // namespace memoffload::daemon
