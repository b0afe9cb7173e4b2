// The fixture of the SessionTable unit tests: a table over a small arena
// (four 1 MiB chunks) with the default policy, and sessions opened with
// the limits a test asks for.
#ifndef MEMOFFLOAD_TESTS_DAEMON_SESSION_TABLE_FIXTURE_H_
#define MEMOFFLOAD_TESTS_DAEMON_SESSION_TABLE_FIXTURE_H_

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "core/session_table.h"
#include "test_arena.h"

namespace memoffload::daemon {

class SessionTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    arena_ = MakeTestArena();
    ASSERT_NE(arena_, nullptr);
    table_ = std::make_unique<SessionTable>(arena_.get(), Policy{});
  }
  void TearDown() override { EXPECT_TRUE(table_->CheckInvariants().ok()); }

  SessionGrant Open(uint64_t max_bytes = 0, const std::string& job = "job",
                    uint64_t job_max_bytes = 0, uid_t uid = 1000) {
    Hello hello;
    hello.job_id = job;
    hello.rank = 3;
    hello.max_bytes = max_bytes;
    hello.job_max_bytes = job_max_bytes;
    auto g = table_->Open(hello, PeerCredentials{1234, uid, uid});
    EXPECT_TRUE(g.ok());
    return *g;
  }

  std::unique_ptr<Arena> arena_;
  std::unique_ptr<SessionTable> table_;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_TESTS_DAEMON_SESSION_TABLE_FIXTURE_H_
