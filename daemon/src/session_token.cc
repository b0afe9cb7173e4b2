#include "memoffload/daemon/session_token.h"

#include <sys/random.h>

#include <cerrno>

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
  // The length of a token is public; its content is not.
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = diff | static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace memoffload::daemon
