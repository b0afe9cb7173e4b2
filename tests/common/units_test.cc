#include "memoffload/common/units.h"

#include <gtest/gtest.h>

namespace memoffload {
namespace {

TEST(ParseSize, AcceptsBinaryDecimalAndPlainBytes) {
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("512MiB"), 512 * kMiB);
  EXPECT_EQ(*ParseSize("4GiB"), 4 * kGiB);
  EXPECT_EQ(*ParseSize("4gib"), 4 * kGiB);
  EXPECT_EQ(*ParseSize("4G"), 4 * kGiB);
  EXPECT_EQ(*ParseSize("64 KiB"), 64 * kKiB);
  EXPECT_EQ(*ParseSize("1.5GiB"), 3 * kGiB / 2);
  EXPECT_EQ(*ParseSize("2TiB"), 2 * kTiB);
  EXPECT_EQ(*ParseSize("10GB"), 10'000'000'000u);
  EXPECT_EQ(*ParseSize(" 7 "), 7u);
  EXPECT_EQ(*ParseSize("0"), 0u);
}

TEST(ParseSize, RejectsMalformedWithClearMessage) {
  for (const char* bad : {"", "GiB", "-1", "1.GiB", "4 XiB", "1.0000001KiB", "abc", "4GiBs",
                          "99999999999999999999", "9000000000TiB"}) {
    Result<uint64_t> r = ParseSize(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("invalid size"), std::string::npos) << bad;
  }
}

TEST(ParseSize, FractionMustBeWholeBytes) {
  EXPECT_EQ(*ParseSize("0.5KiB"), 512u);
  EXPECT_FALSE(ParseSize("0.3B").ok());
}

TEST(FormatSize, PicksReadableUnit) {
  EXPECT_EQ(FormatSize(0), "0 B");
  EXPECT_EQ(FormatSize(1023), "1023 B");
  EXPECT_EQ(FormatSize(kGiB), "1.00 GiB");
  EXPECT_EQ(FormatSize(512 * kMiB), "512.00 MiB");
}

TEST(ParseDuration, UnitsAndPlainMilliseconds) {
  EXPECT_EQ(*ParseDurationMs("250"), 250u);
  EXPECT_EQ(*ParseDurationMs("250ms"), 250u);
  EXPECT_EQ(*ParseDurationMs("30s"), 30000u);
  EXPECT_EQ(*ParseDurationMs("1.5s"), 1500u);
  EXPECT_EQ(*ParseDurationMs("5m"), 300000u);
  EXPECT_EQ(*ParseDurationMs("1h"), 3600000u);
  EXPECT_EQ(*ParseDurationMs("1500us"), 1u);
  EXPECT_FALSE(ParseDurationMs("5 days").ok());
  EXPECT_FALSE(ParseDurationMs("").ok());
  EXPECT_FALSE(ParseDurationMs("s").ok());
}

}  // namespace
}  // namespace memoffload
