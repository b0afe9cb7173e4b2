// PersistRegion (client/region_persist.h) against the real daemon: a region
// that spans several extents lands in its file byte for byte with the
// CRC32C of the whole, throttled to its share; what may not be written
// over (a file, a symlink, a path) is refused untouched; a damaged region
// or a missing one leaves no file.
#include "memoffload/client/region_persist.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/client.h"
#include "memoffload/client/region_io.h"
#include "memoffload/common/crc32c.h"
#include "region_stores.h"

namespace memoffload::testing {
namespace {

using client::PersistOptions;
using client::PersistRegion;
using client::RegionStore;

constexpr uint64_t kMiB = 1 << 20;

std::unique_ptr<DaemonProcess> Daemon() { return StartSmallChunks("128MiB"); }

std::unique_ptr<RegionStore> Store(const DaemonProcess& d) { return TrainStore(d); }

std::vector<uint8_t> Pattern(uint64_t size) {
  std::vector<uint8_t> out(size);
  uint32_t x = 7;
  for (uint8_t& b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

void Commit(RegionStore* store, const std::string& name, const std::vector<uint8_t>& data) {
  auto writer = store->Create(name, data.size());
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  ASSERT_TRUE((*writer)->Append(data.data(), data.size()).ok());
  ASSERT_TRUE((*writer)->Commit().ok());
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class Dir {
 public:
  Dir() {
    char tmpl[] = "/tmp/memoffload-persist-XXXXXX";
    path_ = mkdtemp(tmpl);
    fd_ = open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }
  ~Dir() {
    close(fd_);
    std::string cmd = "rm -rf '" + path_ + "'";
    EXPECT_EQ(system(cmd.c_str()), 0);
  }
  int fd() const { return fd_; }
  std::string Path(const std::string& name) const { return path_ + "/" + name; }
  bool Has(const std::string& name) const {
    struct stat st;
    return lstat(Path(name).c_str(), &st) == 0;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

TEST(RegionPersist, WritesTheRegionByteForByteWithItsChecksumWithinItsShare) {
  auto daemon = Daemon();
  ASSERT_NE(daemon, nullptr);
  auto store = Store(*daemon);
  ASSERT_NE(store, nullptr);
  const std::vector<uint8_t> data = Pattern(9 * kMiB + 123);  // 3 extents, an unaligned end
  Commit(store.get(), "dcp/step-1/__0_0.distcp", data);
  Dir dir;
  PersistOptions options;
  options.piece_bytes = kMiB + 5;  // rounded down to whole pages
  options.share = 0.5;
  auto stats = PersistRegion(*store, "dcp/step-1/__0_0.distcp", dir.fd(), "__0_0.distcp", options);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->bytes, data.size());
  EXPECT_EQ(stats->crc32c, Crc32c(data.data(), data.size()));
  const std::string file = Slurp(dir.Path("__0_0.distcp"));
  ASSERT_EQ(file.size(), data.size());
  EXPECT_EQ(std::memcmp(file.data(), data.data(), data.size()), 0);
  struct stat st;
  ASSERT_EQ(stat(dir.Path("__0_0.distcp").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // Half a share: it slept at least as long as it worked.
  EXPECT_GE(stats->seconds, 1.9 * stats->busy_seconds) << stats->busy_seconds;
  // Unthrottled and buffered: the same bytes.
  options.share = 1.0;
  options.direct = false;
  stats = PersistRegion(*store, "dcp/step-1/__0_0.distcp", dir.fd(), "again", options);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_FALSE(stats->direct);
  EXPECT_EQ(Slurp(dir.Path("again")), file);
}

TEST(RegionPersist, NeverWritesOverAFileASymlinkOrThroughAPath) {
  auto daemon = Daemon();
  ASSERT_NE(daemon, nullptr);
  auto store = Store(*daemon);
  ASSERT_NE(store, nullptr);
  Commit(store.get(), "r", Pattern(kMiB));
  Dir dir;
  { std::ofstream(dir.Path("there")) << "mine"; }
  ASSERT_EQ(symlink("/etc/passwd-not-here", dir.Path("link").c_str()), 0);
  EXPECT_EQ(PersistRegion(*store, "r", dir.fd(), "there", {}).status().code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(Slurp(dir.Path("there")), "mine");
  EXPECT_EQ(PersistRegion(*store, "r", dir.fd(), "link", {}).status().code(),
            StatusCode::kAlreadyExists);
  struct stat st;
  EXPECT_NE(stat("/etc/passwd-not-here", &st), 0);
  for (const char* bad : {"a/b", "", ".", ".."}) {
    EXPECT_EQ(PersistRegion(*store, "r", dir.fd(), bad, {}).status().code(),
              StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(RegionPersist, ADamagedOrMissingRegionLeavesNoFile) {
  auto daemon = Daemon();
  ASSERT_NE(daemon, nullptr);
  auto store = Store(*daemon);
  ASSERT_NE(store, nullptr);
  Commit(store.get(), "r", Pattern(9 * kMiB));
  client::AttachOptions options;
  options.runtime_dir = daemon->runtime_dir();
  options.job_id = "train";
  auto other = client::Client::Attach(options);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  auto placement = (*other)->OpenRegion("r", /*verify=*/false);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  (*other)->Address(placement->extents.back())[5] ^=
      0x40;  // the last extent: after pieces were written
  ASSERT_TRUE((*other)->CloseRegion("r").ok());
  Dir dir;
  EXPECT_EQ(PersistRegion(*store, "r", dir.fd(), "damaged", {}).status().code(),
            StatusCode::kDataLoss);
  EXPECT_FALSE(dir.Has("damaged"));
  EXPECT_EQ(PersistRegion(*store, "nope", dir.fd(), "missing", {}).status().code(),
            StatusCode::kNotFound);
  EXPECT_FALSE(dir.Has("missing"));
}

}  // namespace
}  // namespace memoffload::testing
