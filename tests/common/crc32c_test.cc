#include "memoffload/common/crc32c.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace memoffload {
namespace {

TEST(Crc32c, KnownVectors) {
  // RFC 3720 (iSCSI) test vectors.
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xff), inc(32);
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(Crc32c(zeros.data(), 32), 0x8a9136aau);
  EXPECT_EQ(Crc32c(ones.data(), 32), 0x62a8ab43u);
  EXPECT_EQ(Crc32c(inc.data(), 32), 0x46dd794eu);
  const std::string digits = "123456789";
  EXPECT_EQ(Crc32c(digits.data(), digits.size()), 0xe3069283u);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, HardwareMatchesPortableAndExtends) {
  std::mt19937 rng(3);
  std::vector<uint8_t> data(100003);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  // Lengths around the three-lane blocks (3 x 4096 bytes) of the hardware path.
  for (size_t len : {0ul, 1ul, 7ul, 8ul, 9ul, 4096ul, 12287ul, 12288ul, 12289ul, 24583ul, 36871ul,
                     data.size()}) {
    EXPECT_EQ(Crc32c(data.data(), len), Crc32cPortable(data.data(), len)) << len;
  }
  const uint32_t whole = Crc32c(data.data(), data.size());
  const uint32_t split = Crc32c(data.data() + 5000, data.size() - 5000, Crc32c(data.data(), 5000));
  EXPECT_EQ(whole, split);
  // Unaligned starts, and a seed carried into the three-lane blocks.
  for (size_t start : {1ul, 3ul, 12289ul}) {
    const size_t len = data.size() - start;
    EXPECT_EQ(Crc32c(data.data() + start, len, 0x1234567u),
              Crc32cPortable(data.data() + start, len, 0x1234567u))
        << start;
  }
  data[777] ^= 1;
  EXPECT_NE(Crc32c(data.data(), data.size()), whole);
}

// Checksums of two parts give the whole's without reading it again, at any
// split (empty parts included).
TEST(Crc32c, CombineGivesTheChecksumOfBothParts) {
  std::vector<uint8_t> data(100000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + (i >> 9));
  const uint32_t whole = Crc32c(data.data(), data.size());
  for (size_t split : {0ul, 1ul, 8ul, 4095ul, 12288ul, 65537ul, data.size()}) {
    const uint32_t a = Crc32c(data.data(), split);
    const uint32_t b = Crc32c(data.data() + split, data.size() - split);
    EXPECT_EQ(Crc32cCombine(a, b, data.size() - split), whole) << split;
  }
  EXPECT_EQ(Crc32cCombine(0, Crc32c(data.data(), 10), 10), Crc32c(data.data(), 10));
  EXPECT_NE(Crc32cCombine(Crc32c(data.data(), 10), Crc32c(data.data() + 10, 10), 9),
            Crc32c(data.data(), 20));
}

}  // namespace
}  // namespace memoffload
