// Parsing and printing of sizes and durations as operators write them.
#ifndef MEMOFFLOAD_SHARED_MEM_UNITS_H_
#define MEMOFFLOAD_SHARED_MEM_UNITS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "memoffload/common/status.h"

namespace memoffload {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;
inline constexpr uint64_t kTiB = 1024 * kGiB;

// Parses "4096", "512MiB", "4GiB", "1.5GiB", "64KiB", "2TiB", "4G", "512M",
// "10GB" (decimal units KB/MB/GB/TB are powers of 1000). Whitespace between
// number and unit is allowed; units are case-insensitive. Fractions must
// resolve to a whole number of bytes. Errors name the input and the accepted
// forms; values over 2^63 are rejected.
Result<uint64_t> ParseSize(std::string_view text);

// "1.00 GiB", "512.00 MiB", "4096 B".
std::string FormatSize(uint64_t bytes);

// Parses "250ms", "30s", "5m", "1h", "1.5s", "500us" and plain integers as
// milliseconds. Returns milliseconds.
Result<uint64_t> ParseDurationMs(std::string_view text);

}  // namespace memoffload

#endif  // MEMOFFLOAD_SHARED_MEM_UNITS_H_
