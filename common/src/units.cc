#include "memoffload/common/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

namespace memoffload {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Splits "1.5GiB" into the decimal number (whole and fraction digits) and the
// unit. Returns false when the number part is malformed.
bool SplitNumber(std::string_view text, std::string* whole, std::string* frac, std::string* unit) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    whole->push_back(text[i++]);
  }
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
      frac->push_back(text[i++]);
    }
    if (frac->empty()) return false;
  }
  if (whole->empty()) return false;
  *unit = Lower(Trim(text.substr(i)));
  return true;
}

// value = (whole + frac) * multiplier, exactly, or an error message.
bool Scale(const std::string& whole, const std::string& frac, uint64_t multiplier, uint64_t* out) {
  constexpr uint64_t kMax = uint64_t{1} << 63;
  if (whole.size() > 19) return false;
  unsigned __int128 w = std::stoull(whole);
  unsigned __int128 total = w * multiplier;
  if (!frac.empty()) {
    if (frac.size() > 18) return false;
    unsigned __int128 denom = 1;
    for (size_t k = 0; k < frac.size(); ++k) denom *= 10;
    unsigned __int128 num = static_cast<unsigned __int128>(std::stoull(frac)) * multiplier;
    if (num % denom != 0) return false;
    total += num / denom;
  }
  if (total > kMax) return false;
  *out = static_cast<uint64_t>(total);
  return true;
}

}  // namespace

Result<uint64_t> ParseSize(std::string_view text) {
  const std::string_view input = Trim(text);
  const std::string accepted = "expected a byte count like 4096, 512MiB, 4GiB, 1.5GiB or 10GB";
  std::string whole, frac, unit;
  if (!SplitNumber(input, &whole, &frac, &unit)) {
    return InvalidArgument("invalid size '" + std::string(text) + "': " + accepted);
  }
  uint64_t mult = 0;
  if (unit.empty() || unit == "b")
    mult = 1;
  else if (unit == "k" || unit == "kib" || unit == "ki")
    mult = kKiB;
  else if (unit == "m" || unit == "mib" || unit == "mi")
    mult = kMiB;
  else if (unit == "g" || unit == "gib" || unit == "gi")
    mult = kGiB;
  else if (unit == "t" || unit == "tib" || unit == "ti")
    mult = kTiB;
  else if (unit == "kb")
    mult = 1000ull;
  else if (unit == "mb")
    mult = 1000ull * 1000;
  else if (unit == "gb")
    mult = 1000ull * 1000 * 1000;
  else if (unit == "tb")
    mult = 1000ull * 1000 * 1000 * 1000;
  else {
    return InvalidArgument("invalid size '" + std::string(text) + "': unknown unit '" + unit +
                           "'; " + accepted);
  }
  uint64_t value = 0;
  if (!Scale(whole, frac, mult, &value)) {
    return InvalidArgument("invalid size '" + std::string(text) +
                           "': not a whole number of bytes or larger than 2^63");
  }
  return value;
}

std::string FormatSize(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < kKiB) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[u]);
  return buf;
}

Result<uint64_t> ParseDurationMs(std::string_view text) {
  const std::string_view input = Trim(text);
  const std::string accepted = "expected a duration like 500ms, 30s, 5m, 1h or plain milliseconds";
  std::string whole, frac, unit;
  if (!SplitNumber(input, &whole, &frac, &unit)) {
    return InvalidArgument("invalid duration '" + std::string(text) + "': " + accepted);
  }
  // Scale to microseconds, then round down to milliseconds.
  uint64_t mult_us = 0;
  if (unit.empty() || unit == "ms")
    mult_us = 1000;
  else if (unit == "us")
    mult_us = 1;
  else if (unit == "s")
    mult_us = 1000 * 1000;
  else if (unit == "m" || unit == "min")
    mult_us = 60ull * 1000 * 1000;
  else if (unit == "h")
    mult_us = 3600ull * 1000 * 1000;
  else {
    return InvalidArgument("invalid duration '" + std::string(text) + "': unknown unit '" + unit +
                           "'; " + accepted);
  }
  uint64_t us = 0;
  if (!Scale(whole, frac, mult_us, &us)) {
    return InvalidArgument("invalid duration '" + std::string(text) +
                           "': too precise or too large");
  }
  return us / 1000;
}

}  // namespace memoffload
