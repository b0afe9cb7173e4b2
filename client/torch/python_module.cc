// memoffload._C: Python bindings of the GroupOffloader, of the admin
// queries (status, the node's regions) and of checkpoint regions (python_regions.cc). Errors become
// Python exceptions here, at the edge: a Status becomes the memoffload.errors class of its code
// (memoffload.Error and one subclass per code, each with .code; InvalidArgument is also a
// ValueError). Blocking calls release the GIL. The saved-tensor hooks are in python_hooks.cc. The
// log lines of the client and of the torch layer (memoffload/client/log.h) are queued from import
// on and taken by Python into its "memoffload" logger.
#include <torch/extension.h>

#include <string>
#include <utility>
#include <vector>

#include "memoffload/client/daemon_status.h"
#include "memoffload/client/log.h"
#include "memoffload/torch/group_offloader.h"
#include "python_errors.h"
#include "python_hooks.h"
#include "python_host_state.h"
#include "python_link.h"
#include "python_regions.h"

namespace py = pybind11;
using memoffload::Result;
using memoffload::Status;
using memoffload::StatusCode;
using memoffload::torch::GroupOffloader;
using memoffload::torch::OffloaderOptions;
using memoffload::torch::OffloaderStats;
using memoffload::torch::SlotStats;
using memoffload::torch::python::Check;
using memoffload::torch::python::Take;
using memoffload::torch::python::WithoutGil;

namespace {

// Maximum number of queued log records between two takes.
constexpr size_t kLogQueueRecords = 1000;

py::object StatusCodeOf(StatusCode code) {
  return py::module_::import("memoffload.errors").attr("StatusCode")(static_cast<int>(code));
}

py::dict StatsDict(const OffloaderStats& s) {
  py::dict d;
  d["offloaded_bytes"] = s.offloaded_bytes;
  d["prefetched_bytes"] = s.prefetched_bytes;
  d["skipped_bytes"] = s.skipped_bytes;
  d["groups"] = s.groups;
  d["groups_offloaded"] = s.groups_offloaded;
  d["groups_skipped"] = s.groups_skipped;
  d["groups_live"] = s.groups_live;
  d["arena_held_bytes"] = s.arena_held_bytes;
  d["tensors"] = s.tensors;
  d["deduplicated"] = s.deduplicated;
  d["caller_copies"] = s.caller_copies;
  d["blocking_rpcs"] = s.blocking_rpcs;
  d["prefetch_waits"] = s.prefetch_waits;
  d["prefetch_wait_seconds"] = s.prefetch_wait_seconds;
  d["rereads"] = s.rereads;
  d["capture_skipped"] = s.capture_skipped;
  d["unpinned_bytes"] = s.unpinned_bytes;
  d["reconnects"] = s.reconnects;
  d["rpc_errors"] = s.rpc_errors;
  d["internal_errors"] = s.internal_errors;
  d["connected"] = s.connected;
  d["engine"] = s.engine;
  d["last_skip_reason"] = s.last_skip_reason;
  d["last_skip_code"] = StatusCodeOf(s.last_skip_code);
  return d;
}

py::dict SlotStatsDict(const SlotStats& s) {
  py::dict d;
  d["groups"] = s.groups;
  d["groups_offloaded"] = s.groups_offloaded;
  d["groups_skipped"] = s.groups_skipped;
  d["groups_live"] = s.groups_live;
  d["offloaded_bytes"] = s.offloaded_bytes;
  d["prefetched_bytes"] = s.prefetched_bytes;
  d["skipped_bytes"] = s.skipped_bytes;
  return d;
}

// [(level, code, rank, message)] of every queued log record, oldest first.
py::list TakeLogRecords() {
  std::vector<memoffload::client::LogRecord> records = memoffload::client::TakeLogRecords();
  py::list out;
  for (const auto& r : records) {
    out.append(py::make_tuple(static_cast<int>(r.level), StatusCodeOf(r.code), r.rank, r.message));
  }
  return out;
}

py::dict DaemonStatus(const std::string& runtime_dir, int timeout_ms) {
  const memoffload::client::DaemonStatus r = Take(
      WithoutGil([&] { return memoffload::client::QueryDaemonStatus(runtime_dir, timeout_ms); }));
  py::dict d;
  d["version"] = r.version;
  d["runtime_dir"] = r.runtime_dir;
  d["capacity_bytes"] = r.capacity_bytes;
  d["used_bytes"] = r.used_bytes;
  d["free_bytes"] = r.free_bytes;
  d["reserved_bytes"] = r.reserved_bytes;
  d["committed_bytes"] = r.committed_bytes;
  d["read_bytes"] = r.read_bytes;
  d["largest_free_extent_bytes"] = r.largest_free_extent_bytes;
  d["chunks"] = r.chunks;
  d["chunk_size_bytes"] = r.chunk_size_bytes;
  d["sessions"] = r.sessions;
  d["groups"] = r.groups;
  d["draining"] = r.draining;
  d["state_blocks"] = r.state_blocks;
  d["state_bytes"] = r.state_bytes;
  d["hugetlb_bytes"] = r.hugetlb_bytes;
  d["thp_bytes"] = r.thp_bytes;
  d["pages"] = r.pages;
  return d;
}

py::dict NodeRegions(const std::string& runtime_dir, const std::string& prefix, int timeout_ms) {
  const memoffload::client::NodeRegions r = Take(WithoutGil(
      [&] { return memoffload::client::QueryNodeRegions(runtime_dir, prefix, timeout_ms); }));
  py::list regions;
  for (const memoffload::client::NodeRegion& region : r.regions) {
    py::dict d;
    d["name"] = region.name;
    d["uid"] = region.uid;
    d["job_id"] = region.job_id;
    d["committed"] = region.committed;
    d["committed_unix"] = region.committed_unix;
    regions.append(std::move(d));
  }
  py::dict d;
  d["regions"] = regions;
  d["omitted"] = r.omitted;
  return d;
}

// GroupOffloader(...) from Python: created without the GIL, and destroyed
// without it too.
std::shared_ptr<GroupOffloader> CreateOffloader(const std::string& runtime_dir,
                                                const std::string& job_id, int rank, int local_rank,
                                                int rpc_timeout_ms, int reconnect_interval_ms,
                                                bool use_cuda) {
  OffloaderOptions o;
  o.runtime_dir = runtime_dir;
  o.job_id = job_id;
  o.rank = rank;
  o.local_rank = local_rank;
  o.rpc_timeout_ms = rpc_timeout_ms;
  o.reconnect_interval_ms = reconnect_interval_ms;
  o.use_cuda = use_cuda;
  std::shared_ptr<GroupOffloader> created;
  {
    py::gil_scoped_release release;
    created = GroupOffloader::Create(o);
  }
  // The destructor waits for the worker, whose last tasks may
  // drop storages that need the GIL (torch decrefs their Python
  // objects): never wait for it while holding the GIL.
  GroupOffloader* raw = created.get();
  return std::shared_ptr<GroupOffloader>(raw, [created](GroupOffloader*) mutable {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release release;
      created.reset();
    } else {
      created.reset();
    }
  });
}

// memoffload._C.GroupOffloader.
void BindGroupOffloader(py::module_& m) {
  py::class_<GroupOffloader, std::shared_ptr<GroupOffloader>>(m, "GroupOffloader")
      .def(py::init(&CreateOffloader), py::arg("runtime_dir") = "", py::arg("job_id") = "torch",
           py::arg("rank") = -1, py::arg("local_rank") = -1, py::arg("rpc_timeout_ms") = 10000,
           py::arg("reconnect_interval_ms") = 1000, py::arg("use_cuda") = true)
      .def(
          "begin_group",
          [](GroupOffloader& o, uint64_t key, int64_t slot) { Check(o.BeginGroup(key, slot)); },
          py::arg("key"), py::arg("slot") = -1)
      .def(
          "add",
          // Returns the entry index, or -1 for a tensor that is not strided
          // (the caller keeps it as it is). A tensor no engine can move (a
          // CUDA tensor without the CUDA engine, a failed event) gets an entry
          // that keeps it in memory and counts it in skipped_bytes: never an
          // exception in the middle of a forward.
          [](GroupOffloader& o, uint64_t key, const at::Tensor& t, uintptr_t stream) -> int64_t {
            Result<int64_t> r = o.Add(key, t, stream);
            if (!r.ok() && r.status().code() == StatusCode::kInvalidArgument) return -1;
            return Take(std::move(r));
          },
          py::arg("key"), py::arg("tensor"), py::arg("stream") = 0)
      .def(
          "close_group", [](GroupOffloader& o, uint64_t key) { Check(o.CloseGroup(key)); },
          py::arg("key"))
      .def(
          "prefetch_group", [](GroupOffloader& o, uint64_t key) { o.PrefetchGroup(key); },
          py::arg("key"))
      .def(
          "get",
          [](GroupOffloader& o, uint64_t key, int64_t entry, uintptr_t stream) {
            return Take(WithoutGil([&] { return o.Get(key, entry, stream); }));
          },
          py::arg("key"), py::arg("entry"), py::arg("stream") = 0)
      .def(
          "drop_entry",
          [](GroupOffloader& o, uint64_t key, int64_t entry) { Check(o.DropEntry(key, entry)); },
          py::arg("key"), py::arg("entry"))
      .def(
          "release_group", [](GroupOffloader& o, uint64_t key) { o.ReleaseGroup(key); },
          py::arg("key"))
      .def(
          "offload_group",
          [](GroupOffloader& o, uint64_t key, const std::vector<at::Tensor>& tensors,
             uintptr_t stream, int64_t slot) { Check(o.OffloadGroup(key, tensors, stream, slot)); },
          py::arg("key"), py::arg("tensors"), py::arg("stream") = 0, py::arg("slot") = -1)
      .def(
          "get_group",
          [](GroupOffloader& o, uint64_t key, uintptr_t stream) {
            return Take(WithoutGil([&] { return o.GetGroup(key, stream); }));
          },
          py::arg("key"), py::arg("stream") = 0)
      .def("flush", &GroupOffloader::Flush, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const GroupOffloader& o) { return StatsDict(o.stats()); })
      .def(
          "slot_stats",
          [](const GroupOffloader& o, int64_t first_slot, int64_t end_slot) {
            return SlotStatsDict(o.slot_stats(first_slot, end_slot));
          },
          py::arg("first_slot"), py::arg("end_slot"))
      .def("take_arena_held_peak", &GroupOffloader::TakeArenaHeldPeak,
           "The most arena bytes held at once since the previous call (one reader: the "
           "framework callbacks).");
}

// Taking the log queue, and the admin queries of the daemon.
void BindLogAndQueries(py::module_& m) {
  // The client's log sink, installed at import: every line of the client
  // and of the torch layer is queued, whatever thread logs it, and goes to
  // Python's "memoffload" logger when Python takes the queue (memoffload.logs,
  // on Python threads only: no thread of ours takes the GIL), never to stderr.
  memoffload::client::EnableLogQueue(kLogQueueRecords);
  m.def("take_log_records", &TakeLogRecords,
        "Queued messages of the native part as [(logging level, StatusCode, rank or -1, "
        "message)].");
  m.def("dropped_log_records", &memoffload::client::DroppedLogRecords,
        "Messages dropped because nobody took the queue in time.");
  m.def("daemon_status", &DaemonStatus, py::arg("runtime_dir") = "", py::arg("timeout_ms") = 5000,
        "GetStatus of the daemon at runtime_dir as a dict (memoffload.Unavailable when "
        "unreachable).");
  m.def("node_regions", &NodeRegions, py::arg("runtime_dir") = "", py::arg("prefix") = "",
        py::arg("timeout_ms") = 5000,
        "Every region of the node (any uid, any job) whose name starts with prefix: "
        "{'regions': [{name, uid, job_id, committed, committed_unix}], 'omitted': n}.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "memoffload native part: group offloader over the memoffloadd arena";
  // The torch this extension was compiled against (memoffload.torch checks
  // it against the torch it runs with).
  m.attr("built_torch_version") = MEMOFFLOAD_BUILT_TORCH_VERSION;

  BindGroupOffloader(m);
  memoffload::torch::python::BindSavedTensorHooks(m);
  memoffload::torch::python::BindRegions(m);
  memoffload::torch::python::BindLink(m);
  memoffload::torch::python::BindHostState(m);
  BindLogAndQueries(m);
}
