#include "memoffload/shared_mem/chunk.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#include "memoffload/common/units.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MLOCK_ONFAULT
#define MLOCK_ONFAULT 0x01
#endif

namespace memoffload {

namespace {

constexpr int kMpolBind = 2;  // MPOL_BIND from <linux/mempolicy.h>

// A "Key: N kB" or "Key: N" field of /proc/meminfo, 0 if absent.
uint64_t MeminfoField(const char* key) {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t value = 0;
  const size_t key_len = std::strlen(key);
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, key, key_len) == 0 && line[key_len] == ':') {
      unsigned long long n = 0;
      char unit[8] = "";
      if (std::sscanf(line + key_len + 1, "%llu %7s", &n, unit) >= 1) {
        value = std::strcmp(unit, "kB") == 0 ? n * 1024 : n;
      }
      break;
    }
  }
  std::fclose(f);
  return value;
}

// A mapping of `size_bytes` of `fd` at a 2 MiB-aligned address, advised
// MADV_HUGEPAGE (shared-memory THP maps a 2 MiB page with one PMD only where
// the virtual address is aligned as the file offset is). Huge pages may be
// refused (the node's setting, fragmentation): the advice is best effort.
void* MapAligned(int fd, uint64_t size_bytes, int extra_flags) {
  constexpr uint64_t kAlign = 2ull << 20;
  void* area = mmap(nullptr, size_bytes + kAlign, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (area == MAP_FAILED) return MAP_FAILED;
  auto* base = static_cast<uint8_t*>(area);
  auto* aligned =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(base) + kAlign - 1) & ~(kAlign - 1));
  void* p = mmap(aligned, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | extra_flags,
                 fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    munmap(area, size_bytes + kAlign);
    errno = err;
    return MAP_FAILED;
  }
  if (aligned > base) munmap(base, aligned - base);
  const uint64_t tail = (base + size_bytes + kAlign) - (aligned + size_bytes);
  if (tail > 0) munmap(aligned + size_bytes, tail);
  (void)madvise(p, size_bytes, MADV_HUGEPAGE);  // EINVAL without THP: nothing to advise
  return p;
}

std::string ReadSmall(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return "";
  char buf[256];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  return std::string(buf, n);
}

}  // namespace

std::string SelectedWord(const std::string& contents) {
  const size_t open = contents.find('[');
  const size_t close = contents.find(']', open == std::string::npos ? 0 : open);
  if (open == std::string::npos || close == std::string::npos) return "";
  return contents.substr(open + 1, close - open - 1);
}

ShmemThpSetting ReadShmemThpSetting() {
  const std::string dir = "/sys/kernel/mm/transparent_hugepage/";
  return {SelectedWord(ReadSmall(dir + "shmem_enabled")),
          SelectedWord(ReadSmall(dir + "hugepages-2048kB/shmem_enabled"))};
}

bool ShmemThpSetting::allows_advised() const {
  const std::string& in_force = pmd_size.empty() || pmd_size == "inherit" ? global : pmd_size;
  return in_force == "advise" || in_force == "always" || in_force == "within_size" ||
         in_force == "force";
}

Result<std::vector<MappingPages>> PagesOf(const std::vector<const void*>& starts) {
  std::vector<MappingPages> out(starts.size());
  std::vector<bool> found(starts.size(), false);
  std::unordered_map<unsigned long, size_t> index;
  for (size_t i = 0; i < starts.size(); ++i) {
    index[reinterpret_cast<unsigned long>(starts[i])] = i;
  }
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return ErrnoStatus("opening /proc/self/smaps", errno);
  char line[512];
  MappingPages* in = nullptr;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    // A mapping's header starts with its range in lower-case hex
    // ("7f..-7f.. rw-s ..."); its fields ("Rss:      4 kB") with a capital.
    const auto first = static_cast<unsigned char>(line[0]);
    if (std::isxdigit(first) && !std::isupper(first)) {
      in = nullptr;
      auto it = index.find(std::strtoul(line, nullptr, 16));
      if (it != index.end()) {
        in = &out[it->second];
        found[it->second] = true;
      }
      continue;
    }
    if (in == nullptr) continue;
    unsigned long long kb = 0;
    if (std::sscanf(line, "KernelPageSize: %llu kB", &kb) == 1) in->kernel_page_bytes = kb << 10;
    if (std::sscanf(line, "ShmemPmdMapped: %llu kB", &kb) == 1) in->pmd_mapped_bytes = kb << 10;
    if (std::sscanf(line, "Rss: %llu kB", &kb) == 1) in->rss_bytes = kb << 10;
    if (std::sscanf(line, "Size: %llu kB", &kb) == 1) in->size_bytes = kb << 10;
  }
  std::fclose(f);
  for (size_t i = 0; i < starts.size(); ++i) {
    if (!found[i]) {
      char where[32];
      std::snprintf(where, sizeof(where), "%lx", reinterpret_cast<unsigned long>(starts[i]));
      return NotFound(std::string("no mapping starts at ") + where);
    }
  }
  return out;
}

bool IsHugetlbFd(int fd) {
  struct statfs fs {};
  return fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC;
}

uint64_t SystemPageBytes() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

uint64_t DefaultHugePageBytes() { return MeminfoField("Hugepagesize"); }
uint64_t FreeHugePages() { return MeminfoField("HugePages_Free"); }

Result<Chunk> Chunk::Create(const std::string& name, uint64_t size_bytes, bool hugepages) {
  if (size_bytes == 0 || size_bytes % SystemPageBytes() != 0) {
    return InvalidArgument("chunk size " + std::to_string(size_bytes) +
                           " is not a positive multiple of the page size");
  }
  unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING;
  if (hugepages) flags |= MFD_HUGETLB;
  int fd = memfd_create(name.c_str(), flags);
  if (fd < 0) {
    const int err = errno;
    if (hugepages) {
      return ResourceExhausted(std::string("memfd_create with MFD_HUGETLB failed (") +
                               strerror(err) + ")");
    }
    return ErrnoStatus("memfd_create", err);
  }
  if (ftruncate(fd, static_cast<off_t>(size_bytes)) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoStatus("ftruncate memfd to " + FormatSize(size_bytes), err);
  }
  // Hugetlbfs memfds do not support sealing; their size cannot change anyway
  // once mapped pages exist, and clients cannot shrink below mapped pages.
  if (!hugepages && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoStatus("sealing memfd", err);
  }
  // A hugetlbfs mapping is aligned to its page by the kernel; a shared
  // memory one is aligned here, for transparent huge pages.
  void* p = hugepages ? mmap(nullptr, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                      : MapAligned(fd, size_bytes, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    if (hugepages) {
      return ResourceExhausted("mapping a hugepage memfd of " + FormatSize(size_bytes) +
                               " failed (" + strerror(err) + "; " +
                               std::to_string(FreeHugePages()) + " hugepages free)");
    }
    return ErrnoStatus("mmap memfd of " + FormatSize(size_bytes), err);
  }
  return Chunk(fd, static_cast<uint8_t*>(p), size_bytes);
}

Result<Chunk> Chunk::Map(int fd, uint64_t size_bytes, bool populate) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoStatus("fstat chunk fd", err);
  }
  if (static_cast<uint64_t>(st.st_size) < size_bytes) {
    close(fd);
    return InvalidArgument("chunk fd holds " + std::to_string(st.st_size) +
                           " bytes, expected at least " + std::to_string(size_bytes));
  }
  // Aligned and advised as the daemon's mapping is: a chunk on huge pages is
  // then mapped with one page-table entry per 2 MiB here too.
  void* p = MapAligned(fd, size_bytes, populate ? MAP_POPULATE : 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return ErrnoStatus("mmap chunk of " + FormatSize(size_bytes), err);
  }
  return Chunk(fd, static_cast<uint8_t*>(p), size_bytes);
}

Chunk::~Chunk() { Reset(); }

Chunk::Chunk(Chunk&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      locked_(std::exchange(other.locked_, false)) {}

Chunk& Chunk::operator=(Chunk&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    locked_ = std::exchange(other.locked_, false);
  }
  return *this;
}

void Chunk::Reset() {
  if (data_ != nullptr) {
    // An unmap holds the process's mmap lock while it runs (a populated
    // 1 GiB mapping: a tenth of a second), and the daemon drops old backings
    // while Reserves map new ones under its session table's lock: in pieces.
    // Whatever a piece cannot do (a 1 GiB hugepage mapping) goes in one call.
    uint64_t done = 0;
    while (size_bytes_ - done > kMmapLockPiece && munmap(data_ + done, kMmapLockPiece) == 0) {
      done += kMmapLockPiece;
    }
    munmap(data_ + done, size_bytes_ - done);
  }
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  fd_ = -1;
  size_bytes_ = 0;
  locked_ = false;
}

Status Chunk::Prefault(uint64_t offset, uint64_t length, uint64_t piece_bytes) {
  if (offset > size_bytes_ || length > size_bytes_ - offset) {
    return InvalidArgument("prefault range beyond chunk");
  }
  uint64_t done = 0;
  while (done < length) {
    const uint64_t n = piece_bytes == 0 ? length : std::min(piece_bytes, length - done);
    if (madvise(data_ + offset + done, n, MADV_POPULATE_WRITE) != 0) break;
    done += n;
  }
  // Older kernels (or a piece a hugepage mapping refuses): rewrite one byte
  // per page with its own value, which faults the page in for writing and
  // keeps the contents.
  const uint64_t page = SystemPageBytes();
  volatile uint8_t* p = data_ + offset;
  for (uint64_t i = done; i < length; i += page) p[i] = p[i];
  return Status::Ok();
}

Status Chunk::MapPages(uint64_t offset, uint64_t length) const {
  if (offset > size_bytes_ || length > size_bytes_ - offset) {
    return InvalidArgument("map range [" + std::to_string(offset) + ", +" + std::to_string(length) +
                           ") beyond chunk of " + std::to_string(size_bytes_) + " bytes");
  }
  if (length == 0) return Status::Ok();
  if (madvise(data_ + offset, length, MADV_POPULATE_READ) == 0) return Status::Ok();
  const uint64_t page = SystemPageBytes();
  volatile const uint8_t* p = data_ + offset;
  for (uint64_t i = 0; i < length; i += page) (void)p[i];
  return Status::Ok();
}

Status Chunk::BindToNode(int node) {
  if (node < 0) return InvalidArgument("NUMA node " + std::to_string(node) + " is negative");
  constexpr int kBitsPerWord = 8 * sizeof(unsigned long);
  std::vector<unsigned long> mask(static_cast<size_t>(node / kBitsPerWord + 1), 0);
  mask[static_cast<size_t>(node / kBitsPerWord)] |= 1ul << (node % kBitsPerWord);
  // maxnode counts bits; the kernel ignores the last one, hence the + 1.
  const unsigned long max_node = mask.size() * kBitsPerWord + 1;
  if (syscall(SYS_mbind, data_, size_bytes_, kMpolBind, mask.data(), max_node, 0) != 0) {
    return ErrnoStatus("mbind to NUMA node " + std::to_string(node), errno);
  }
  return Status::Ok();
}

Status Chunk::LockOnFault() {
  if (syscall(SYS_mlock2, data_, size_bytes_, MLOCK_ONFAULT) != 0) {
    const int err = errno;
    if (err == ENOSYS || err == EINVAL) {
      return Status(StatusCode::kUnimplemented, "mlock2(MLOCK_ONFAULT) is not supported");
    }
    return ErrnoStatus("mlock2", err);
  }
  locked_ = true;
  return Status::Ok();
}

Status Chunk::Lock() {
  if (mlock(data_, size_bytes_) != 0) return ErrnoStatus("mlock", errno);
  locked_ = true;
  return Status::Ok();
}

}  // namespace memoffload
