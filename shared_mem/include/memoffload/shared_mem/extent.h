// Extent: a byte range inside one chunk of the arena. The unit in which the
// daemon hands out memory and the client addresses it.
#ifndef MEMOFFLOAD_SHARED_MEM_EXTENT_H_
#define MEMOFFLOAD_SHARED_MEM_EXTENT_H_

#include <cstdint>

namespace memoffload {

struct Extent {
  uint32_t chunk = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const Extent& o) const {
    return chunk == o.chunk && offset == o.offset && length == o.length;
  }
};

}  // namespace memoffload

#endif  // MEMOFFLOAD_SHARED_MEM_EXTENT_H_
