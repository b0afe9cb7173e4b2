#include "app/handed_chunks.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace memoffload::daemon {
namespace {

constexpr char kMagic[] = "MOHANDED";  // 8 bytes, without its NUL
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 24;
constexpr size_t kGenerationAt = 16;  // u64, after magic, version, count

uint64_t RecordBytes(uint32_t count) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return (kHeaderBytes + count + page - 1) / page * page;
}

}  // namespace

Result<std::unique_ptr<HandedChunks>> HandedChunks::Create(const std::vector<bool>& handed,
                                                           uint64_t generation) {
  const auto count = static_cast<uint32_t>(handed.size());
  Result<Chunk> memfd = Chunk::Create("memoffload-handed", RecordBytes(count), false);
  if (!memfd.ok()) return memfd.status();
  uint8_t* p = memfd->data();
  std::memcpy(p, kMagic, 8);
  std::memcpy(p + 8, &kVersion, 4);
  std::memcpy(p + 12, &count, 4);
  std::memcpy(p + kGenerationAt, &generation, 8);
  for (uint32_t i = 0; i < count; ++i) p[kHeaderBytes + i] = handed[i] ? 1 : 0;
  return std::unique_ptr<HandedChunks>(new HandedChunks(std::move(memfd).value(), count));
}

void HandedChunks::Mark(uint32_t index) {
  if (index < count_) __atomic_store_n(memfd_.data() + kHeaderBytes + index, 1, __ATOMIC_RELAXED);
}

Status DisownHandedChunksFd(int fd) {
  const uint64_t zero = 0;
  if (pwrite(fd, &zero, sizeof zero, kGenerationAt) != static_cast<ssize_t>(sizeof zero)) {
    return DataLoss(std::string("cannot rewrite it: ") + std::strerror(errno));
  }
  return Status::Ok();
}

Result<std::vector<bool>> ReadHandedChunks(int fd, uint32_t chunk_count, uint64_t generation) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return DataLoss(std::string("fstat: ") + std::strerror(errno));
  if (static_cast<uint64_t>(st.st_size) < kHeaderBytes + chunk_count) {
    return DataLoss("holds " + std::to_string(st.st_size) + " bytes, too few for " +
                    std::to_string(chunk_count) + " chunks");
  }
  std::string bytes(kHeaderBytes + chunk_count, '\0');
  if (pread(fd, bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size())) {
    return DataLoss("cannot read it");
  }
  uint32_t version = 0, count = 0;
  uint64_t written_by = 0;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::memcpy(&count, bytes.data() + 12, 4);
  std::memcpy(&written_by, bytes.data() + kGenerationAt, 8);
  if (bytes.compare(0, 8, kMagic) != 0 || version != kVersion) {
    return DataLoss("not a record of handed chunks this daemon reads");
  }
  if (count != chunk_count) {
    return DataLoss("names " + std::to_string(count) + " chunks, the arena has " +
                    std::to_string(chunk_count));
  }
  if (generation == 0 || written_by != generation) {
    return FailedPrecondition("written by another daemon than the newest journal's");
  }
  std::vector<bool> handed(chunk_count);
  for (uint32_t i = 0; i < chunk_count; ++i) {
    const auto b = static_cast<uint8_t>(bytes[kHeaderBytes + i]);
    if (b > 1) return DataLoss("chunk " + std::to_string(i) + " has byte " + std::to_string(b));
    handed[i] = b == 1;
  }
  return handed;
}

}  // namespace memoffload::daemon
