// Regression tests for what the fuzz targets (tests/fuzz/fuzz_*.cc) found.
// Built in every build, so a fix cannot silently come undone. Each test names
// the target that found the bug and the input, reduced.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "config/config.h"
#include "memoffload/common/units.h"
#include "memoffload/shared_mem/attach_wire.h"

namespace memoffload {
namespace {

// The attach decoders must reject every strict prefix of a valid message
// (the broker reads whatever a local process sends).
TEST(FuzzRegressions, HelloPrefixesAreRejected) {
  Hello hello;
  hello.job_id = "job";
  hello.rank = 1;
  const std::string bytes = EncodeHello(hello);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_EQ(DecodeHello(bytes.substr(0, n)).status().code(), StatusCode::kInvalidArgument) << n;
  }
  ASSERT_TRUE(DecodeHello(bytes).ok());
}

// A config file in a temporary path, removed at the end of the test.
class ConfigFile {
 public:
  explicit ConfigFile(const std::string& content) {
    char name[] = "/tmp/memoffload-fuzz-regression-XXXXXX";
    const int fd = mkstemp(name);
    EXPECT_GE(fd, 0);
    path_ = name;
    EXPECT_EQ(write(fd, content.data(), content.size()), static_cast<ssize_t>(content.size()));
    close(fd);
  }
  ~ConfigFile() { unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

Result<daemon::DaemonConfig> LoadFile(const std::string& path) {
  const std::string flag = "--config=" + path;
  const char* argv[] = {"memoffloadd", flag.c_str()};
  return daemon::LoadConfig(2, argv, {});
}

// fuzz_config: toml++ 3.3 reaches __builtin_unreachable() (undefined
// behaviour; UBSan: "execution reached an unreachable program point" in
// is_non_ascii_horizontal_whitespace) on U+0424 right after a value. Config
// files are now required to be ASCII and checked before toml++ sees them.
TEST(FuzzRegressions, ConfigWithNonAsciiIsRejectedBeforeParsing) {
  ConfigFile file("[quotas]\nsession_max_bytes = 1\xd0\xa4\n");
  Result<daemon::DaemonConfig> c = LoadFile(file.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find(file.path() + ":2:22: non-ASCII"), std::string::npos)
      << c.status().message();
  // Also inside a quoted key and in a comment: always refused, never parsed.
  ConfigFile key("[server]\n\"\xc3\xa9\" = 1\n");
  EXPECT_FALSE(LoadFile(key.path()).ok());
  ConfigFile comment(
      "# Gr\xc3\xb6\xc3\x9f"
      "e\n[server]\nlog_level = \"info\"\n");
  EXPECT_FALSE(LoadFile(comment.path()).ok());
}

// fuzz_config (asserts on): toml++ 3.3 asserts, and under NDEBUG with clang
// assumes (__builtin_assume: undefined behaviour), that its parser state is
// consistent; "[=]" or "x = [}" broke that (an abort in this test before the
// fix). Both are now ordinary parse errors naming the file and line.
TEST(FuzzRegressions, ConfigThatBreaksTomlAssumptionsIsAnError) {
  for (const char* text :
       {"[=]\n", "[ =]\n", "[[=]]\n", "[\x05serve/dir\"\n", "[access]\nallowed_gids = [}2000\n"}) {
    ConfigFile file(text);
    Result<daemon::DaemonConfig> c = LoadFile(file.path());
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(file.path() + ":"), std::string::npos)
        << c.status().message();
  }
}

// Found while hardening the reader: a config path that never ends (a device)
// or is a directory is an error, not a hang or an empty config.
TEST(FuzzRegressions, ConfigFileMustBeABoundedReadableFile) {
  Result<daemon::DaemonConfig> zero = LoadFile("/dev/zero");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("larger than"), std::string::npos)
      << zero.status().message();
  EXPECT_FALSE(LoadFile("/tmp").ok());
  EXPECT_FALSE(LoadFile("/nonexistent/memoffloadd.toml").ok());
}

// Loads `config`, prints it and loads the print: every value must survive.
void ExpectPrintedConfigRoundTrips(const std::string& config) {
  ConfigFile file(config);
  Result<daemon::DaemonConfig> c = LoadFile(file.path());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE(daemon::ResolveAndValidate(&*c).ok());
  const std::string printed = daemon::FormatConfig(*c);
  ConfigFile printed_file(printed);
  Result<daemon::DaemonConfig> back = LoadFile(printed_file.path());
  ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << printed;
  const std::vector<daemon::ConfigEntry> want = daemon::ConfigEntries(*c);
  const std::vector<daemon::ConfigEntry> got = daemon::ConfigEntries(*back);
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(want[i].value, got[i].value) << want[i].key << "\n" << printed;
  }
}

// fuzz_config: --print-config / GetConfig printed strings between bare
// quotes, so a value holding '"' or '\\' printed as TOML that does not parse.
TEST(FuzzRegressions, PrintedConfigEscapesStrings) {
  ExpectPrintedConfigRoundTrips("[server]\nsocket_group = \"wheel\\\"s\"\n");
  ExpectPrintedConfigRoundTrips("[server]\nruntime_dir = '/tmp/a\\b\"c'\n");
  ExpectPrintedConfigRoundTrips("[server]\nsocket_group = \"tab\\there\\u007f\"\n");
}

// fuzz_config: sizes are accepted up to 2^63 inclusive, but TOML integers
// stop at 2^63 - 1, so the printed config did not parse.
TEST(FuzzRegressions, PrintedConfigKeepsTheLargestSize) {
  ExpectPrintedConfigRoundTrips("[quotas]\nsession_max_bytes = \"9223372036854775808\"\n");
  ExpectPrintedConfigRoundTrips("[quotas]\njob_max_bytes = 9223372036854775807\n");
}

}  // namespace
}  // namespace memoffload
