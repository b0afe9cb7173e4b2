// LinkKeys (core/link_keys.h): the key file's format, and each job's key
// derived by HKDF-SHA256, checked against RFC 5869's two steps computed
// here with plain HMAC-SHA256 (another path through OpenSSL).
#include "core/link_keys.h"

#include <gtest/gtest.h>
#include <openssl/hmac.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace memoffload::daemon {
namespace {

const std::string kHex64 = std::string(64, 'a');  // 32 bytes of 0xaa

std::string Hmac(const std::string& key, const std::string& data) {
  unsigned char out[32];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len);
  return std::string(reinterpret_cast<char*>(out), len);
}

std::string Field(const std::string& s) {
  const uint32_t n = static_cast<uint32_t>(s.size());
  std::string out;
  for (int i = 3; i >= 0; --i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + s;
}

TEST(LinkKeys, TheJobKeyIsRfc5869HkdfOverTheLabelUidAndJob) {
  const std::string secret(32, '\xaa');
  Result<std::string> key = DeriveLinkKey(secret, 1000, "run-42");
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  // Extract with no salt (HashLen zeros), expand one block.
  const std::string prk = Hmac(std::string(32, '\0'), secret);
  const std::string info = std::string(kLinkKeyLabel) + Field("1000") + Field("run-42");
  EXPECT_EQ(*key, Hmac(prk, info + '\x01'));
  // Another uid or job id: another key; the same: the same key.
  EXPECT_NE(*key, *DeriveLinkKey(secret, 1001, "run-42"));
  EXPECT_NE(*key, *DeriveLinkKey(secret, 1000, "run-4"));
  EXPECT_NE(*DeriveLinkKey(secret, 1, "23"), *DeriveLinkKey(secret, 12, "3"));  // length-prefixed
  EXPECT_EQ(*key, *DeriveLinkKey(secret, 1000, "run-42"));
}

TEST(LinkKeys, TheKeyFileNamesEachKeyAndRefusesWhatIsWrong) {
  Result<std::vector<LinkSecret>> two =
      ParseLinkSecrets("# rotated 2026-11\nnew " + kHex64 + "\n  old\t" + kHex64 + "  # old\n\n");
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*two)[0].id, "new");
  EXPECT_EQ((*two)[1].id, "old");
  EXPECT_EQ((*two)[0].secret, std::string(32, '\xaa'));
  for (const std::string& bad : std::vector<std::string>{
           "", "k", "k abc", "k " + std::string(62, 'a'), "k " + std::string(64, 'g'),
           "k/x " + kHex64, "k " + kHex64 + "\nk " + kHex64}) {
    Result<std::vector<LinkSecret>> r = ParseLinkSecrets(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
  EXPECT_NE(ParseLinkSecrets("x\n" + std::string("k ") + std::string(40, 'a'))
                .status()
                .message()
                .find("line 1"),
            std::string::npos);
}

class KeyFile {
 public:
  explicit KeyFile(const std::string& text, mode_t mode) {
    char name[] = "/tmp/memoffload-keys-XXXXXX";
    const int fd = mkstemp(name);
    path_ = name;
    if (write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) ADD_FAILURE();
    close(fd);
    chmod(path_.c_str(), mode);
  }
  ~KeyFile() { unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(LinkKeys, OnlyAFileNobodyElseCanReadIsLoadedAndEveryKeyIsServed) {
  LinkKeys keys;
  Result<std::vector<DerivedLinkKey>> none = keys.KeysFor(1000, "job");
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound) << none.status().ToString();
  KeyFile readable("a " + kHex64 + "\n", 0644);
  const Status refused = keys.Load(readable.path());
  EXPECT_EQ(refused.code(), StatusCode::kPermissionDenied) << refused.ToString();
  EXPECT_NE(refused.message().find("chmod 0400"), std::string::npos) << refused.message();
  KeyFile good("a " + kHex64 + "\nb " + std::string(64, 'b') + "\n", 0400);
  ASSERT_TRUE(keys.Load(good.path()).ok());
  EXPECT_EQ(keys.Ids(), "a, b");
  Result<std::vector<DerivedLinkKey>> served = keys.KeysFor(1000, "job");
  ASSERT_TRUE(served.ok()) << served.status().ToString();
  ASSERT_EQ(served->size(), 2u);
  EXPECT_EQ((*served)[0].id, "a");
  EXPECT_EQ((*served)[0].key, *DeriveLinkKey(std::string(32, '\xaa'), 1000, "job"));
  EXPECT_EQ(keys.KeysFor(1000, "").status().code(), StatusCode::kFailedPrecondition);
  // A reload that fails keeps what was loaded.
  EXPECT_FALSE(keys.Load(readable.path()).ok());
  EXPECT_EQ(keys.Ids(), "a, b");
  // Without a file, a node that requires one refuses.
  LinkKeys required(/*required=*/true);
  EXPECT_EQ(required.KeysFor(1000, "job").status().code(), StatusCode::kFailedPrecondition);
}

// A Kubernetes Secret's file is a symlink into a timestamped dir, through a
// "..data" symlink, in a sticky dir of root's: loaded. The same file reached
// through a dir another uid could write, or a symlink another uid owns: the
// key could be another's, so it is refused naming the place.
TEST(LinkKeys, SymlinksAreFollowedOnlyWhereOnlyRootOrTheDaemonCouldMakeThem) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to make files of another uid";
  char base_template[] = "/tmp/link-keys-XXXXXX";
  const std::string base = mkdtemp(base_template);
  const std::string secret = base + "/secret";  // as kubelet mounts a Secret
  ASSERT_EQ(mkdir(secret.c_str(), 0755), 0);
  ASSERT_EQ(chmod(secret.c_str(), 01777), 0);
  ASSERT_EQ(mkdir((secret + "/..2026_11_29").c_str(), 0755), 0);
  std::ofstream(secret + "/..2026_11_29/replication-key") << "k8s " << kHex64 << "\n";
  ASSERT_EQ(chmod((secret + "/..2026_11_29/replication-key").c_str(), 0400), 0);
  ASSERT_EQ(symlink("..2026_11_29", (secret + "/..data").c_str()), 0);
  ASSERT_EQ(symlink("..data/replication-key", (secret + "/replication-key").c_str()), 0);
  LinkKeys keys;
  const Status loaded = keys.Load(secret + "/replication-key");
  EXPECT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_EQ(keys.Ids(), "k8s");

  const std::string open = base + "/open";  // anyone may replace what is in it
  ASSERT_EQ(mkdir(open.c_str(), 0755), 0);
  ASSERT_EQ(chmod(open.c_str(), 0777), 0);
  ASSERT_EQ(symlink((secret + "/replication-key").c_str(), (open + "/key").c_str()), 0);
  const Status through_open = keys.Load(open + "/key");
  EXPECT_EQ(through_open.code(), StatusCode::kPermissionDenied) << through_open.ToString();
  EXPECT_NE(through_open.message().find("directory " + open + " on its way has mode 0777"),
            std::string::npos)
      << through_open.message();

  const std::string theirs = secret + "/theirs";  // another uid's link in the sticky dir
  ASSERT_EQ(symlink("..data/replication-key", theirs.c_str()), 0);
  ASSERT_EQ(lchown(theirs.c_str(), 65534, 65534), 0);
  const Status their_link = keys.Load(theirs);
  EXPECT_EQ(their_link.code(), StatusCode::kPermissionDenied) << their_link.ToString();
  EXPECT_NE(their_link.message().find("symlink " + theirs + " belongs to uid 65534"),
            std::string::npos)
      << their_link.message();
  EXPECT_EQ(keys.Ids(), "k8s");  // what was loaded stays
  std::filesystem::remove_all(base);
}

}  // namespace
}  // namespace memoffload::daemon
