#include "memoffload/daemon/config.h"

#include <gtest/gtest.h>

#include <vector>

#include "memoffload/shared_mem/units.h"

namespace memoffload::daemon {
namespace {

Result<DaemonConfig> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "memoffloadd");
  return ParseFlags(static_cast<int>(args.size()), args.data());
}

TEST(Config, FlagsInBothForms) {
  Result<DaemonConfig> c =
      Parse({"--arena-size=4GiB", "--chunk-size", "512MiB", "--runtime-dir", "/tmp/x",
             "--metrics-address=none", "--hugepages", "--prefault-threads=3"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->arena_size_bytes, 4 * kGiB);
  EXPECT_EQ(c->chunk_size_bytes, 512 * kMiB);
  EXPECT_EQ(c->runtime_dir, "/tmp/x");
  EXPECT_EQ(c->metrics_address, "");
  EXPECT_TRUE(c->hugepages);
  EXPECT_EQ(c->prefault_threads, 3);
}

TEST(Config, ErrorsNameTheFlag) {
  struct Case {
    std::vector<const char*> args;
    const char* needle;
  } cases[] = {
      {{"--arena-size=lots"}, "--arena-size"},
      {{"--bogus"}, "unknown flag '--bogus'"},
      {{"--arena-size"}, "needs a value"},
      {{"--hugepages=yes"}, "takes no value"},
      {{"--prefault-threads=-2"}, "--prefault-threads"},
      {{"--metrics-address=9477"}, "HOST:PORT"},
      {{"--log-level=loud"}, "debug, info, warn, error"},
      {{"stray"}, "unexpected argument"},
  };
  for (const Case& c : cases) {
    Result<DaemonConfig> r = Parse(c.args);
    ASSERT_FALSE(r.ok()) << c.needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().message();
  }
}

TEST(Config, DefaultsResolveToSmallArena) {
  Result<DaemonConfig> c = Parse({});
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(ResolveAndValidate(&*c).ok());
  EXPECT_EQ(c->arena_size_bytes, std::min<uint64_t>(kGiB, PhysicalMemoryBytes() / 4 / 4096 * 4096));
  EXPECT_EQ(c->chunk_size_bytes, std::min<uint64_t>(kGiB, c->arena_size_bytes));
  EXPECT_FALSE(c->runtime_dir.empty());
  EXPECT_GE(c->prefault_threads, 1);
  EXPECT_EQ(c->metrics_address, kDefaultMetricsAddress);
}

TEST(Config, ChunkLargerThanArenaIsClamped) {
  Result<DaemonConfig> c = Parse({"--arena-size=64MiB", "--chunk-size=1GiB"});
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(ResolveAndValidate(&*c).ok());
  EXPECT_EQ(c->chunk_size_bytes, 64 * kMiB);
}

TEST(Config, RejectsImpossibleSizes) {
  Result<DaemonConfig> c = Parse({"--chunk-size=1000"});
  ASSERT_TRUE(c.ok());
  Status st = ResolveAndValidate(&*c);
  EXPECT_NE(st.message().find("multiple of the page size"), std::string::npos) << st.message();

  c = Parse({"--arena-size=100TiB"});
  ASSERT_TRUE(c.ok());
  st = ResolveAndValidate(&*c);
  EXPECT_NE(st.message().find("exceeds this machine's RAM"), std::string::npos) << st.message();

  c = Parse({"--arena-size=1GiB", "--chunk-size=4KiB"});
  ASSERT_TRUE(c.ok());
  st = ResolveAndValidate(&*c);
  EXPECT_NE(st.message().find("at most 65536"), std::string::npos) << st.message();
}

TEST(Config, HelpListsEveryFlag) {
  const std::string help = FlagsHelp();
  for (const char* flag : {"--runtime-dir", "--arena-size", "--chunk-size", "--metrics-address",
                           "--prefault-threads", "--hugepages", "--no-mlock"}) {
    EXPECT_NE(help.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
}  // namespace memoffload::daemon
