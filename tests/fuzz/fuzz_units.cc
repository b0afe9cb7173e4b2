// Fuzzes ParseSize and ParseDurationMs (config values, flags, environment).
//
// Beyond "no crash": an accepted size is at most 2^63 and survives printing as
// a plain byte count; an accepted duration survives printing as "<ms>ms"; a
// plain digit string parses to its own value.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "memoffload/common/units.h"

namespace {

void Fail(const char* what, const std::string& input) {
  std::fprintf(stderr, "fuzz_units: %s for input '%s'\n", what, input.c_str());
  std::abort();
}

bool AllDigits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);

  memoffload::Result<uint64_t> bytes = memoffload::ParseSize(input);
  if (bytes.ok()) {
    if (*bytes > (uint64_t{1} << 63)) Fail("size over 2^63 accepted", input);
    memoffload::Result<uint64_t> again = memoffload::ParseSize(std::to_string(*bytes));
    if (!again.ok() || *again != *bytes) Fail("size does not survive printing", input);
    if (memoffload::FormatSize(*bytes).empty()) Fail("empty FormatSize", input);
  } else if (bytes.status().message().empty()) {
    Fail("size error without a message", input);
  }
  if (AllDigits(input) && input.size() <= 18) {
    const uint64_t expected = std::strtoull(input.c_str(), nullptr, 10);
    if (!bytes.ok() || *bytes != expected) Fail("plain byte count misparsed", input);
  }

  memoffload::Result<uint64_t> ms = memoffload::ParseDurationMs(input);
  if (ms.ok()) {
    memoffload::Result<uint64_t> again = memoffload::ParseDurationMs(std::to_string(*ms) + "ms");
    if (!again.ok() || *again != *ms) Fail("duration does not survive printing", input);
  } else if (ms.status().message().empty()) {
    Fail("duration error without a message", input);
  }
  return 0;
}
