// region_worker: a process that writes or reads one checkpoint region, for
// the regions integration tests (a writer killed before its commit, a reader
// of another uid).
//
//   region_worker write RUNTIME_DIR JOB NAME SIZE commit|kill
//   region_worker read  RUNTIME_DIR JOB NAME SIZE
//
// The bytes are Pattern(i). Prints "OK" or "ERR <CODE> <message>"; `kill`
// prints "WRITTEN" once the bytes are in place and then SIGKILLs itself
// before the commit.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "memoffload/client/client.h"

namespace {

using memoffload::Status;

uint8_t Pattern(uint64_t i) { return static_cast<uint8_t>((i * 131 + 17) ^ (i >> 12)); }

int Fail(const Status& st) {
  std::printf("ERR %s %s\n", memoffload::StatusCodeName(st.code()), st.message().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: region_worker write|read DIR JOB NAME SIZE [commit|kill]\n");
    return 2;
  }
  const std::string mode = argv[1];
  memoffload::client::AttachOptions options;
  options.runtime_dir = argv[2];
  options.job_id = argv[3];
  const std::string name = argv[4];
  const uint64_t size = std::strtoull(argv[5], nullptr, 10);
  auto client = memoffload::client::Client::Attach(options);
  if (!client.ok()) return Fail(client.status());
  std::vector<uint8_t> bytes(size);
  if (mode == "write" && argc == 7) {
    for (uint64_t i = 0; i < size; ++i) bytes[i] = Pattern(i);
    auto r = (*client)->CreateRegion(name, size);
    if (!r.ok()) return Fail(r.status());
    if (Status st = (*client)->Write(r->extents, 0, bytes.data(), size); !st.ok()) return Fail(st);
    if (std::strcmp(argv[6], "kill") == 0) {
      std::printf("WRITTEN\n");
      std::fflush(stdout);
      raise(SIGKILL);
    }
    auto crcs = (*client)->ExtentChecksums(r->extents, size);
    if (!crcs.ok()) return Fail(crcs.status());
    auto c = (*client)->CommitRegion(name, size, *crcs);
    if (!c.ok()) return Fail(c.status());
    std::printf("OK\n");
    return 0;
  }
  if (mode == "read") {
    auto p = (*client)->OpenRegion(name);
    if (!p.ok()) return Fail(p.status());
    if (p->used_bytes != size) {
      std::printf("ERR SIZE %lu\n", static_cast<unsigned long>(p->used_bytes));
      return 1;
    }
    if (Status st = (*client)->Read(p->extents, 0, bytes.data(), size); !st.ok()) return Fail(st);
    for (uint64_t i = 0; i < size; ++i) {
      if (bytes[i] != Pattern(i)) {
        std::printf("ERR BYTES at %lu\n", static_cast<unsigned long>(i));
        return 1;
      }
    }
    std::printf("OK\n");
    return 0;
  }
  std::fprintf(stderr, "region_worker: bad arguments\n");
  return 2;
}
