// CRC32C (Castagnoli), as used for optional per-extent integrity checks.
// Uses the SSE4.2 crc32 instruction when the CPU has it, a table otherwise;
// both give identical results. Thread-safe.
#ifndef MEMOFFLOAD_SHARED_MEM_CRC32C_H_
#define MEMOFFLOAD_SHARED_MEM_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace memoffload {

// Extends `crc` (0 for a fresh checksum) over data[0, length).
uint32_t Crc32c(const void* data, size_t length, uint32_t crc = 0);

// The CRC32C of A followed by B, from crc1 = Crc32c(A), crc2 = Crc32c(B) and
// B's length: one pass over each part serves two checksums (an extent's and
// a piece's that overlaps it). O(log length2).
uint32_t Crc32cCombine(uint32_t crc1, uint32_t crc2, uint64_t length2);

// The portable table implementation, exposed so tests can compare both.
uint32_t Crc32cPortable(const void* data, size_t length, uint32_t crc = 0);

// True when Crc32c uses the hardware instruction.
bool Crc32cIsHardware();

}  // namespace memoffload

#endif  // MEMOFFLOAD_SHARED_MEM_CRC32C_H_
