// memoffload._C.RegionStore: a session of memoffloadd for checkpoint regions
// (client.h). A RegionWriter appends tensors and buffers to a new region,
// computing each extent's CRC32C as it copies (on the bytes just written,
// while they are in cache), and commits it; a RegionReader copies bytes out
// of a committed region, checking its checksums at open or as it reads.
// A tensor on a device (CUDA) is copied straight from the device into the
// region's mapping, extent by extent, with no host copy in between.
// Copies and RPCs release the GIL.
#include "python_regions.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "memoffload/client/client.h"
#include "memoffload/client/log.h"
#include "memoffload/client/verified_read.h"
#include "memoffload/common/crc32c.h"
#include "python_errors.h"

namespace memoffload::torch::python {
namespace {

using client::Client;

// Checksummed copies go in pieces of this size: each is checksummed right
// after it is written, while it is still in the cache.
constexpr uint64_t kCopyPiece = 256 << 10;

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

class RegionWriter {
 public:
  RegionWriter(std::shared_ptr<Client> client, std::string name, client::Reservation reservation,
               bool checksums)
      : client_(std::move(client)),
        name_(std::move(name)),
        reservation_(std::move(reservation)),
        checksums_(checksums) {}
  ~RegionWriter() {
    if (state_ != State::kOpen) return;
    // Dropped uncommitted: abort, so the space comes back now rather than
    // when the session ends. Never raises from a destructor: logged.
    py::gil_scoped_release release;
    if (Result<uint64_t> r = client_->DeleteRegion(name_); !r.ok()) {
      client::Log(client::LogLevel::kWarning, r.status().code(),
                  "aborting uncommitted region " + name_ + " failed: " + r.status().ToString());
    }
  }

  uint64_t Append(const py::handle& obj) {
    if (state_ != State::kOpen) Raise(FailedPrecondition("region " + name_ + " is " + StateName()));
    Bytes bytes(obj, /*device_ok=*/true);
    if (bytes.size() > reservation_.reserved_bytes - written_) {
      Raise(Status(StatusCode::kOutOfRange,
                   "appending " + std::to_string(bytes.size()) + " bytes to region " + name_ +
                       " passes its size: " + std::to_string(written_) + " of " +
                       std::to_string(reservation_.reserved_bytes) + " bytes written"));
    }
    const uint64_t at = written_;
    Status st;
    {
      py::gil_scoped_release release;
      st = Copy(bytes, bytes.size());
    }
    Check(st);
    return at;
  }

  uint64_t Commit() {
    if (state_ != State::kOpen) Raise(FailedPrecondition("region " + name_ + " is " + StateName()));
    std::vector<uint32_t> crcs;
    if (checksums_) {
      size_t touched = 0;
      for (uint64_t pos = 0; touched < reservation_.extents.size() && pos < written_; ++touched) {
        pos += reservation_.extents[touched].length;
      }
      crcs.assign(crc_.begin(), crc_.begin() + static_cast<ptrdiff_t>(touched));
    }
    Result<client::CommitInfo> r = InvalidArgument("not committed");
    {
      py::gil_scoped_release release;
      r = client_->CommitRegion(name_, written_, crcs);
    }
    Take(std::move(r));
    state_ = State::kCommitted;
    return written_;
  }

  void Abort() {
    if (state_ != State::kOpen) return;
    state_ = State::kAborted;
    Result<uint64_t> r = InvalidArgument("not deleted");
    {
      py::gil_scoped_release release;
      r = client_->DeleteRegion(name_);
    }
    Take(std::move(r));
  }

  const std::string& name() const { return name_; }
  uint64_t size_bytes() const { return reservation_.reserved_bytes; }
  uint64_t written() const { return written_; }

 private:
  enum class State { kOpen, kCommitted, kAborted };
  const char* StateName() const {
    return state_ == State::kCommitted ? "committed already" : "aborted";
  }

  // Appends at written_, extent by extent, checksumming each piece just
  // written into its extent's running CRC. A device tensor's bytes are copied
  // once per extent straight into the mapping (a synchronous device-to-host
  // copy), then checksummed piece by piece.
  Status Copy(const Bytes& bytes, uint64_t length) {
    const uint8_t* src = bytes.data();
    uint64_t from = 0;  // into a device tensor's bytes
    const std::vector<Extent>& extents = reservation_.extents;
    if (crc_.size() != extents.size()) crc_.assign(extents.size(), 0);
    uint64_t start = 0;  // of extent i in the region's byte stream
    for (size_t i = 0; i < extents.size() && length != 0; start += extents[i].length, ++i) {
      const uint64_t end = start + extents[i].length;
      if (written_ >= end) continue;
      const uint64_t in_extent = written_ - start;
      const uint64_t n = std::min(length, extents[i].length - in_extent);
      if (src == nullptr) {
        const Extent whole{extents[i].chunk, extents[i].offset + in_extent, n};
        uint8_t* dst = client_->Address(whole);
        if (dst == nullptr) return NotMapped(whole.chunk);
        try {
          at::from_blob(dst, {static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte))
              .copy_(bytes.device_bytes().narrow(0, static_cast<int64_t>(from),
                                                 static_cast<int64_t>(n)));
        } catch (const std::exception& e) {
          return Internal("region " + name_ + ": copying from the device failed: " + e.what());
        }
        from += n;
      }
      for (uint64_t done = 0; done < n;) {
        const uint64_t k = std::min(kCopyPiece, n - done);
        const Extent piece{extents[i].chunk, extents[i].offset + in_extent + done, k};
        uint8_t* dst = client_->Address(piece);
        if (dst == nullptr) return NotMapped(piece.chunk);
        if (src != nullptr) {
          std::memcpy(dst, src, k);
          src += k;
        }
        if (checksums_) crc_[i] = Crc32c(dst, k, crc_[i]);
        done += k;
      }
      written_ += n;
      length -= n;
    }
    return Status::Ok();
  }

  Status NotMapped(uint32_t chunk) const {
    return Internal("region " + name_ + ": chunk " + std::to_string(chunk) +
                    " is not mapped in this process");
  }

  std::shared_ptr<Client> client_;
  const std::string name_;
  const client::Reservation reservation_;
  const bool checksums_;
  uint64_t written_ = 0;
  std::vector<uint32_t> crc_;  // running CRC32C per extent
  State state_ = State::kOpen;
};

class RegionReader {
 public:
  // verify_as_read: the region's checksums (if any) were not checked at
  // open; reads check them as they copy (client::VerifiedRead), and
  // VerifyRest checks what no in-order read covered.
  RegionReader(std::shared_ptr<Client> client, std::string name, client::Placement placement,
               bool verify_as_read)
      : client_(std::move(client)), name_(std::move(name)) {
    if (!verify_as_read) placement.extent_crc32c.clear();  // checked at open, or never
    read_ = std::make_unique<client::VerifiedRead>(client_.get(), name_, std::move(placement));
  }
  ~RegionReader() {
    if (closed_) return;
    py::gil_scoped_release release;
    if (Status st = client_->CloseRegion(name_); !st.ok()) {
      client::Log(client::LogLevel::kWarning, st.code(),
                  "closing region " + name_ + " failed: " + st.ToString());
    }
  }

  void ReadInto(uint64_t offset, const py::handle& obj) {
    Bytes bytes(obj);
    CheckRange(offset, bytes.size());
    Status st;
    {
      py::gil_scoped_release release;
      st = read_->Read(offset, bytes.data(), bytes.size());
    }
    Check(st);
  }

  py::bytes ReadBytes(uint64_t offset, uint64_t length) {
    CheckRange(offset, length);
    std::string out(length, '\0');
    Status st;
    {
      py::gil_scoped_release release;
      st = read_->Read(offset, out.data(), length);
    }
    Check(st);
    return py::bytes(out);
  }

  void VerifyRest() {
    if (closed_) Raise(FailedPrecondition("region " + name_ + " is closed"));
    Status st;
    {
      py::gil_scoped_release release;
      st = read_->VerifyRest();
    }
    Check(st);
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    Status st;
    {
      py::gil_scoped_release release;
      st = client_->CloseRegion(name_);
    }
    Check(st);
  }

  const std::string& name() const { return name_; }
  uint64_t size_bytes() const { return read_->placement().used_bytes; }

 private:
  void CheckRange(uint64_t offset, uint64_t length) const {
    if (closed_) Raise(FailedPrecondition("region " + name_ + " is closed"));
    const uint64_t used = read_->placement().used_bytes;
    if (offset > used || length > used - offset) {
      Raise(Status(StatusCode::kOutOfRange, "reading " + std::to_string(length) +
                                                " bytes at offset " + std::to_string(offset) +
                                                " of region " + name_ + ", which holds " +
                                                std::to_string(used) + " bytes"));
    }
  }

  std::shared_ptr<Client> client_;
  const std::string name_;
  std::unique_ptr<client::VerifiedRead> read_;
  bool closed_ = false;
};

class RegionStore {
 public:
  RegionStore(const std::string& runtime_dir, const std::string& job_id, int rank, bool checksums,
              int rpc_timeout_ms)
      : checksums_(checksums) {
    if (job_id.empty()) {
      Raise(
          InvalidArgument("checkpoint regions need an explicit job id (the same for every rank "
                          "and for the job that restarts from the checkpoint)"));
    }
    client::AttachOptions options;
    options.runtime_dir = runtime_dir;
    options.job_id = job_id;
    options.rank = rank;
    options.rpc_timeout_ms = rpc_timeout_ms;
    Result<std::unique_ptr<Client>> attached = InvalidArgument("not attached");
    {
      py::gil_scoped_release release;
      attached = Client::Attach(options);
    }
    client_ = Take(std::move(attached));
  }

  std::unique_ptr<RegionWriter> Create(const std::string& name, uint64_t size_bytes,
                                       double ttl_seconds) {
    Result<client::Reservation> r = InvalidArgument("not created");
    {
      py::gil_scoped_release release;
      r = Live()->CreateRegion(name, size_bytes, ttl_seconds);
    }
    return std::make_unique<RegionWriter>(client_, name, Take(std::move(r)), checksums_);
  }

  // verify: check the checksums before returning (one pass over the
  // region); verify_as_read: check them as reads copy the bytes out in order
  // instead, and in RegionReader.verify_rest for the rest.
  std::unique_ptr<RegionReader> Open(const std::string& name, bool verify, bool verify_as_read) {
    Result<client::Placement> r = InvalidArgument("not opened");
    {
      py::gil_scoped_release release;
      r = Live()->OpenRegion(name, verify && !verify_as_read);
    }
    return std::make_unique<RegionReader>(client_, name, Take(std::move(r)),
                                          verify && verify_as_read);
  }

  uint64_t Delete(const std::string& name) {
    Result<uint64_t> r = InvalidArgument("not deleted");
    {
      py::gil_scoped_release release;
      r = Live()->DeleteRegion(name);
    }
    return Take(std::move(r));
  }

  py::list List(const std::string& prefix) {
    Result<std::vector<client::RegionInfo>> r = InvalidArgument("not listed");
    {
      py::gil_scoped_release release;
      r = Live()->ListRegions(prefix);
    }
    py::list out;
    for (const client::RegionInfo& info : Take(std::move(r))) {
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

  // Lets go of the session: it ends (regions being written by it vanish,
  // open ones close) once no RegionWriter or RegionReader of it is alive
  // either; each keeps the session it was made in.
  void Close() { client_.reset(); }
  bool closed() const { return client_ == nullptr; }
  uint64_t session_id() { return Live()->session_id(); }

 private:
  const std::shared_ptr<Client>& Live() {
    if (client_ == nullptr) Raise(FailedPrecondition("this RegionStore is closed"));
    return client_;
  }

  const bool checksums_;
  std::shared_ptr<Client> client_;
};

}  // namespace

void BindRegions(py::module_& m) {
  py::class_<RegionWriter>(m, "RegionWriter")
      .def("append", &RegionWriter::Append, py::arg("data"),
           "Copies a contiguous CPU tensor's bytes (or a buffer's) to the end; returns the "
           "offset they start at.")
      .def("commit", &RegionWriter::Commit, "Makes the region visible; returns the bytes used.")
      .def("abort", &RegionWriter::Abort)
      .def_property_readonly("name", &RegionWriter::name)
      .def_property_readonly("size_bytes", &RegionWriter::size_bytes)
      .def_property_readonly("written", &RegionWriter::written);
  py::class_<RegionReader>(m, "RegionReader")
      .def("read_into", &RegionReader::ReadInto, py::arg("offset"), py::arg("out"),
           "Fills a contiguous CPU tensor (or writable buffer) from offset.")
      .def("read_bytes", &RegionReader::ReadBytes, py::arg("offset"), py::arg("length"))
      .def("verify_rest", &RegionReader::VerifyRest,
           "With verify_as_read: checks what no in-order read checksummed (DataLoss).")
      .def("close", &RegionReader::Close)
      .def_property_readonly("name", &RegionReader::name)
      .def_property_readonly("size_bytes", &RegionReader::size_bytes);
  py::class_<RegionStore>(m, "RegionStore")
      .def(py::init<const std::string&, const std::string&, int, bool, int>(),
           py::arg("runtime_dir") = "", py::arg("job_id"), py::arg("rank") = -1,
           py::arg("checksums") = true, py::arg("rpc_timeout_ms") = 30000)
      .def("create", &RegionStore::Create, py::arg("name"), py::arg("size_bytes"),
           py::arg("ttl_seconds") = 0.0)
      .def("open", &RegionStore::Open, py::arg("name"), py::arg("verify") = true,
           py::arg("verify_as_read") = false)
      .def("delete", &RegionStore::Delete, py::arg("name"))
      .def("list", &RegionStore::List, py::arg("prefix") = "")
      .def("close", &RegionStore::Close,
           "Lets go of the session; it ends once no writer or reader made by it is alive.")
      .def_property_readonly("closed", &RegionStore::closed)
      .def_property_readonly("session_id", &RegionStore::session_id);
}

}  // namespace memoffload::torch::python
