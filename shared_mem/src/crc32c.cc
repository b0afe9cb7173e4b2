#include "memoffload/shared_mem/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace memoffload {
namespace {

constexpr uint32_t kPolynomial = 0x82f63b78;  // reflected Castagnoli

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(const void* data, size_t length,
                                                       uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  while (length >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    length -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (length-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}
#endif

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t length, uint32_t crc) {
  static const std::array<uint32_t, 256> table = MakeTable();
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < length; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return ~c;
}

bool Crc32cIsHardware() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

uint32_t Crc32c(const void* data, size_t length, uint32_t crc) {
#if defined(__x86_64__)
  if (Crc32cIsHardware()) return Crc32cSse42(data, length, crc);
#endif
  return Crc32cPortable(data, length, crc);
}

}  // namespace memoffload
