// memoffload._C.RegionStore, RegionWriter and RegionReader: the bindings of
// memoffload::client's classes of the same names (region_io.h), which hold
// the logic. Here: tensors and buffers become bytes (a CUDA tensor's through
// a DeviceCopy straight into the region's mapping, with no host copy in
// between), statuses become exceptions, and every call that may block (an
// RPC, a copy; the destructors of writers and readers) runs without the GIL.
#include "python_regions.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "memoffload/client/region_io.h"
#include "memoffload/client/region_persist.h"
#include "memoffload/common/crc32c.h"
#include "python_errors.h"

namespace memoffload::torch::python {
namespace {

using client::RegionReader;
using client::RegionStore;
using client::RegionWriter;

// The bytes of a contiguous tensor (CPU, or CUDA for writes) or of a
// C-contiguous buffer object; holds the buffer (or the tensor) while the copy
// runs. data() is null for a device tensor: its bytes are device_bytes().
class Bytes {
 public:
  explicit Bytes(const py::handle& obj, bool device_ok = false) {
    if (THPVariable_Check(obj.ptr())) {
      tensor_ = THPVariable_Unpack(obj.ptr());
      const bool on_cpu = tensor_.device().is_cpu();
      if (!on_cpu && !(device_ok && tensor_.device().is_cuda())) {
        Raise(InvalidArgument(std::string("only CPU ") + (device_ok ? "or CUDA " : "") +
                              "tensors can be copied " + (device_ok ? "into" : "out of") +
                              " a region; got one on " + tensor_.device().str() +
                              " (move it to the CPU first)"));
      }
      if (!tensor_.is_contiguous()) {
        Raise(
            InvalidArgument("only contiguous tensors can be copied into a region (call "
                            ".contiguous() first)"));
      }
      size_ = tensor_.nbytes();
      if (on_cpu) {
        data_ = static_cast<uint8_t*>(tensor_.data_ptr());
      } else if (size_ != 0) {
        device_bytes_ = tensor_.reshape({-1}).view(at::kByte);
      }
      return;
    }
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      throw py::error_already_set();
    }
    has_view_ = true;
    data_ = static_cast<uint8_t*>(view_.buf);
    size_ = static_cast<uint64_t>(view_.len);
  }
  ~Bytes() {
    if (has_view_) PyBuffer_Release(&view_);
  }
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // The device tensor's bytes as a flat uint8 tensor (undefined otherwise).
  const at::Tensor& device_bytes() const { return device_bytes_; }

 private:
  at::Tensor tensor_;
  at::Tensor device_bytes_;
  Py_buffer view_{};
  bool has_view_ = false;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// Deletes a writer, reader or store without the GIL: their destructors
// may make an RPC (abort an uncommitted region, close an open one).
struct DeleteWithoutGil {
  template <typename T>
  void operator()(T* p) const {
    py::gil_scoped_release release;
    delete p;
  }
};
template <typename T>
using Held = std::unique_ptr<T, DeleteWithoutGil>;

template <typename T>
Held<T> TakeHeld(Result<std::unique_ptr<T>> r) {
  return Held<T>(Take(std::move(r)).release());
}

Status CopyFromDevice(const std::string& region, const at::Tensor& device_bytes, uint64_t from,
                      uint8_t* dst, uint64_t n) {
  try {
    at::from_blob(dst, {static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte))
        .copy_(device_bytes.narrow(0, static_cast<int64_t>(from), static_cast<int64_t>(n)));
  } catch (const std::exception& e) {
    return Internal("region " + region + ": copying from the device failed: " + e.what());
  }
  return Status::Ok();
}

uint64_t Append(RegionWriter& writer, const py::handle& obj) {
  Bytes bytes(obj, /*device_ok=*/true);
  return Take(WithoutGil([&] {
    if (bytes.data() != nullptr || bytes.size() == 0) {
      return writer.Append(bytes.data(), bytes.size());
    }
    // One synchronous device-to-host copy per extent, into the mapping.
    return writer.Append(bytes.size(), [&](uint64_t from, uint8_t* dst, uint64_t n) {
      return CopyFromDevice(writer.name(), bytes.device_bytes(), from, dst, n);
    });
  }));
}

// Room for `nbytes` in the region, filled in place: (offset, a uint8 CPU
// tensor over those bytes of the mapping). The tensor keeps the session (and
// so the mapping) alive; writing it after the region is committed changes a
// committed checkpoint, so callers stop writing at commit.
py::tuple Place(RegionWriter& writer, uint64_t nbytes, uint64_t align) {
  uint8_t* address = nullptr;
  const uint64_t offset = Take(writer.Place(nbytes, align, &address));
  std::shared_ptr<client::Client> keep = writer.client();
  at::Tensor view = at::from_blob(
      address, {static_cast<int64_t>(nbytes)}, [keep](void*) {},
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  return py::make_tuple(offset, view);
}

void ReadInto(RegionReader& reader, uint64_t offset, const py::handle& obj) {
  Bytes bytes(obj);
  Check(WithoutGil([&] { return reader.Read(offset, bytes.data(), bytes.size()); }));
}

py::bytes ReadBytes(RegionReader& reader, uint64_t offset, uint64_t length) {
  return py::bytes(Take(WithoutGil([&] { return reader.Read(offset, length); })));
}

py::list List(RegionStore& store, const std::string& prefix) {
  py::list out;
  for (const client::RegionInfo& info : Take(WithoutGil([&] { return store.List(prefix); }))) {
    py::dict d;
    d["name"] = info.name;
    d["size_bytes"] = info.used_bytes;
    d["held_bytes"] = info.held_bytes;
    d["committed_unix"] = info.committed_unix;
    d["expires_in_seconds"] = info.expires_in_seconds;
    d["ttl_seconds"] = info.ttl_seconds;
    d["checksummed"] = info.checksummed;
    d["readers"] = info.readers;
    out.append(std::move(d));
  }
  return out;
}

Held<RegionStore> Attach(const std::string& runtime_dir, const std::string& job_id, int rank,
                         bool checksums, int rpc_timeout_ms) {
  client::RegionStoreOptions options;
  options.runtime_dir = runtime_dir;
  options.job_id = job_id;
  options.rank = rank;
  options.checksums = checksums;
  options.rpc_timeout_ms = rpc_timeout_ms;
  return TakeHeld(WithoutGil([&] { return RegionStore::Attach(options); }));
}

py::dict PersistFigures(const client::PersistStats& stats) {
  py::dict out;
  out["bytes"] = stats.bytes;
  out["crc32c"] = stats.crc32c;
  out["direct"] = stats.direct;
  out["busy_seconds"] = stats.busy_seconds;
  out["seconds"] = stats.seconds;
  return out;
}

}  // namespace

void BindRegions(py::module_& m) {
  m.def(
      "crc32c",
      [](const py::handle& obj, uint32_t crc) {
        Bytes bytes(obj);
        return WithoutGil([&] { return Crc32c(bytes.data(), bytes.size(), crc); });
      },
      py::arg("data"), py::arg("crc") = 0,
      "The CRC32C of a buffer or CPU tensor's bytes, extending `crc` (the regions' checksum).");
  py::class_<RegionWriter, Held<RegionWriter>>(m, "RegionWriter")
      .def("append", &Append, py::arg("data"),
           "Copies a contiguous CPU tensor's bytes (or a buffer's) to the end; returns the "
           "offset they start at.")
      .def("place", &Place, py::arg("nbytes"), py::arg("align") = 64,
           "Room for nbytes in one extent, filled in place: (offset, uint8 tensor over it).")
      .def(
          "commit",
          [](RegionWriter& w, const std::string& rename_to) {
            return Take(WithoutGil([&] { return w.Commit(rename_to); }));
          },
          py::arg("rename_to") = "",
          "Makes the region visible (under rename_to when given); returns the bytes used.")
      .def("abort", [](RegionWriter& w) { Check(WithoutGil([&] { return w.Abort(); })); })
      .def_property_readonly("name", &RegionWriter::name)
      .def_property_readonly("size_bytes", &RegionWriter::size_bytes)
      .def_property_readonly("written", &RegionWriter::written);
  py::class_<RegionReader, Held<RegionReader>>(m, "RegionReader")
      .def("read_into", &ReadInto, py::arg("offset"), py::arg("out"),
           "Fills a contiguous CPU tensor (or writable buffer) from offset.")
      .def("read_bytes", &ReadBytes, py::arg("offset"), py::arg("length"))
      .def(
          "verify_rest", [](RegionReader& r) { Check(WithoutGil([&] { return r.VerifyRest(); })); },
          "With verify_as_read: checks what no in-order read checksummed (DataLoss).")
      .def(
          "persist",
          [](RegionReader& r, int dir_fd, const std::string& file_name, double share, bool direct,
             uint64_t piece_bytes) {
            client::PersistOptions options;
            options.share = share;
            options.direct = direct;
            options.piece_bytes = piece_bytes;
            return PersistFigures(Take(
                WithoutGil([&] { return client::PersistRegion(r, dir_fd, file_name, options); })));
          },
          py::arg("dir_fd"), py::arg("file_name"), py::arg("share") = 1.0, py::arg("direct") = true,
          py::arg("piece_bytes") = 64ull << 20,
          "Writes the whole region to new file `file_name` in directory `dir_fd`, verified "
          "(open it with verify_as_read) and fsynced, without the GIL (region_persist.h).")
      .def("close", [](RegionReader& r) { Check(WithoutGil([&] { return r.Close(); })); })
      .def_property_readonly("name", &RegionReader::name)
      .def_property_readonly("size_bytes", &RegionReader::size_bytes);
  py::class_<RegionStore, Held<RegionStore>>(m, "RegionStore")
      .def(py::init(&Attach), py::arg("runtime_dir") = "", py::arg("job_id"), py::arg("rank") = -1,
           py::arg("checksums") = true, py::arg("rpc_timeout_ms") = 30000)
      .def(
          "create",
          [](RegionStore& s, const std::string& name, uint64_t size_bytes, double ttl_seconds) {
            return TakeHeld(WithoutGil([&] { return s.Create(name, size_bytes, ttl_seconds); }));
          },
          py::arg("name"), py::arg("size_bytes"), py::arg("ttl_seconds") = 0.0)
      .def(
          "open",
          [](RegionStore& s, const std::string& name, bool verify, bool verify_as_read) {
            return TakeHeld(WithoutGil([&] { return s.Open(name, verify, verify_as_read); }));
          },
          py::arg("name"), py::arg("verify") = true, py::arg("verify_as_read") = false)
      .def(
          "delete",
          [](RegionStore& s, const std::string& name) {
            return Take(WithoutGil([&] { return s.Delete(name); }));
          },
          py::arg("name"))
      .def(
          "persist",
          [](RegionStore& s, const std::string& name, int dir_fd, const std::string& file_name,
             double share, bool direct, uint64_t piece_bytes) {
            client::PersistOptions options;
            options.share = share;
            options.direct = direct;
            options.piece_bytes = piece_bytes;
            return PersistFigures(Take(WithoutGil(
                [&] { return client::PersistRegion(s, name, dir_fd, file_name, options); })));
          },
          py::arg("name"), py::arg("dir_fd"), py::arg("file_name"), py::arg("share") = 1.0,
          py::arg("direct") = true, py::arg("piece_bytes") = 64ull << 20,
          "Writes committed region `name` to new file `file_name` in directory `dir_fd`, "
          "verified and fsynced, without the GIL (region_persist.h); returns its figures.")
      .def("list", &List, py::arg("prefix") = "")
      .def("close", &RegionStore::Close,
           "Lets go of the session; it ends once no writer or reader made by it is alive.")
      .def_property_readonly("closed", &RegionStore::closed)
      .def_property_readonly("session_id",
                             [](const RegionStore& s) { return Take(s.session_id()); })
      .def_property_readonly("instance_id",
                             [](const RegionStore& s) { return Take(s.instance_id()); })
      .def(
          "replication_keys",
          [](RegionStore& s) {
            client::Client::LinkKeys keys = Take(WithoutGil([&] { return s.ReplicationKeys(); }));
            py::list out;
            for (size_t i = 0; i < keys.ids.size(); ++i) {
              out.append(py::make_tuple(keys.ids[i], py::bytes(keys.keys[i])));
            }
            return out;
          },
          "The job's replication keys from the daemon, [(id, 32 bytes)], the first to connect "
          "with (NotFound: the daemon has no key file; FailedPrecondition: it requires one).");
}

}  // namespace memoffload::torch::python
