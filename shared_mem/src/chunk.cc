#include "memoffload/shared_mem/chunk.h"

#include <fcntl.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "memoffload/shared_mem/units.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace memoffload {

uint64_t SystemPageBytes() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

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
                               strerror(err) +
                               "); reserve hugepages with 'sysctl vm.nr_hugepages=N'");
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
  void* p = mmap(nullptr, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    if (hugepages) {
      return ResourceExhausted("mapping a hugepage memfd of " + FormatSize(size_bytes) +
                               " failed (" + strerror(err) +
                               "); reserve hugepages with 'sysctl vm.nr_hugepages=N'");
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
  int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
  void* p = mmap(nullptr, size_bytes, PROT_READ | PROT_WRITE, flags, fd, 0);
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
  if (data_ != nullptr) munmap(data_, size_bytes_);
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  fd_ = -1;
  size_bytes_ = 0;
  locked_ = false;
}

Status Chunk::Prefault(uint64_t offset, uint64_t length) {
  if (offset > size_bytes_ || length > size_bytes_ - offset) {
    return InvalidArgument("prefault range beyond chunk");
  }
  if (length == 0) return Status::Ok();
  if (madvise(data_ + offset, length, MADV_POPULATE_WRITE) == 0) {
    return Status::Ok();
  }
  // Older kernels: rewrite one byte per page with its own value, which
  // faults the page in for writing and keeps the contents.
  const uint64_t page = SystemPageBytes();
  volatile uint8_t* p = data_ + offset;
  for (uint64_t i = 0; i < length; i += page) p[i] = p[i];
  return Status::Ok();
}

Status Chunk::Lock() {
  if (mlock(data_, size_bytes_) != 0) return ErrnoStatus("mlock", errno);
  locked_ = true;
  return Status::Ok();
}

}  // namespace memoffload
