#include "core/link_keys.h"

#include <fcntl.h>
#include <openssl/core_names.h>
#include <openssl/kdf.h>
#include <openssl/params.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <memory>

#include "memoffload/common/trusted_path.h"

namespace memoffload::daemon {
namespace {

constexpr size_t kMaxKeyFileBytes = 64 * 1024;

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

void AppendLengthPrefixed(std::string* out, const std::string& field) {
  const uint32_t n = static_cast<uint32_t>(field.size());
  for (int i = 3; i >= 0; --i) out->push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  *out += field;
}

}  // namespace

Result<std::vector<LinkSecret>> ParseLinkSecrets(const std::string& text) {
  std::vector<LinkSecret> secrets;
  size_t line_no = 0;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    size_t a = 0;
    while (a < line.size() && std::isspace(static_cast<unsigned char>(line[a]))) ++a;
    size_t b = line.size();
    while (b > a && std::isspace(static_cast<unsigned char>(line[b - 1]))) --b;
    if (a == b) continue;
    line = line.substr(a, b - a);
    const size_t space = line.find_first_of(" \t");
    const std::string where = "line " + std::to_string(line_no);
    if (space == std::string::npos) {
      return InvalidArgument(where + ": expected 'KEY_ID HEX_SECRET'");
    }
    LinkSecret s;
    s.id = line.substr(0, space);
    size_t hex_start = space;
    while (hex_start < line.size() && std::isspace(static_cast<unsigned char>(line[hex_start]))) {
      ++hex_start;
    }
    const std::string hex = line.substr(hex_start);
    if (s.id.size() > kMaxLinkKeyIdBytes) {
      return InvalidArgument(where + ": the key id is longer than " +
                             std::to_string(kMaxLinkKeyIdBytes) + " characters");
    }
    for (char c : s.id) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
        return InvalidArgument(where + ": a key id is letters, digits, '-', '_' and '.'");
      }
    }
    if (hex.size() % 2 != 0) return InvalidArgument(where + ": the secret has an odd hex length");
    for (size_t i = 0; i < hex.size(); i += 2) {
      const int hi = HexValue(hex[i]);
      const int lo = HexValue(hex[i + 1]);
      if (hi < 0 || lo < 0) return InvalidArgument(where + ": the secret is not hex");
      s.secret.push_back(static_cast<char>(hi * 16 + lo));
    }
    if (s.secret.size() < kMinLinkSecretBytes) {
      return InvalidArgument(where + ": the secret has " + std::to_string(s.secret.size()) +
                             " bytes, at least " + std::to_string(kMinLinkSecretBytes) +
                             " are needed (openssl rand -hex 32)");
    }
    for (const LinkSecret& other : secrets) {
      if (other.id == s.id) return InvalidArgument(where + ": key id " + s.id + " is there twice");
    }
    secrets.push_back(std::move(s));
  }
  if (secrets.empty()) return InvalidArgument("no 'KEY_ID HEX_SECRET' line");
  return secrets;
}

Result<std::string> DeriveLinkKey(const std::string& secret, uid_t uid, const std::string& job_id) {
  std::string info = kLinkKeyLabel;
  AppendLengthPrefixed(&info, std::to_string(uid));
  AppendLengthPrefixed(&info, job_id);
  std::unique_ptr<EVP_KDF, decltype(&EVP_KDF_free)> kdf(EVP_KDF_fetch(nullptr, "HKDF", nullptr),
                                                        &EVP_KDF_free);
  if (kdf == nullptr) return Internal("OpenSSL has no HKDF");
  std::unique_ptr<EVP_KDF_CTX, decltype(&EVP_KDF_CTX_free)> ctx(EVP_KDF_CTX_new(kdf.get()),
                                                                &EVP_KDF_CTX_free);
  if (ctx == nullptr) return Internal("EVP_KDF_CTX_new failed");
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<char*>(secret.data()),
                                        secret.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, info.data(), info.size()),
      OSSL_PARAM_construct_end()};
  std::string key(kLinkKeyBytes, '\0');
  if (EVP_KDF_derive(ctx.get(), reinterpret_cast<unsigned char*>(key.data()), key.size(), params) !=
      1) {
    return Internal("HKDF-SHA256 failed");
  }
  return key;
}

Status LinkKeys::Load(const std::string& path, bool systemd_credential) {
  if (path.empty()) {
    absl::MutexLock lock(&mu_);
    secrets_.clear();
    path_.clear();
    return Status::Ok();
  }
  // Symlinks are followed (a Kubernetes Secret's file is one) only where
  // root or the daemon's user alone could have made them.
  TrustedPathProblem walk;
  const std::string resolved = ResolveTrustedPath(path, {0, geteuid()}, &walk);
  using Kind = TrustedPathProblem::Kind;
  switch (walk.kind) {
    case Kind::kNone:
      break;
    case Kind::kMissing:
    case Kind::kError:
      return ErrnoStatus(
          "replication.key_file " + path + (walk.at == path ? "" : " (at " + walk.at + ")"),
          walk.error);
    case Kind::kUntrustedDir:
      return PermissionDenied("replication.key_file " + path + ": directory " + walk.at +
                              " on its way " +
                              TrustedDirProblem(walk.uid, walk.mode, {0, geteuid()}) +
                              ", so another user could replace the key; keep it in a directory "
                              "of root's or the daemon's user");
    case Kind::kUntrustedLink:
      return PermissionDenied("replication.key_file " + path + ": symlink " + walk.at +
                              " belongs to uid " + std::to_string(walk.uid) +
                              ", who could change where it leads");
    default:
      return InvalidArgument(
          "replication.key_file " + path + ": " + walk.at +
          (walk.kind == Kind::kNotDirectory ? " is not a directory" : ": too many symlinks"));
  }
  const int fd = open(resolved.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return ErrnoStatus("replication.key_file " + path, errno);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoStatus("stat " + path, err);
  }
  std::string problem;
  if (!S_ISREG(st.st_mode)) problem = "is not a regular file";
  if (st.st_uid != geteuid() && st.st_uid != 0) {
    problem = "belongs to uid " + std::to_string(st.st_uid) + ", neither the daemon's nor root";
  }
  if ((st.st_mode & (systemd_credential ? 007 : 077)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    problem = std::string("has mode ") + mode + ": its group or others may read it (chmod 0400)";
  }
  if (problem.empty() && st.st_size > static_cast<off_t>(kMaxKeyFileBytes)) {
    problem = "is larger than 64 KiB";
  }
  std::string text;
  if (problem.empty()) {
    text.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = read(fd, text.data() + got, text.size() - got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    text.resize(got);
  }
  close(fd);
  if (!problem.empty()) {
    return PermissionDenied("replication.key_file " + path + " " + problem);
  }
  Result<std::vector<LinkSecret>> secrets = ParseLinkSecrets(text);
  if (!secrets.ok()) {
    return InvalidArgument("replication.key_file " + path + ": " + secrets.status().message());
  }
  absl::MutexLock lock(&mu_);
  secrets_ = std::move(secrets).value();
  path_ = path;
  return Status::Ok();
}

void LinkKeys::SetRequired(bool required) {
  absl::MutexLock lock(&mu_);
  required_ = required;
}

Result<std::vector<DerivedLinkKey>> LinkKeys::KeysFor(uid_t uid, const std::string& job_id) const {
  if (job_id.empty()) {
    return FailedPrecondition(
        "replication keys are per job: attach with an explicit job id (MEMOFFLOAD_JOB_ID)");
  }
  std::vector<LinkSecret> secrets;
  bool required = false;
  {
    absl::MutexLock lock(&mu_);
    secrets = secrets_;
    required = required_;
  }
  if (secrets.empty()) {
    if (required) {
      return FailedPrecondition(
          "this node requires replication keys (replication.require_key) but has no "
          "replication.key_file: no checkpoint is replicated from or to it");
    }
    return NotFound(
        "this node's memoffloadd has no replication.key_file: the job's ranks make a key of "
        "their own and publish it in the job's store");
  }
  std::vector<DerivedLinkKey> keys;
  for (const LinkSecret& s : secrets) {
    Result<std::string> key = DeriveLinkKey(s.secret, uid, job_id);
    if (!key.ok()) return key.status();
    keys.push_back({s.id, std::move(key).value()});
  }
  return keys;
}

std::string LinkKeys::Ids() const {
  absl::MutexLock lock(&mu_);
  std::string out;
  for (const LinkSecret& s : secrets_) out += (out.empty() ? "" : ", ") + s.id;
  return out;
}

}  // namespace memoffload::daemon
