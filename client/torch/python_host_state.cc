// memoffload._C.HostStateStore: the binding of HostStateStore
// (src/host_state.h), which holds the logic. Statuses become
// memoffload.errors exceptions; calls that make an RPC run without the GIL.
#include "python_host_state.h"

#include <memory>
#include <string>

#include "python_errors.h"
#include "src/host_state.h"

namespace memoffload::torch::python {
namespace {

std::shared_ptr<HostStateStore> Attach(const std::string& runtime_dir, const std::string& job_id,
                                       int rank, int local_rank, int rpc_timeout_ms, bool use_cuda,
                                       uint64_t max_bytes) {
  client::AttachOptions options;
  options.runtime_dir = runtime_dir;
  options.job_id = job_id;
  options.rank = rank;
  options.local_rank = local_rank;
  options.rpc_timeout_ms = rpc_timeout_ms;
  options.kind = SessionKind::kState;
  options.max_bytes = max_bytes;
  return Take(WithoutGil([&] { return HostStateStore::Attach(options, use_cuda); }));
}

py::dict Stats(const HostStateStore& store) {
  const client::HostBlockStats s = store.stats();
  py::dict d;
  d["tensors"] = s.blocks;
  d["bytes"] = s.size_bytes;
  d["held_bytes"] = s.held_bytes;
  d["refused"] = s.refused;
  d["unpinned_bytes"] = store.unpinned_bytes();
  d["cuda"] = store.cuda();
  d["session_id"] = store.session_id();
  return d;
}

}  // namespace

void BindHostState(py::module_& m) {
  py::class_<HostStateStore, std::shared_ptr<HostStateStore>>(m, "HostStateStore")
      .def(py::init(&Attach), py::arg("runtime_dir") = "", py::arg("job_id") = "",
           py::arg("rank") = -1, py::arg("local_rank") = -1, py::arg("rpc_timeout_ms") = 30000,
           py::arg("use_cuda") = true, py::arg("max_bytes") = 0)
      .def(
          "empty",
          [](HostStateStore& s, uint64_t nbytes) {
            return Take(WithoutGil([&] { return s.Empty(nbytes); }));
          },
          py::arg("nbytes"),
          "A 1-D uint8 CPU tensor of nbytes in the arena (its block goes back when it dies).")
      .def(
          "holds",
          [](const HostStateStore& s, uintptr_t address) {
            return s.Holds(reinterpret_cast<const void*>(address));
          },
          py::arg("address"), "Whether the address is in one of this store's live blocks.")
      .def(
          "move_reason",
          [](const HostStateStore& s) { return WithoutGil([&] { return s.MoveReason(); }); },
          "Why the tensors must move out of this store's arena now (the daemon asked its "
          "session to leave, or ended it), or '' while they may stay.")
      .def(
          "session_lost",
          [](const HostStateStore& s) { return WithoutGil([&] { return s.SessionLost(); }); },
          "Whether the daemon ended this store's session (restart, crash, dropped connection).")
      .def("stats", &Stats);
}

}  // namespace memoffload::torch::python
