// A daemon with small chunks (so that regions span several extents) and a
// RegionStore of job "train" on it: what the region tests start from.
#ifndef MEMOFFLOAD_TESTS_INTEGRATION_REGION_STORES_H_
#define MEMOFFLOAD_TESTS_INTEGRATION_REGION_STORES_H_

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "daemon_process.h"
#include "memoffload/client/region_io.h"

namespace memoffload::testing {

inline std::unique_ptr<DaemonProcess> StartSmallChunks(const std::string& arena = "256MiB") {
  DaemonProcess::Options options;
  options.arena_size = arena;
  options.chunk_size = "4MiB";
  std::string error;
  auto daemon = DaemonProcess::Start(options, &error);
  EXPECT_NE(daemon, nullptr) << error;
  return daemon;
}

inline std::unique_ptr<client::RegionStore> TrainStore(const DaemonProcess& d) {
  client::RegionStoreOptions options;
  options.runtime_dir = d.runtime_dir();
  options.job_id = "train";
  auto store = client::RegionStore::Attach(options);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  return store.ok() ? std::move(store).value() : nullptr;
}

}  // namespace memoffload::testing

#endif  // MEMOFFLOAD_TESTS_INTEGRATION_REGION_STORES_H_
