// memoffload._C.LinkListener and link_exchange: the bindings of
// memoffload::client's link between nodes (link.h), for
// memoffload.torch.checkpoint.nodes. Python hands plain values (ranks,
// addresses, region names and sizes, bytes) and tensors to receive into;
// the exchange runs without the GIL.
#include "python_link.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "memoffload/client/link.h"
#include "memoffload/client/region_io.h"
#include "python_errors.h"

namespace memoffload::torch::python {
namespace {

using client::LinkExchange;
using client::LinkKey;
using client::LinkListener;
using client::LinkOptions;
using client::LinkReceive;
using client::LinkRegion;
using client::LinkResult;
using client::LinkSend;
using client::LinkSink;
using client::RegionStore;

struct DeleteListenerWithoutGil {
  void operator()(LinkListener* p) const {
    py::gil_scoped_release release;
    delete p;
  }
};
using HeldListener = std::unique_ptr<LinkListener, DeleteListenerWithoutGil>;

HeldListener Listen(const std::string& address, int32_t rank, uint64_t call, const py::list& keys,
                    int handshake_timeout_ms, size_t max_pending_handshakes, int io_timeout_ms,
                    uint64_t piece_bytes, uint32_t test_corrupt_every) {
  LinkOptions options;
  options.rank = rank;
  options.call = call;
  for (const py::handle& k : keys) {
    auto pair = py::reinterpret_borrow<py::sequence>(k);
    options.keys.push_back({pair[0].cast<std::string>(), pair[1].cast<std::string>()});
  }
  options.handshake_timeout_ms = handshake_timeout_ms;
  options.max_pending_handshakes = max_pending_handshakes;
  options.io_timeout_ms = io_timeout_ms;
  options.piece_bytes = piece_bytes;
  options.test_corrupt_every = test_corrupt_every;
  return HeldListener(
      Take(WithoutGil([&] { return LinkListener::Listen(address, options); })).release());
}

client::LinkPeer Peer(const py::dict& d) {
  client::LinkPeer p;
  p.rank = d["rank"].cast<int32_t>();
  p.host = d["host"].cast<std::string>();
  p.port = d.contains("port") ? d["port"].cast<uint16_t>() : 0;
  return p;
}

std::vector<LinkRegion> Regions(const py::dict& d) {
  std::vector<LinkRegion> out;
  if (!d.contains("regions")) return out;
  for (const py::handle& r : d["regions"]) {
    auto pair = py::reinterpret_borrow<py::sequence>(r);
    out.push_back({pair[0].cast<std::string>(), pair[1].cast<uint64_t>()});
  }
  return out;
}

// sends: [{"rank", "host", "port", "regions": [(name, size)], "blobs": [bytes]}]
// receives: [{"rank", "host", "regions": [(name, size)], "blobs": [max_bytes]}]
// into: {region name: a contiguous uint8 CPU tensor of its size} to receive
// regions into memory; else they go into `store` (ttl_seconds), committed
// once whole and intact.
py::dict Exchange(LinkListener& listener, uint32_t seq, RegionStore* source, const py::list& sends,
                  const py::list& receives, RegionStore* store, double ttl_seconds,
                  const py::object& into) {
  std::vector<LinkSend> out;
  for (const py::handle& h : sends) {
    const py::dict d = h.cast<py::dict>();
    LinkSend s;
    s.peer = Peer(d);
    s.regions = Regions(d);
    if (d.contains("blobs")) {
      for (const py::handle& b : d["blobs"]) s.blobs.push_back(b.cast<std::string>());
    }
    out.push_back(std::move(s));
  }
  std::vector<LinkReceive> in;
  for (const py::handle& h : receives) {
    const py::dict d = h.cast<py::dict>();
    LinkReceive r;
    r.peer = Peer(d);
    r.regions = Regions(d);
    if (d.contains("blobs")) {
      for (const py::handle& b : d["blobs"]) r.blob_max_bytes.push_back(b.cast<uint64_t>());
    }
    in.push_back(std::move(r));
  }
  LinkSink sink;
  sink.store = store;
  sink.ttl_seconds = ttl_seconds;
  std::map<std::string, std::pair<uint8_t*, uint64_t>> memory;
  std::vector<at::Tensor> keep;
  if (!into.is_none()) {
    for (const auto& [name, value] : into.cast<py::dict>()) {
      if (!THPVariable_Check(value.ptr())) Raise(InvalidArgument("into: values must be tensors"));
      at::Tensor t = THPVariable_Unpack(value.ptr());
      if (!t.device().is_cpu() || !t.is_contiguous() || t.scalar_type() != at::kByte) {
        Raise(InvalidArgument("into: each tensor must be a contiguous uint8 CPU tensor"));
      }
      memory[name.cast<std::string>()] = {static_cast<uint8_t*>(t.data_ptr()),
                                          static_cast<uint64_t>(t.numel())};
      keep.push_back(t);
    }
    for (const LinkReceive& r : in) {
      for (const LinkRegion& region : r.regions) {
        auto it = memory.find(region.name);
        if (it == memory.end() || it->second.second < region.size_bytes) {
          Raise(InvalidArgument("into: no tensor of " + std::to_string(region.size_bytes) +
                                " bytes for " + region.name));
        }
      }
    }
    sink.memory = [&memory](const std::string& name) -> uint8_t* {
      auto it = memory.find(name);
      return it == memory.end() ? nullptr : it->second.first;
    };
  }
  LinkResult result =
      Take(WithoutGil([&] { return LinkExchange(&listener, seq, source, out, in, sink); }));
  py::dict d;
  py::dict send_failures, receive_failures, regions, blobs;
  for (const auto& [rank, why] : result.send_failures) send_failures[py::int_(rank)] = why;
  for (const auto& [rank, why] : result.receive_failures) receive_failures[py::int_(rank)] = why;
  for (const auto& [name, why] : result.regions) regions[py::str(name)] = why;
  for (const auto& [rank, list] : result.blobs) {
    py::list l;
    for (const std::string& b : list) l.append(py::bytes(b));
    blobs[py::int_(rank)] = l;
  }
  py::list committed;
  for (const std::string& name : result.regions_committed) committed.append(name);
  d["send_failures"] = send_failures;
  d["receive_failures"] = receive_failures;
  d["regions"] = regions;
  d["blobs"] = blobs;
  d["committed"] = committed;
  d["bytes_sent"] = result.bytes_sent;
  d["bytes_received"] = result.bytes_received;
  return d;
}

}  // namespace

void BindLink(py::module_& m) {
  py::class_<LinkListener, HeldListener>(m, "LinkListener")
      .def(py::init(&Listen), py::arg("address"), py::arg("rank"), py::arg("call"), py::arg("keys"),
           py::arg("handshake_timeout_ms") = 2000, py::arg("max_pending_handshakes") = 8,
           py::arg("io_timeout_ms") = 600000, py::arg("piece_bytes") = 32ull << 20,
           py::arg("test_corrupt_every") = 0,
           "Listens for one collective job's link on address (port 0); keys: [(id, 32 bytes)], "
           "the first to connect with.")
      .def_property_readonly("port", &LinkListener::port)
      .def_property_readonly("address", &LinkListener::address)
      .def("dropped", [](const LinkListener& l) {
        const client::LinkDropped d = l.dropped();
        py::dict out;
        out["not_a_peer"] = d.not_a_peer;
        out["busy"] = d.busy;
        out["handshake"] = d.handshake;
        out["bad_hello"] = d.bad_hello;
        out["fd_shortage"] = d.fd_shortage;
        return out;
      });
  m.def("link_exchange", &Exchange, py::arg("listener"), py::arg("seq"), py::arg("source"),
        py::arg("sends"), py::arg("receives"), py::arg("store") = nullptr,
        py::arg("ttl_seconds") = 0.0, py::arg("into") = py::none(),
        "One exchange of a link's job: streams regions and blobs to and from peers (link.h).");
}

}  // namespace memoffload::torch::python
