#include "memoffload/common/crc32c.h"

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

// Polynomial arithmetic modulo P in the reflected representation CRC
// registers use (bit 31 holds x^0): a * b mod P.
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPolynomial : b >> 1;  // b * x
  }
  return product;
}

// x^(8 * bytes) mod P: what a register is multiplied by when `bytes` zero
// bytes follow it.
uint32_t ShiftFactor(uint64_t bytes) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t power = 1u << 30;   // x^1, squared up to x^(2^k)
  for (uint64_t bits = bytes * 8; bits != 0; bits >>= 1) {
    if (bits & 1) result = MultiplyModP(result, power);
    power = MultiplyModP(power, power);
  }
  return result;
}

#if defined(__x86_64__)
// Three independent streams of kLane bytes hide the crc32 instruction's
// latency (3 cycles, one issued per cycle): about three times the speed of
// one stream. Their registers are combined by the shift identity
// crc(s, A|B) = crc(0, B) ^ s * x^(8|B|).
constexpr size_t kLane = 4096;

__attribute__((target("sse4.2"))) uint64_t Crc32cWords(uint64_t c, const uint8_t* p, size_t words) {
  for (size_t i = 0; i < words; ++i) {
    uint64_t word;
    std::memcpy(&word, p + 8 * i, 8);
    c = _mm_crc32_u64(c, word);
  }
  return c;
}

__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(const void* data, size_t length,
                                                       uint32_t crc) {
  static const uint32_t lane_shift = ShiftFactor(kLane);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t c = static_cast<uint32_t>(~crc);
  while (length >= 3 * kLane) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kLane + i, 8);
      std::memcpy(&w2, p + 2 * kLane + i, 8);
      c = _mm_crc32_u64(c, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    const uint32_t ab =
        MultiplyModP(static_cast<uint32_t>(c), lane_shift) ^ static_cast<uint32_t>(c1);
    c = MultiplyModP(ab, lane_shift) ^ static_cast<uint32_t>(c2);
    p += 3 * kLane;
    length -= 3 * kLane;
  }
  c = Crc32cWords(c, p, length / 8);
  p += length / 8 * 8;
  length %= 8;
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

uint32_t Crc32cCombine(uint32_t crc1, uint32_t crc2, uint64_t length2) {
  return MultiplyModP(crc1, ShiftFactor(length2)) ^ crc2;
}

uint32_t Crc32c(const void* data, size_t length, uint32_t crc) {
#if defined(__x86_64__)
  if (Crc32cIsHardware()) return Crc32cSse42(data, length, crc);
#endif
  return Crc32cPortable(data, length, crc);
}

}  // namespace memoffload
