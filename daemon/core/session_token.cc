#include "core/session_token.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace memoffload::daemon {

Result<std::string> NewSessionToken() {
  unsigned char raw[16];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("getrandom", errno);
    }
    got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string token(32, '0');
  for (size_t i = 0; i < sizeof(raw); ++i) {
    token[2 * i] = kHex[raw[i] >> 4];
    token[2 * i + 1] = kHex[raw[i] & 0xf];
  }
  return token;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // The length of a token is public; its content is not. Every byte is
  // compared, eight at a time; the empty asm keeps the compiler from ending
  // the loop at the first difference.
  if (a.size() != b.size()) return false;
  uint64_t diff = 0;
  size_t i = 0;
  for (; i + sizeof(uint64_t) <= a.size(); i += sizeof(uint64_t)) {
    uint64_t x, y;
    std::memcpy(&x, a.data() + i, sizeof(x));
    std::memcpy(&y, b.data() + i, sizeof(y));
    diff |= x ^ y;
    asm volatile("" : "+r"(diff));
  }
  for (; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
    asm volatile("" : "+r"(diff));
  }
  return diff == 0;
}

}  // namespace memoffload::daemon
