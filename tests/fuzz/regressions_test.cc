// Regression tests for what the fuzz targets (tests/fuzz/fuzz_*.cc) found.
// Built in every build, so a fix cannot silently come undone. Each test names
// the target that found the bug and the input, reduced.
#include <gtest/gtest.h>

#include <string>

#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/units.h"

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

}  // namespace
}  // namespace memoffload
