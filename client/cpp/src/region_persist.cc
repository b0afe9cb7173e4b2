// PersistRegion (region_persist.h).
#include "memoffload/client/region_persist.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "memoffload/common/crc32c.h"

namespace memoffload::client {
namespace {

constexpr uint64_t kDirectAlign = 4096;  // O_DIRECT: buffer, offset and length

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// What a failed file operation means to the caller, by errno.
Status FileStatus(const std::string& what, int errno_value) {
  const std::string message = what + ": " + std::strerror(errno_value);
  switch (errno_value) {
    case EEXIST:
      return Status(StatusCode::kAlreadyExists, message);
    case ENOSPC:
    case EDQUOT:
      return ResourceExhausted(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return PermissionDenied(message);
    case ELOOP:
      return PermissionDenied(message + " (a symlink)");
    default:
      return Internal(message);
  }
}

Status WriteAll(int fd, const uint8_t* data, uint64_t length, uint64_t offset,
                const std::string& what) {
  while (length > 0) {
    const ssize_t n = pwrite(fd, data, length, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return FileStatus("writing " + what, errno);
    }
    if (n == 0) return Internal("writing " + what + ": the write made no progress");
    data += n;
    offset += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// Direct writes of [data, data + length) at `offset` (all aligned), in up to
// kDepth parts written at once: one outstanding direct write leaves most
// disks idle between requests.
constexpr int kDepth = 4;
constexpr uint64_t kMinPart = 1 << 20;

Status WriteDirect(int fd, const uint8_t* data, uint64_t length, uint64_t offset,
                   const std::string& what) {
  const uint64_t parts = std::clamp<uint64_t>(length / kMinPart, 1, kDepth);
  if (parts == 1) return WriteAll(fd, data, length, offset, what);
  const uint64_t part = (length / parts + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  std::vector<std::thread> threads;
  std::vector<Status> done(parts);
  for (uint64_t i = 0; i < parts; ++i) {
    const uint64_t from = i * part;
    if (from >= length) break;
    const uint64_t n = std::min(part, length - from);
    threads.emplace_back(
        [&, i, from, n] { done[i] = WriteAll(fd, data + from, n, offset + from, what); });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : done) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

// One span at `offset` of the file: its page-aligned middle through `direct`
// (when open and the span's address lines up with the file offset), the
// rest through `buffered`.
Status WriteSpan(int direct, int buffered, const uint8_t* data, uint64_t length, uint64_t offset,
                 const std::string& what) {
  uint64_t lead = (kDirectAlign - offset % kDirectAlign) % kDirectAlign;
  const bool lined_up = (reinterpret_cast<uintptr_t>(data) + lead) % kDirectAlign == 0;
  if (direct < 0 || !lined_up || lead >= length) {
    return WriteAll(buffered, data, length, offset, what);
  }
  const uint64_t middle = (length - lead) / kDirectAlign * kDirectAlign;
  if (Status s = WriteAll(buffered, data, lead, offset, what); !s.ok()) return s;
  if (Status s = WriteDirect(direct, data + lead, middle, offset + lead, what); !s.ok()) return s;
  return WriteAll(buffered, data + lead + middle, length - lead - middle, offset + lead + middle,
                  what);
}

double Since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

Result<PersistStats> Persist(RegionReader& reader, int buffered, int direct,
                             const std::string& what, const PersistOptions& options) {
  PersistStats stats;
  stats.direct = direct >= 0;
  const auto start = std::chrono::steady_clock::now();
  const uint64_t size = reader.size_bytes();
  const uint64_t piece = std::max<uint64_t>(options.piece_bytes / kDirectAlign, 1) * kDirectAlign;
  const double share = std::clamp(options.share, 0.001, 1.0);
  std::vector<ArenaSpan> spans;
  for (uint64_t offset = 0; offset < size; offset += piece) {
    const auto busy_from = std::chrono::steady_clock::now();
    const uint64_t n = std::min(piece, size - offset);
    uint32_t crc = 0;
    spans.clear();
    if (Status s = reader.View(offset, n, &spans, &crc); !s.ok()) return s;
    stats.crc32c = offset == 0 ? crc : Crc32cCombine(stats.crc32c, crc, n);
    uint64_t at = offset;
    for (const ArenaSpan& span : spans) {
      if (Status s = WriteSpan(direct, buffered, span.data, span.length, at, what); !s.ok()) {
        return s;
      }
      at += span.length;
    }
    const double busy = Since(busy_from);
    stats.busy_seconds += busy;
    if (share < 1.0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(busy * (1.0 / share - 1.0)));
    }
  }
  if (Status s = reader.VerifyRest(); !s.ok()) return s;
  if (fsync(buffered) != 0) return FileStatus("syncing " + what, errno);
  stats.bytes = size;
  stats.seconds = Since(start);
  return stats;
}

}  // namespace

Result<PersistStats> PersistRegion(RegionReader& reader, int dir_fd, const std::string& file_name,
                                   const PersistOptions& options) {
  if (file_name.empty() || file_name == "." || file_name == ".." ||
      file_name.find('/') != std::string::npos) {
    return InvalidArgument("'" + file_name + "' is not one path component");
  }
  const std::string what = file_name + " (region " + reader.name() + ")";
  const int flags = O_WRONLY | O_CLOEXEC | O_NOFOLLOW;
  Fd buffered(openat(dir_fd, file_name.c_str(), flags | O_CREAT | O_EXCL, 0600));
  if (buffered.get() < 0) return FileStatus("creating " + what, errno);
  // The same open file again with O_DIRECT, through its descriptor (never
  // its name, which could be swapped meanwhile); where that fails, buffered.
  const std::string self = "/proc/self/fd/" + std::to_string(buffered.get());
  Fd direct(options.direct ? open(self.c_str(), O_WRONLY | O_CLOEXEC | O_DIRECT) : -1);
  Result<PersistStats> done = Persist(reader, buffered.get(), direct.get(), what, options);
  if (!done.ok()) unlinkat(dir_fd, file_name.c_str(), 0);  // never a partial or damaged file
  return done;
}

Result<PersistStats> PersistRegion(RegionStore& store, const std::string& name, int dir_fd,
                                   const std::string& file_name, const PersistOptions& options) {
  Result<std::unique_ptr<RegionReader>> opened =
      store.Open(name, /*verify=*/true, /*verify_as_read=*/true);
  if (!opened.ok()) return opened.status();
  Result<PersistStats> done = PersistRegion(**opened, dir_fd, file_name, options);
  Status closed = (*opened)->Close();
  if (done.ok() && !closed.ok()) done = closed;
  return done;
}

}  // namespace memoffload::client
