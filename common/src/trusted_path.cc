#include "memoffload/common/trusted_path.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>

namespace memoffload {
namespace {

bool Trusted(uint32_t uid, const std::vector<uint32_t>& trusted) {
  return std::find(trusted.begin(), trusted.end(), uid) != trusted.end();
}

std::string Fail(TrustedPathProblem* problem, TrustedPathProblem::Kind kind, const std::string& at,
                 int error = 0) {
  problem->kind = kind;
  problem->at = at;
  problem->error = error;
  return "";
}

}  // namespace

std::string TrustedDirProblem(uint32_t st_uid, mode_t st_mode,
                              const std::vector<uint32_t>& trusted) {
  if (!Trusted(st_uid, trusted)) return "belongs to uid " + std::to_string(st_uid);
  if ((st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st_mode & S_ISVTX) == 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st_mode & 07777));
    return std::string("has mode ") + mode;
  }
  return "";
}

std::string ResolveTrustedPath(const std::string& path, const std::vector<uint32_t>& trusted,
                               TrustedPathProblem* problem) {
  *problem = TrustedPathProblem{};
  std::string pending = path;
  if (pending.empty() || pending[0] != '/') {
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof(cwd)) == nullptr)
      return Fail(problem, TrustedPathProblem::Kind::kError, ".", errno);
    pending = std::string(cwd) + "/" + pending;
  }
  std::vector<std::string> parts;  // the resolved path so far, checked
  auto joined = [&parts] {
    std::string out;
    for (const std::string& p : parts) out += "/" + p;
    return out.empty() ? std::string("/") : out;
  };
  auto untrusted_dir = [&](const std::string& at, const struct stat& st) {
    if (TrustedDirProblem(st.st_uid, st.st_mode, trusted).empty()) return false;
    problem->uid = st.st_uid;
    problem->mode = st.st_mode;
    Fail(problem, TrustedPathProblem::Kind::kUntrustedDir, at);
    return true;
  };
  struct stat root;
  if (lstat("/", &root) != 0) return Fail(problem, TrustedPathProblem::Kind::kError, "/", errno);
  if (untrusted_dir("/", root)) return "";
  int links = 0;
  size_t at = 0;
  while (at < pending.size()) {
    const size_t slash = pending.find('/', at);
    const size_t stop = slash == std::string::npos ? pending.size() : slash;
    const std::string name = pending.substr(at, stop - at);
    at = stop + 1;
    if (name.empty() || name == ".") continue;
    if (name == "..") {
      if (!parts.empty()) parts.pop_back();
      continue;
    }
    const std::string parent = joined();
    parts.push_back(name);
    const std::string here = joined();
    struct stat st;
    if (lstat(here.c_str(), &st) != 0) {
      return Fail(problem, TrustedPathProblem::Kind::kMissing, here, errno);
    }
    if (S_ISLNK(st.st_mode)) {
      if (++links > 40) return Fail(problem, TrustedPathProblem::Kind::kTooManyLinks, here);
      if (!Trusted(st.st_uid, trusted)) {
        problem->uid = st.st_uid;
        problem->parent = parent;
        return Fail(problem, TrustedPathProblem::Kind::kUntrustedLink, here);
      }
      char target[PATH_MAX];
      const ssize_t n = readlink(here.c_str(), target, sizeof(target) - 1);
      if (n < 0) return Fail(problem, TrustedPathProblem::Kind::kError, here, errno);
      target[n] = '\0';
      parts.pop_back();
      if (target[0] == '/') parts.clear();
      pending = std::string(target) + "/" + pending.substr(std::min(at, pending.size()));
      at = 0;
      continue;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (at >= pending.size()) return here;  // the last: the caller's rules for it
      return Fail(problem, TrustedPathProblem::Kind::kNotDirectory, here);
    }
    const bool last = pending.find_first_not_of("/.", at) == std::string::npos &&
                      pending.find("..", at) == std::string::npos;
    if (last) continue;
    if (untrusted_dir(here, st)) return "";
  }
  return joined();
}

}  // namespace memoffload
