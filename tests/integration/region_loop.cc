// region_loop: a rank that writes and checks checkpoint regions, for the
// tests that restart the daemon under it (tests/deploy/test_systemd_boot.py
// copies it into the systemd container). Each region's bytes follow from
// its name, so any process can check them.
//
//   region_loop loop DIR JOB PREFIX
//     commits regions PREFIX-0, PREFIX-1, ... of kSize bytes until the
//     daemon goes away, printing each name once its commit was answered;
//     keeps the last 20 (prints "deleting NAME" before each delete); ends
//     with "stopped: <why>" and exit 0.
//   region_loop check DIR JOB
//     opens every region of the job with its checksums verified, compares
//     its bytes, prints each name, then "checked N"; exit 1 on a mismatch.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "memoffload/client/region_io.h"

using memoffload::client::RegionStore;
using memoffload::client::RegionStoreOptions;

namespace {

constexpr uint64_t kSize = (192 << 10) - 7;

std::vector<uint8_t> Content(const std::string& name) {
  uint64_t x = 1469598103934665603ull;  // FNV-1a of the name seeds xorshift
  for (char c : name) x = (x ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  std::vector<uint8_t> out(kSize);
  for (uint8_t& b : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<uint8_t>(x);
  }
  return out;
}

std::unique_ptr<RegionStore> Attach(const char* dir, const char* job) {
  RegionStoreOptions options;
  options.runtime_dir = dir;
  options.job_id = job;
  options.rank = 0;
  auto store = RegionStore::Attach(options);
  if (!store.ok()) {
    std::fprintf(stderr, "region_loop: attach: %s\n", store.status().ToString().c_str());
    return nullptr;
  }
  return std::move(store).value();
}

int Loop(const char* dir, const char* job, const std::string& prefix) {
  auto store = Attach(dir, job);
  if (store == nullptr) return 1;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("ready\n");
  for (int i = 0;; ++i) {
    const std::string name = prefix + "-" + std::to_string(i);
    const std::vector<uint8_t> data = Content(name);
    auto w = store->Create(name, data.size());
    memoffload::Status st = w.ok() ? memoffload::Status::Ok() : w.status();
    if (st.ok()) st = (*w)->Append(data.data(), data.size()).status();
    if (st.ok()) st = (*w)->Commit().status();
    if (!st.ok()) {
      std::printf("stopped: %s\n", st.ToString().c_str());
      return 0;
    }
    std::printf("%s\n", name.c_str());
    if (i >= 20) {
      const std::string old = prefix + "-" + std::to_string(i - 20);
      std::printf("deleting %s\n", old.c_str());
      if (auto d = store->Delete(old); !d.ok()) {
        std::printf("stopped: %s\n", d.status().ToString().c_str());
        return 0;
      }
    }
  }
}

int Check(const char* dir, const char* job) {
  auto store = Attach(dir, job);
  if (store == nullptr) return 1;
  auto list = store->List();
  if (!list.ok()) {
    std::fprintf(stderr, "region_loop: list: %s\n", list.status().ToString().c_str());
    return 1;
  }
  for (const auto& info : *list) {
    auto r = store->Open(info.name, /*verify=*/true);
    if (!r.ok()) {
      std::fprintf(stderr, "region_loop: open %s: %s\n", info.name.c_str(),
                   r.status().ToString().c_str());
      return 1;
    }
    auto bytes = (*r)->Read(0, kSize);
    const std::vector<uint8_t> want = Content(info.name);
    if (!bytes.ok() || bytes->size() != want.size() ||
        std::memcmp(bytes->data(), want.data(), want.size()) != 0) {
      std::fprintf(stderr, "region_loop: %s came back different\n", info.name.c_str());
      return 1;
    }
    std::printf("%s\n", info.name.c_str());
  }
  std::printf("checked %zu\n", list->size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && std::strcmp(argv[1], "loop") == 0) return Loop(argv[2], argv[3], argv[4]);
  if (argc == 4 && std::strcmp(argv[1], "check") == 0) return Check(argv[2], argv[3]);
  std::fprintf(stderr, "usage: region_loop loop DIR JOB PREFIX | check DIR JOB\n");
  return 2;
}
