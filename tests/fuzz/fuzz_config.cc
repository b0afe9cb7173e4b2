// Fuzzes the daemon's config file parser: the input is a TOML file handed to
// LoadConfig with --config (through a memfd, /proc/self/fd/N).
//
// Checks: no crash; a failure is INVALID_ARGUMENT naming the file; an
// accepted config that validates prints (FormatConfig, what --print-config
// and GetConfig show) as a TOML document that loads again to the same values.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "fuzz_common.h"

namespace memoffload::fuzz {
namespace {

// One memfd per role, reused: rewritten from the start on every call.
std::string WriteMemfd(int* fd, const char* name, const std::string& content) {
  if (*fd < 0) {
    *fd = memfd_create(name, MFD_CLOEXEC);
    Check(*fd >= 0, "memfd_create");
  }
  Check(ftruncate(*fd, 0) == 0, "ftruncate");
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n =
        pwrite(*fd, content.data() + done, content.size() - done, static_cast<off_t>(done));
    Check(n > 0, "pwrite");
    done += static_cast<size_t>(n);
  }
  return "/proc/self/fd/" + std::to_string(*fd);
}

Result<daemon::DaemonConfig> Load(const std::string& path) {
  const std::string flag = "--config=" + path;
  const char* argv[] = {"memoffloadd", flag.c_str()};
  return daemon::LoadConfig(2, argv, {});
}

}  // namespace
}  // namespace memoffload::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memoffload;
  static int input_fd = -1;
  static int printed_fd = -1;
  const std::string path = fuzz::WriteMemfd(&input_fd, "fuzz-config",
                                            std::string(reinterpret_cast<const char*>(data), size));

  Result<daemon::DaemonConfig> config = fuzz::Load(path);
  if (!config.ok()) {
    fuzz::Check(config.status().code() == StatusCode::kInvalidArgument,
                "LoadConfig failed with " + config.status().ToString());
    fuzz::Check(config.status().message().find(path) != std::string::npos,
                "config error does not name the file: " + config.status().message());
    return 0;
  }
  if (!daemon::ResolveAndValidate(&*config).ok()) return 0;
  const std::vector<daemon::ConfigEntry> entries = daemon::ConfigEntries(*config);
  const std::string printed = daemon::FormatConfig(*config);

  Result<daemon::DaemonConfig> reloaded =
      fuzz::Load(fuzz::WriteMemfd(&printed_fd, "fuzz-config-printed", printed));
  fuzz::CheckOk(reloaded.status(), "the printed config does not load again:\n" + printed);
  const std::vector<daemon::ConfigEntry> again = daemon::ConfigEntries(*reloaded);
  fuzz::Check(again.size() == entries.size(), "printed config has a different key count");
  for (size_t i = 0; i < entries.size(); ++i) {
    fuzz::Check(entries[i].key == again[i].key && entries[i].value == again[i].value,
                "printed config changes " + entries[i].key + ": '" + entries[i].value +
                    "' became '" + again[i].value + "'\n" + printed);
  }
  return 0;
}
