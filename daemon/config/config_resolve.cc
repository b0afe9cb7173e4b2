// ResolveAndValidate: a loaded config's defaults that depend on the machine
// or on other settings filled in, and every range and cross-setting rule
// checked (config.h).
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "config/config.h"
#include "memoffload/common/runtime_dir.h"
#include "memoffload/common/units.h"
#include "memoffload/shared_mem/chunk.h"

namespace memoffload::daemon {

namespace {

// arena.size: the default min(1GiB, 25% of RAM) when not set, rounded down
// to the page, at least one page and at most the machine's RAM.
Status ResolveArenaSize(DaemonConfig* c, uint64_t page, uint64_t ram) {
  if (c->arena_size_bytes == 0) {
    // 0 is what "not set" looks like inside; a 0 someone wrote is a mistake.
    auto source = c->sources.find("arena.size");
    if (source != c->sources.end() && source->second != "default") {
      return InvalidArgument("arena.size: 0 is not a size; give a size like 512MiB, or leave " +
                             std::string("the setting out for the default min(1GiB, 25% of RAM)"));
    }
    c->arena_size_bytes = std::min<uint64_t>(kGiB, ram / 4);
  }
  c->arena_size_bytes = c->arena_size_bytes / page * page;
  if (c->arena_size_bytes == 0) {
    return InvalidArgument("arena.size: must be at least one page (" + std::to_string(page) +
                           " bytes)");
  }
  if (ram != 0 && c->arena_size_bytes > ram) {
    return InvalidArgument("arena.size: " + FormatSize(c->arena_size_bytes) +
                           " exceeds this machine's RAM of " + FormatSize(ram));
  }
  return Status::Ok();
}

// arena.chunk_size: min(1GiB, the arena) when not set, a multiple of the
// page, at most the arena and at most 65536 chunks.
Status ResolveChunkSize(DaemonConfig* c, uint64_t page) {
  if (c->chunk_size_bytes == 0) c->chunk_size_bytes = std::min<uint64_t>(kGiB, c->arena_size_bytes);
  if (c->chunk_size_bytes % page != 0) {
    return InvalidArgument("arena.chunk_size: " + std::to_string(c->chunk_size_bytes) +
                           " is not a multiple of the page size (" + std::to_string(page) + ")");
  }
  if (c->chunk_size_bytes > c->arena_size_bytes) c->chunk_size_bytes = c->arena_size_bytes;
  const uint64_t chunks = (c->arena_size_bytes + c->chunk_size_bytes - 1) / c->chunk_size_bytes;
  if (chunks > 65536) {
    return InvalidArgument("arena.chunk_size: " + FormatSize(c->chunk_size_bytes) + " gives " +
                           std::to_string(chunks) +
                           " chunks; at most 65536 are supported, use larger chunks");
  }
  return Status::Ok();
}

// The regions.* limits: defaults derived from the arena where not set, then
// checked against it; regions.ttl within 1ms..30 days.
Status ResolveRegionLimits(DaemonConfig* c, uint64_t page) {
  if (c->policy.region_max_bytes == 0) {
    auto source = c->sources.find("regions.max_bytes");
    if (source == c->sources.end() || source->second == "default") {
      // Half the arena, and at least one chunk: with tenants a region keeps
      // its whole chunk, so less than a chunk would allow no region at all.
      c->policy.region_max_bytes =
          std::max(c->arena_size_bytes / 2 / page * page, c->chunk_size_bytes);
    }
  }
  if (c->policy.region_max_bytes > c->arena_size_bytes) {
    return InvalidArgument("regions.max_bytes: " + FormatSize(c->policy.region_max_bytes) +
                           " is more than the " + FormatSize(c->arena_size_bytes) + " arena");
  }
  // One uid's share of the regions, unless set (0 set: no per-uid limit):
  // half the bytes and an eighth of the count, so that no uid, whatever job
  // ids it names, can take every region slot or byte of the node.
  auto is_default = [c](const char* key) {
    auto source = c->sources.find(key);
    return source == c->sources.end() || source->second == "default";
  };
  if (c->policy.region_uid_max_bytes == 0 && is_default("regions.uid_max_bytes")) {
    c->policy.region_uid_max_bytes = c->policy.region_max_bytes / 2 / page * page;
  }
  if (c->policy.max_regions_per_uid == 0 && is_default("regions.max_per_uid")) {
    c->policy.max_regions_per_uid = std::max<uint64_t>(1, c->policy.max_regions / 8);
  }
  if (c->policy.region_ttl_ms == 0 || c->policy.region_ttl_ms > kMaxRegionTtlMs) {
    return InvalidArgument("regions.ttl: " + std::to_string(c->policy.region_ttl_ms) +
                           "ms is outside 1ms..30 days");
  }
  return Status::Ok();
}

// The waits, timeouts and connection limits, each within its range.
Status CheckTimeoutsAndConnections(const DaemonConfig& c) {
  if (c.policy.max_wait_ms > kMaxWaitLimitMs) {
    return InvalidArgument("quotas.max_wait: " + std::to_string(c.policy.max_wait_ms) +
                           "ms is more than the maximum of " + std::to_string(kMaxWaitLimitMs) +
                           "ms (1h)");
  }
  if (c.policy.reserve_aging_ms > kMaxWaitLimitMs) {
    return InvalidArgument("quotas.reserve_aging: " + std::to_string(c.policy.reserve_aging_ms) +
                           "ms is more than the maximum of " + std::to_string(kMaxWaitLimitMs) +
                           "ms (1h)");
  }
  if (c.hello_timeout_ms < kMinHelloTimeoutMs || c.hello_timeout_ms > kMaxHelloTimeoutMs) {
    return InvalidArgument("lifecycle.hello_timeout: " + std::to_string(c.hello_timeout_ms) +
                           "ms is outside " + std::to_string(kMinHelloTimeoutMs) + "ms.." +
                           std::to_string(kMaxHelloTimeoutMs) + "ms (100ms to 1h)");
  }
  if (c.drain_timeout_ms > kMaxDrainTimeoutMs) {
    return InvalidArgument("lifecycle.drain_timeout: " + std::to_string(c.drain_timeout_ms) +
                           "ms is more than the maximum of " + std::to_string(kMaxDrainTimeoutMs) +
                           "ms (24h)");
  }
  if (c.max_connections == 0 || c.max_connections > kMaxConnectionsLimit) {
    return InvalidArgument("server.max_connections: " + std::to_string(c.max_connections) +
                           " is outside 1.." + std::to_string(kMaxConnectionsLimit));
  }
  if (c.max_connections_per_uid == 0 || c.max_connections_per_uid > c.max_connections) {
    return InvalidArgument(
        "server.max_connections_per_uid: " + std::to_string(c.max_connections_per_uid) +
        " is outside 1.." + std::to_string(c.max_connections) + " (server.max_connections)");
  }
  return Status::Ok();
}

}  // namespace

Status ResolveAndValidate(DaemonConfig* c) {
  if (c->runtime_dir.empty()) c->runtime_dir = DefaultRuntimeDir();
  if (c->keeper_socket.empty()) c->keeper_socket = c->runtime_dir + "/" + "keeper.sock";
  if (c->keeper_socket.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return InvalidArgument("lifecycle.keeper_socket: " + c->keeper_socket +
                           " is too long for a Unix socket path");
  }
  const uint64_t page = SystemPageBytes();
  const uint64_t ram = PhysicalMemoryBytes();
  MEMOFFLOAD_RETURN_IF_ERROR(ResolveArenaSize(c, page, ram));
  MEMOFFLOAD_RETURN_IF_ERROR(ResolveChunkSize(c, page));
  if (c->policy.node_reserve_bytes >= c->arena_size_bytes) {
    return InvalidArgument(
        "quotas.node_reserve_bytes: " + FormatSize(c->policy.node_reserve_bytes) +
        " leaves nothing of the " + FormatSize(c->arena_size_bytes) + " arena");
  }
  MEMOFFLOAD_RETURN_IF_ERROR(ResolveRegionLimits(c, page));
  MEMOFFLOAD_RETURN_IF_ERROR(CheckTimeoutsAndConnections(*c));
  if (c->prefault_threads == 0) {
    c->prefault_threads = static_cast<int>(std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)));
  }
  return Status::Ok();
}

}  // namespace memoffload::daemon
