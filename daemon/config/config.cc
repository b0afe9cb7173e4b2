#include "config/config.h"

#include <unistd.h>

#include "config/config_settings.h"

// toml++ 3.3 (Debian 12) checks its parser state with TOML_ASSERT_ASSUME:
// assert() without NDEBUG, __builtin_assume() with NDEBUG under clang. Some
// malformed files break those assumptions ("[=]", "x = [}"; found by
// tests/fuzz/fuzz_config): an abort, or undefined behaviour. Compile the
// header-only parser with both turned into no-ops, as GCC builds already get
// (GCC 12 has no __builtin_assume); it then reports those files as errors.
#pragma push_macro("NDEBUG")
#undef NDEBUG
#define TOML_ASSERT(expr) static_cast<void>(0)
#define TOML_EXCEPTIONS 0
#include <toml++/toml.h>
#pragma pop_macro("NDEBUG")

#include <algorithm>
#include <cctype>
#include <charconv>
#include <fstream>
#include <functional>
#include <sstream>
#include <string_view>

extern char** environ;

namespace memoffload::daemon {
namespace {

using config_internal::FindByFlag;
using config_internal::Kind;
using config_internal::KindHelp;
using config_internal::Setting;
using config_internal::Settings;

Status Apply(const Setting& s, DaemonConfig* c, const std::string& value, const std::string& source,
             const std::string& where) {
  Status st = s.apply(c, value);
  if (!st.ok()) {
    return InvalidArgument(where + ": " + st.message() + " (expected " + KindHelp(s.kind) + ": " +
                           s.help + ")");
  }
  c->sources[s.Name()] = source;
  return Status::Ok();
}

// Converts a TOML value to the string form the settings parse.
Result<std::string> TomlValueToString(const toml::node& node) {
  if (auto v = node.value<std::string>()) return *v;
  if (node.is_boolean()) return std::string(*node.value<bool>() ? "true" : "false");
  if (node.is_integer()) return std::to_string(*node.value<int64_t>());
  if (node.is_floating_point()) {
    char buf[32];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), *node.value<double>());
    if (ec == std::errc()) return std::string(buf, end);
  }
  if (const toml::array* arr = node.as_array()) {
    std::string joined;
    for (const toml::node& el : *arr) {
      Result<std::string> s = TomlValueToString(el);
      if (!s.ok()) return s;
      joined += (joined.empty() ? "" : ",") + *s;
    }
    return joined;
  }
  return InvalidArgument("unsupported value type (use a string, integer, float, boolean or array)");
}

std::string KnownKeys(const std::string& section) {
  std::string keys;
  for (const Setting& s : Settings()) {
    if (section.empty() || s.section == section) {
      keys += (keys.empty() ? "" : ", ") + (section.empty() ? s.Name() : std::string(s.key));
    }
  }
  return keys;
}

// Reads a config file for parsing. The file must be ASCII: toml++ 3.3
// (Debian 12) reaches __builtin_unreachable() when it checks some non-ASCII
// code points for whitespace (U+00A1..U+0499, U+FB06..U+FEFE, e.g. in a
// quoted key or after a value), which is undefined behaviour on operator
// input. Every setting is ASCII anyway. Found by tests/fuzz/fuzz_config.
Result<std::string> ReadConfigText(const std::string& path) {
  constexpr size_t kMaxConfigBytes = 1 << 20;
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgument("config file " + path + ": cannot be opened for reading");
  std::string text(kMaxConfigBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return InvalidArgument("config file " + path + ": read error");
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxConfigBytes) {
    return InvalidArgument("config file " + path + ": larger than " +
                           std::to_string(kMaxConfigBytes) + " bytes");
  }
  size_t line = 1, column = 1;
  for (const char ch : text) {
    if (static_cast<unsigned char>(ch) >= 0x80) {
      return InvalidArgument("config file " + path + ":" + std::to_string(line) + ":" +
                             std::to_string(column) +
                             ": non-ASCII character; memoffloadd config files must be ASCII");
    }
    if (ch == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return text;
}

Status ApplyFile(const std::string& path, DaemonConfig* c) {
  Result<std::string> text = ReadConfigText(path);
  if (!text.ok()) return text.status();
  toml::parse_result parsed = toml::parse(*text, path);
  if (!parsed) {
    const toml::parse_error& err = parsed.error();
    if (!err.source().begin) {
      return InvalidArgument("config file " + path + ": " + std::string(err.description()));
    }
    return InvalidArgument("config file " + path + ":" + std::to_string(err.source().begin.line) +
                           ":" + std::to_string(err.source().begin.column) + ": " +
                           std::string(err.description()));
  }
  for (const auto& [section_key, section_node] : parsed.table()) {
    const std::string section(section_key.str());
    const toml::table* table = section_node.as_table();
    if (table == nullptr || KnownKeys(section).empty()) {
      return InvalidArgument("config file " + path + ": unknown section '" + section +
                             "'; expected [server], [arena], [access], [quotas] or [lifecycle]");
    }
    for (const auto& [key, node] : *table) {
      const std::string name = section + "." + std::string(key.str());
      const Setting* setting = nullptr;
      for (const Setting& s : Settings()) {
        if (s.Name() == name) setting = &s;
      }
      if (setting == nullptr) {
        return InvalidArgument("config file " + path + ": unknown key '" + name + "'; keys in [" +
                               section + "] are " + KnownKeys(section));
      }
      Result<std::string> value = TomlValueToString(node);
      if (!value.ok()) {
        return InvalidArgument("config file " + path + ": " + name + ": " +
                               value.status().message());
      }
      MEMOFFLOAD_RETURN_IF_ERROR(
          Apply(*setting, c, *value, "file", "config file " + path + ": " + name));
    }
  }
  return Status::Ok();
}

struct ParsedFlag {
  std::string name;
  std::string value;
  bool has_value = false;
};

// Splits argv into flags; handles "--name=value" and "--name value" (the
// latter only for flags that need a value).
Result<std::vector<ParsedFlag>> SplitFlags(int argc, const char* const* argv) {
  std::vector<ParsedFlag> out;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg.substr(0, 2) != "--") {
      return InvalidArgument("unexpected argument '" + std::string(arg) +
                             "'; flags start with -- (see --help)");
    }
    arg.remove_prefix(2);
    ParsedFlag f;
    if (size_t eq = arg.find('='); eq != std::string_view::npos) {
      f.name = std::string(arg.substr(0, eq));
      f.value = std::string(arg.substr(eq + 1));
      f.has_value = true;
    } else {
      f.name = std::string(arg);
    }
    const bool action =
        f.name == "help" || f.name == "version" || f.name == "print-config" || f.name == "no-mlock";
    const Setting* s = FindByFlag(f.name);
    if (!action && f.name != "config" && s == nullptr) {
      return InvalidArgument("unknown flag '--" + f.name + "' (see --help)");
    }
    if (action && f.has_value) {
      return InvalidArgument("flag '--" + f.name + "' takes no value");
    }
    // A bare --take-over is --take-over=always.
    if (f.name == "take-over" && !f.has_value) {
      f.value = "always";
      f.has_value = true;
    }
    const bool is_bool = s != nullptr && s->kind == Kind::kBool;
    if (!action && !f.has_value) {
      if (is_bool) {
        f.value = "true";
        f.has_value = true;
      } else if (i + 1 < argc) {
        f.value = argv[++i];
        f.has_value = true;
      } else {
        return InvalidArgument("flag '--" + f.name +
                               "' needs a value: " + (s != nullptr ? KindHelp(s->kind) : "PATH"));
      }
    }
    out.push_back(std::move(f));
  }
  return out;
}

std::string EnvValue(const std::vector<std::string>& env, const std::string& name, bool* found) {
  const std::string prefix = name + "=";
  for (const std::string& kv : env) {
    if (kv.compare(0, prefix.size(), prefix) == 0) {
      *found = true;
      return kv.substr(prefix.size());
    }
  }
  *found = false;
  return "";
}

Result<DaemonConfig> Build(int argc, const char* const* argv, const std::vector<std::string>& env) {
  Result<std::vector<ParsedFlag>> flags = SplitFlags(argc, argv);
  if (!flags.ok()) return flags.status();
  DaemonConfig c;
  for (const Setting& s : Settings()) c.sources[s.Name()] = "default";

  bool found = false;
  c.config_file = EnvValue(env, "MEMOFFLOAD_CONFIG", &found);
  for (const ParsedFlag& f : *flags) {
    if (f.name == "config") c.config_file = f.value;
  }
  if (!c.config_file.empty()) MEMOFFLOAD_RETURN_IF_ERROR(ApplyFile(c.config_file, &c));

  for (const Setting& s : Settings()) {
    std::string v = EnvValue(env, s.Env(), &found);
    if (found) MEMOFFLOAD_RETURN_IF_ERROR(Apply(s, &c, v, "env", s.Env()));
  }
  for (const ParsedFlag& f : *flags) {
    if (f.name == "help")
      c.show_help = true;
    else if (f.name == "version")
      c.show_version = true;
    else if (f.name == "print-config")
      c.print_config = true;
    else if (f.name == "no-mlock") {
      c.mlock = false;
      c.sources["arena.mlock"] = "flag";
    } else if (f.name != "config") {
      MEMOFFLOAD_RETURN_IF_ERROR(Apply(*FindByFlag(f.name), &c, f.value, "flag", "--" + f.name));
    }
  }
  return c;
}

}  // namespace

Result<DaemonConfig> LoadConfig(int argc, const char* const* argv,
                                const std::vector<std::string>& env) {
  return Build(argc, argv, env);
}

Result<DaemonConfig> ReloadConfig(const DaemonConfig& current, int argc, const char* const* argv,
                                  const std::vector<std::string>& env) {
  if (current.config_file.empty()) {
    return FailedPrecondition("no config file to reload (start with --config PATH)");
  }
  Result<DaemonConfig> fresh = Build(argc, argv, env);
  if (!fresh.ok()) return fresh.status();
  MEMOFFLOAD_RETURN_IF_ERROR(ResolveAndValidate(&*fresh));
  return fresh;
}

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

std::vector<std::string> ProcessEnvironment() {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) env.emplace_back(*e);
  return env;
}

std::vector<ConfigEntry> ConfigEntries(const DaemonConfig& c) {
  std::vector<ConfigEntry> out;
  for (const Setting& s : Settings()) {
    auto it = c.sources.find(s.Name());
    out.push_back({s.Name(), s.format(c), it == c.sources.end() ? "default" : it->second});
  }
  return out;
}

namespace {

// `value` as a TOML basic string: quotes, backslashes and control
// characters escaped, so that any value prints as a string that parses back
// to itself (found by tests/fuzz/fuzz_config).
std::string TomlString(const std::string& value) {
  std::string out = "\"";
  for (const char ch : value) {
    const unsigned char u = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", u);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

}  // namespace

std::string FormatConfig(const DaemonConfig& c) {
  std::string out = "# effective memoffloadd configuration";
  if (!c.config_file.empty()) {
    std::string file = c.config_file;  // a comment ends at a line break
    std::replace_if(
        file.begin(), file.end(), [](char ch) { return ch == '\n' || ch == '\r'; }, '?');
    out += " (config file " + file + ")";
  }
  out += "\n";
  std::string section;
  for (const Setting& s : Settings()) {
    if (section != s.section) {
      section = s.section;
      out += "\n[" + section + "]\n";
    }
    auto it = c.sources.find(s.Name());
    const std::string value = s.format(c);
    // TOML integers are signed 64-bit; a size of 2^63 prints as a string.
    const bool too_big = s.kind == Kind::kSize && std::strtoull(value.c_str(), nullptr, 10) >
                                                      static_cast<uint64_t>(INT64_MAX);
    const bool quoted =
        s.kind == Kind::kString || s.kind == Kind::kMode || s.kind == Kind::kDuration || too_big;
    std::string rendered = quoted ? TomlString(value) : value;
    if (s.kind == Kind::kIdList) rendered = "[" + value + "]";
    out += std::string(s.key) + " = " + rendered + "  # " +
           (it == c.sources.end() ? "default" : it->second) + "\n";
  }
  return out;
}

std::string FlagsHelp() {
  std::string out =
      "usage: memoffloadd [--config FILE] [flags]\n\n"
      "Serves a shared, pre-faulted host-memory arena to training processes.\n"
      "Every setting can come from the TOML config file ([section] key), the\n"
      "environment (MEMOFFLOAD_<KEY>) or a flag; flags win over the environment,\n"
      "which wins over the file, which wins over the defaults.\n\n";
  auto line = [&](std::string left, const std::string& help) {
    if (left.size() < 32)
      left.resize(32, ' ');
    else
      left += "\n" + std::string(32, ' ');
    out += left + help + "\n";
  };
  line("  --config=FILE", "TOML config file (env MEMOFFLOAD_CONFIG)");
  for (const Setting& s : Settings()) {
    line("  --" + s.Flag() + "=" + KindHelp(s.kind), s.help);
    out += std::string(32, ' ') + "[" + s.section + "] " + s.key + ", env " + s.Env() + "\n";
  }
  line("  --no-mlock", "same as --mlock=false");
  line("  --take-over", "same as --take-over=always");
  line("  --print-config", "print the effective configuration as TOML and exit");
  line("  --version", "print the version and exit");
  line("  --help", "print this help and exit");
  return out;
}

}  // namespace memoffload::daemon
