#include "memoffload/torch/group_offloader.h"

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>

#include "memoffload/client/admin.h"
#include "memoffload/client/client.h"
#include "memoffload/torch/copy_engine.h"
#include "worker.h"

namespace memoffload::torch {
namespace {

using client::Client;
using Clock = std::chrono::steady_clock;

// Placement alignment of storages inside a group (covers every dtype and the
// CUDA copy engine's preferred alignment).
constexpr uint64_t kAlignBytes = 256;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Transport failures: the daemon is gone or not answering. Committed data is
// still in this process's mapping of the chunks and can be read back.
bool IsTransport(StatusCode code) {
  return code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded ||
         code == StatusCode::kCancelled;
}

// Runs fn(host_address, done, n) over the pieces of [offset, offset + length)
// of the byte stream formed by `extents`.
template <typename Fn>
Status ForEachPiece(const Client& c, const std::vector<Extent>& extents, uint64_t offset,
                    uint64_t length, Fn fn) {
  uint64_t pos = 0;
  uint64_t done = 0;
  for (const Extent& e : extents) {
    if (done == length) break;
    const uint64_t end = pos + e.length;
    const uint64_t want = offset + done;
    if (want < end) {
      uint8_t* base = c.Address(e);
      if (base == nullptr) return Internal("extent outside the mapped arena");
      const uint64_t in_extent = want - pos;
      const uint64_t n = std::min(e.length - in_extent, length - done);
      MEMOFFLOAD_RETURN_IF_ERROR(fn(base + in_extent, done, n));
      done += n;
    }
    pos = end;
  }
  if (done != length) {
    return Internal("range [" + std::to_string(offset) + ", " + std::to_string(offset + length) +
                    ") exceeds the group's " + std::to_string(pos) + " bytes");
  }
  return Status::Ok();
}

struct StoredStorage {
  c10::Device device{c10::kCPU};
  uint64_t nbytes = 0;
  uint64_t offset = 0;   // in the group's byte stream
  ReadyToken ready = 0;  // consumed by the copy (worker) or at release
  CopyEngine* engine = nullptr;
  bool copy_queued = false;  // training side: a copy task was posted at Add
  // Written by the worker; read by Get under Group::mu.
  bool copied = false;     // bytes are in the reservation (not yet committed)
  bool offloaded = false;  // committed; `source` dropped
  c10::Storage source;     // held until offloaded, or for good when skipped
  c10::Storage restored;   // prefetched copy; dropped after each backward round
};

struct Entry {
  int32_t storage = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset = 0;
  caffe2::TypeMeta dtype;
  c10::Device device{c10::kCPU};
  c10::VariableVersion version{c10::VariableVersion::Disabled::DISABLED};
  uint32_t saved_version = 0;
  bool live = true;
  bool unpacked = false;  // in the current backward round
};

struct Group {
  uint64_t key = 0;
  int64_t slot = -1;
  uint64_t daemon_id = 0;
  // Training side, guarded by Impl::mu_.
  bool open = true;
  uint64_t planned_bytes = 0;  // reserved at Begin (0: reserve at close)
  uint64_t bump = 0;
  std::unordered_map<c10::StorageImpl*, int32_t> by_impl;  // while open
  std::vector<std::shared_ptr<StoredStorage>> storages;
  std::vector<Entry> entries;
  int64_t live = 0;
  int64_t unpacked = 0;
  bool prefetch_issued = false;
  std::shared_future<Status> prefetched;
  std::promise<Status> prefetch_promise;
  // Worker side; read by Get only after `prefetched` is ready.
  std::shared_ptr<Client> client;  // set once the reservation succeeded
  std::vector<Extent> write_extents;
  uint64_t reserved_bytes = 0;
  bool reserve_tried = false;
  Status reserve_status;
  bool in_arena = false;  // committed
  std::vector<Extent> read_extents;
  // Guards StoredStorage::{copied, offloaded, source, restored}.
  std::mutex mu;
};

std::string DescribeTensor(const Entry& e) {
  std::ostringstream out;
  out << "[" << e.dtype.name() << " " << c10::IntArrayRef(e.sizes) << "]";
  return out.str();
}

}  // namespace

class GroupOffloader::Impl {
 public:
  explicit Impl(const OffloaderOptions& options) : options_(options) {
    host_engine_ = MakeHostCopyEngine();
    if (options.use_cuda) {
      Result<std::unique_ptr<CopyEngine>> cuda = MakeCudaCopyEngine();
      if (cuda.ok()) cuda_engine_ = std::move(cuda).value();
    }
    stats_.engine = cuda_engine_ ? "cuda" : "host";
  }

  ~Impl() {
    std::vector<std::shared_ptr<Group>> groups;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [key, g] : groups_) groups.push_back(g);
      groups_.clear();
    }
    for (auto& g : groups) PostRelease(g);
    worker_.Flush();
  }

  void AttachNow() {
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.blocking_rpcs;
    }
    worker_.Post([this] { EnsureClient(/*force=*/true); });
    worker_.Flush();
  }

  Status BeginGroup(uint64_t key, int64_t slot) {
    auto g = std::make_shared<Group>();
    g->key = key;
    g->slot = slot;
    g->prefetched = g->prefetch_promise.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (groups_.count(key) != 0) {
        return InvalidArgument("group key " + std::to_string(key) + " is already in use");
      }
      g->daemon_id = ++next_daemon_id_;
      if (slot >= 0) {
        auto it = learned_bytes_.find(slot);
        if (it != learned_bytes_.end()) g->planned_bytes = it->second;
      }
      groups_[key] = g;
    }
    Count([](OffloaderStats& s) {
      ++s.groups;
      ++s.groups_live;
    });
    if (g->planned_bytes > 0) {
      const uint64_t bytes = g->planned_bytes;
      worker_.Post([this, g, bytes] { Reserve(*g, bytes); });
    }
    return Status::Ok();
  }

  Result<int64_t> Add(uint64_t key, const at::Tensor& tensor, uintptr_t stream) {
    if (!tensor.defined()) return InvalidArgument("undefined tensor");
    if (tensor.layout() != c10::kStrided || !tensor.has_storage()) {
      return InvalidArgument("only strided tensors with storage can be offloaded");
    }
    CopyEngine* engine = EngineFor(tensor.device());
    if (engine == nullptr) {
      return InvalidArgument("no copy engine for device " + tensor.device().str());
    }
    std::shared_ptr<StoredStorage> posted;
    std::shared_ptr<Group> g;
    int64_t index = 0;
    bool dedup = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end() || !it->second->open) {
        return FailedPrecondition("group " + std::to_string(key) + " is not open");
      }
      g = it->second;
      const c10::Storage& storage = tensor.storage();
      c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
      int32_t storage_index = 0;
      auto found = g->by_impl.find(impl);
      if (found != g->by_impl.end()) {
        storage_index = found->second;
        dedup = true;
      } else {
        Result<ReadyToken> ready = engine->MarkReady(tensor.device(), stream);
        if (!ready.ok()) return ready.status();
        auto s = std::make_shared<StoredStorage>();
        s->device = tensor.device();
        s->nbytes = storage.nbytes();
        s->offset = AlignUp(g->bump, kAlignBytes);
        s->ready = *ready;
        s->engine = engine;
        s->source = storage;
        g->bump = s->offset + s->nbytes;
        if (g->planned_bytes > 0 && g->bump <= g->planned_bytes) {
          s->copy_queued = true;
          posted = s;
        }
        storage_index = static_cast<int32_t>(g->storages.size());
        g->storages.push_back(s);
        g->by_impl.emplace(impl, storage_index);
      }
      Entry e;
      e.storage = storage_index;
      e.sizes = tensor.sizes().vec();
      e.strides = tensor.strides().vec();
      e.storage_offset = tensor.storage_offset();
      e.dtype = tensor.dtype();
      e.device = tensor.device();
      e.version = tensor.unsafeGetTensorImpl()->version_counter();
      if (e.version.enabled()) e.saved_version = e.version.current_version();
      g->entries.push_back(std::move(e));
      ++g->live;
      index = static_cast<int64_t>(g->entries.size()) - 1;
    }
    Count([dedup](OffloaderStats& s) {
      ++s.tensors;
      if (dedup) ++s.deduplicated;
    });
    if (posted) worker_.Post([this, g, posted] { CopyOut(*g, *posted); });
    return index;
  }

  Status CloseGroup(uint64_t key) {
    std::shared_ptr<Group> g;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end() || !it->second->open) {
        return FailedPrecondition("group " + std::to_string(key) + " is not open");
      }
      g = it->second;
      g->open = false;
      g->by_impl.clear();
      if (g->slot >= 0 && g->bump > 0) learned_bytes_[g->slot] = AlignUp(g->bump, kAlignBytes);
    }
    worker_.Post([this, g] { Close(*g); });
    return Status::Ok();
  }

  Status PrefetchGroup(uint64_t key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(key);
    if (it == groups_.end() || it->second->open) return Status::Ok();
    IssuePrefetchLocked(it->second);
    return Status::Ok();
  }

  Result<at::Tensor> Get(uint64_t key, int64_t index) {
    std::shared_ptr<Group> g;
    std::shared_ptr<StoredStorage> s;
    Entry e;
    bool demand = false;
    bool open = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end()) {
        return NotFound("group " + std::to_string(key) + " was released");
      }
      g = it->second;
      if (index < 0 || index >= static_cast<int64_t>(g->entries.size())) {
        return InvalidArgument("entry " + std::to_string(index) + " is not in group " +
                               std::to_string(key));
      }
      e = g->entries[index];
      if (e.version.enabled() && e.version.current_version() != e.saved_version) {
        return FailedPrecondition(
            "one of the variables needed for gradient computation has been modified by an "
            "inplace operation: " +
            DescribeTensor(e) + " is at version " + std::to_string(e.version.current_version()) +
            "; expected version " + std::to_string(e.saved_version) +
            " instead. (memoffload: it was saved in offload group " + std::to_string(key) + ")");
      }
      s = g->storages[e.storage];
      open = g->open;
      if (!open && !g->prefetch_issued) {
        demand = true;
        IssuePrefetchLocked(g);
      }
    }
    c10::Storage storage;
    if (open) {
      // Still in its forward: the group holds every source.
      std::lock_guard<std::mutex> lock(g->mu);
      storage = s->source;
    } else {
      // Closed: wait for the prefetch (queued after the close), so that every
      // entry of a storage sees the same final state and views stay views of
      // one storage.
      if (demand) Count([](OffloaderStats& st) { ++st.blocking_rpcs; });
      if (g->prefetched.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
        const auto start = Clock::now();
        g->prefetched.wait();
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        Count([seconds](OffloaderStats& st) {
          ++st.prefetch_waits;
          st.prefetch_wait_seconds += seconds;
        });
      }
      MEMOFFLOAD_RETURN_IF_ERROR(g->prefetched.get());
      std::lock_guard<std::mutex> lock(g->mu);
      if (s->source) {
        storage = s->source;
      } else if (s->restored) {
        storage = s->restored;
      } else {
        // A second backward over the same graph: the round's copy was
        // dropped, the arena still holds the data until the group dies.
        Result<c10::Storage> again = Restore(*g, *s);
        if (!again.ok()) return again.status();
        s->restored = *again;
        storage = *again;
        Count([](OffloaderStats& st) { ++st.rereads; });
      }
    }
    at::Tensor out;
    try {
      at::NoGradGuard no_grad;
      out = at::empty({0}, at::TensorOptions().dtype(e.dtype).device(e.device));
      out.set_(storage, e.storage_offset, e.sizes, e.strides);
    } catch (const std::exception& ex) {
      return Internal(std::string("restoring a tensor failed: ") + ex.what());
    }
    MarkUnpacked(g, index);
    return out;
  }

  Status DropEntry(uint64_t key, int64_t index) {
    std::shared_ptr<Group> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end()) return Status::Ok();
      Group& g = *it->second;
      if (index < 0 || index >= static_cast<int64_t>(g.entries.size())) {
        return InvalidArgument("entry " + std::to_string(index) + " is not in group " +
                               std::to_string(key));
      }
      Entry& e = g.entries[index];
      if (!e.live) return Status::Ok();
      e.live = false;
      --g.live;
      if (e.unpacked) --g.unpacked;
      if (g.live == 0 && !g.open) {
        release = it->second;
        groups_.erase(it);
      } else {
        MaybeEndRoundLocked(g);
      }
    }
    if (release) PostRelease(release);
    return Status::Ok();
  }

  Status ReleaseGroup(uint64_t key) {
    std::shared_ptr<Group> g;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end()) return Status::Ok();
      g = it->second;
      groups_.erase(it);
    }
    PostRelease(g);
    return Status::Ok();
  }

  Result<std::vector<at::Tensor>> GetGroup(uint64_t key) {
    int64_t n = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(key);
      if (it == groups_.end()) return NotFound("group " + std::to_string(key) + " is unknown");
      n = static_cast<int64_t>(it->second->entries.size());
    }
    std::vector<at::Tensor> out;
    for (int64_t i = 0; i < n; ++i) {
      Result<at::Tensor> t = Get(key, i);
      if (!t.ok()) return t.status();
      out.push_back(*t);
    }
    return out;
  }

  void Flush() { worker_.Flush(); }

  OffloaderStats stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
  }

 private:
  template <typename Fn>
  void Count(Fn fn) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    fn(stats_);
  }

  CopyEngine* EngineFor(c10::Device device) {
    if (device.is_cpu()) return host_engine_.get();
    if (cuda_engine_ && cuda_engine_->Handles(device)) return cuda_engine_.get();
    return nullptr;
  }

  void IssuePrefetchLocked(const std::shared_ptr<Group>& g) {
    if (g->prefetch_issued) return;
    g->prefetch_issued = true;
    worker_.Post([this, g] { Prefetch(*g); });
  }

  void MarkUnpacked(const std::shared_ptr<Group>& g, int64_t index) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = g->entries[index];
    if (e.unpacked || !e.live) return;
    e.unpacked = true;
    ++g->unpacked;
    MaybeEndRoundLocked(*g);
  }

  // Every live entry was unpacked once: this backward no longer needs the
  // restored copies (autograd holds what it still uses).
  void MaybeEndRoundLocked(Group& g) {
    if (g.live == 0 || g.unpacked < g.live) return;
    for (Entry& e : g.entries) e.unpacked = false;
    g.unpacked = 0;
    std::lock_guard<std::mutex> lock(g.mu);
    for (auto& s : g.storages) s->restored = c10::Storage();
  }

  void PostRelease(const std::shared_ptr<Group>& g) {
    Count([](OffloaderStats& s) { --s.groups_live; });
    worker_.Post([this, g] { Release(*g); });
  }

  // ---- worker thread ----

  // The current session, attaching a new one when there is none (at most
  // once per reconnect interval unless `force`).
  std::shared_ptr<Client> EnsureClient(bool force = false) {
    if (client_ && !client_broken_) return client_;
    const auto now = Clock::now();
    if (!force && attempted_ &&
        now - last_attempt_ < std::chrono::milliseconds(options_.reconnect_interval_ms)) {
      return nullptr;
    }
    attempted_ = true;
    last_attempt_ = now;
    client::AttachOptions attach;
    attach.runtime_dir = options_.runtime_dir;
    attach.job_id = options_.job_id;
    attach.rank = options_.rank;
    attach.local_rank = options_.local_rank;
    attach.rpc_timeout_ms = options_.rpc_timeout_ms;
    Result<std::unique_ptr<Client>> attached = Client::Attach(attach);
    if (!attached.ok()) {
      NoteFailure(attached.status(), "attach");
      return nullptr;
    }
    const bool reconnect = client_ != nullptr;
    client_ = std::shared_ptr<Client>(std::move(attached).value());
    client_broken_ = false;
    chunk_bytes_ = 0;
    if (cuda_engine_) {
      Result<std::unique_ptr<client::AdminClient>> admin =
          client::AdminClient::Connect(client_->runtime_dir(), options_.rpc_timeout_ms);
      if (admin.ok()) {
        Result<v1::GetStatusResponse> status = (*admin)->GetStatus();
        if (status.ok()) chunk_bytes_ = status->chunk_size_bytes();
      }
    }
    Count([reconnect](OffloaderStats& s) {
      s.connected = true;
      if (reconnect) ++s.reconnects;
    });
    if (reconnect) std::fprintf(stderr, "memoffload: attached a new session to memoffloadd\n");
    return client_;
  }

  // Logs once per status code; marks the session broken on transport errors.
  void NoteFailure(const Status& st, const char* what) {
    if (IsTransport(st.code()) && client_) client_broken_ = true;
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.rpc_errors;
      if (IsTransport(st.code())) stats_.connected = false;
      stats_.last_skip_reason = std::string(what) + ": " + st.ToString();
      first = logged_codes_.insert(static_cast<int>(st.code())).second;
    }
    if (first) {
      std::fprintf(stderr,
                   "memoffload: %s failed (%s); affected groups stay in memory, training goes "
                   "on (logged once per error code)\n",
                   what, st.ToString().c_str());
    }
  }

  void Reserve(Group& g, uint64_t bytes) {
    g.reserve_tried = true;
    std::shared_ptr<Client> c = EnsureClient();
    if (!c) {
      g.reserve_status = Unavailable("memoffloadd is not reachable");
      return;
    }
    Result<client::Reservation> r = c->Reserve(g.daemon_id, bytes);
    if (!r.ok()) {
      g.reserve_status = r.status();
      NoteFailure(r.status(), "Reserve");
      return;
    }
    g.client = c;
    g.write_extents = r->extents;
    g.reserved_bytes = r->reserved_bytes;
    if (cuda_engine_ && chunk_bytes_ > 0) {
      for (const Extent& e : g.write_extents) {
        uint8_t* base = c->Address(Extent{e.chunk, 0, chunk_bytes_});
        if (base != nullptr) cuda_engine_->PrepareHostRange(base, chunk_bytes_);
      }
    }
  }

  void CopyOut(Group& g, StoredStorage& s) {
    if (!g.client || s.offset + s.nbytes > g.reserved_bytes) return;  // handled at Close
    const ReadyToken ready = s.ready;
    s.ready = 0;
    const uint8_t* src = static_cast<const uint8_t*>(s.source.data());
    bool first = true;
    Status st = ForEachPiece(*g.client, g.write_extents, s.offset, s.nbytes,
                             [&](uint8_t* dst, uint64_t done, uint64_t n) {
                               const ReadyToken token = first ? ready : 0;
                               first = false;
                               return s.engine->CopyOut(s.device, src + done, dst, n, token);
                             });
    if (first) s.engine->DropToken(ready);  // zero bytes: no piece consumed it
    if (!st.ok()) {
      NoteFailure(st, "copy to the arena");
      return;
    }
    std::lock_guard<std::mutex> lock(g.mu);
    s.copied = true;
  }

  void Close(Group& g) {
    std::vector<std::shared_ptr<StoredStorage>> storages;
    uint64_t total = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      storages = g.storages;
      total = g.bump;
    }
    if (!g.reserve_tried && total > 0) Reserve(g, AlignUp(total, kAlignBytes));
    if (g.client && total > g.reserved_bytes) {
      // The group grew beyond last step's size: trade the reservation for
      // one of the full size (sources are still held; copy everything).
      Status st = g.client->Release(g.daemon_id);
      (void)st;
      g.client.reset();
      {
        std::lock_guard<std::mutex> lock(g.mu);
        for (auto& s : storages) s->copied = false;
      }
      Reserve(g, AlignUp(total, kAlignBytes));
    }
    uint64_t used = 0;
    uint64_t stored = 0;
    uint64_t kept = 0;
    for (auto& s : storages) {
      if (!s->copied) CopyOut(g, *s);
      if (s->ready != 0) {
        s->engine->DropToken(s->ready);
        s->ready = 0;
      }
      if (s->copied) {
        used = std::max(used, s->offset + s->nbytes);
        stored += s->nbytes;
      } else {
        kept += s->nbytes;
      }
    }
    if (g.client && used == 0) {
      Status st = g.client->Release(g.daemon_id);
      (void)st;
      g.client.reset();
    }
    if (g.client) {
      Result<client::CommitInfo> commit = g.client->Commit(g.daemon_id, used, {stored, 0});
      if (commit.ok()) {
        g.in_arena = true;
        std::lock_guard<std::mutex> lock(g.mu);
        for (auto& s : storages) {
          if (!s->copied) continue;
          s->offloaded = true;
          s->source = c10::Storage();
        }
      } else {
        NoteFailure(commit.status(), "Commit");
        Status st = g.client->Release(g.daemon_id);
        (void)st;
        g.client.reset();
        kept += stored;
        stored = 0;
      }
    }
    if (!g.client && total > 0 && g.reserve_tried && !g.reserve_status.ok()) {
      // Reserve failed: everything stays; NoteFailure already counted it.
    }
    Count([&](OffloaderStats& st) {
      st.offloaded_bytes += stored;
      st.skipped_bytes += kept;
      if (stored > 0) ++st.groups_offloaded;
      if (kept > 0) ++st.groups_skipped;
      if (kept > 0 && st.last_skip_reason.empty()) {
        st.last_skip_reason = "group grew beyond its reservation";
      }
    });
  }

  // Copies an offloaded storage back from the arena into fresh memory.
  Result<c10::Storage> Restore(Group& g, StoredStorage& s) {
    c10::Storage out;
    try {
      out = at::empty({static_cast<int64_t>(s.nbytes)},
                      at::TensorOptions().dtype(at::kByte).device(s.device))
                .storage();
    } catch (const std::exception& ex) {
      return Internal(std::string("allocating a restored storage failed: ") + ex.what());
    }
    uint8_t* dst = static_cast<uint8_t*>(out.data());
    MEMOFFLOAD_RETURN_IF_ERROR(ForEachPiece(*g.client, g.read_extents, s.offset, s.nbytes,
                                            [&](uint8_t* src, uint64_t done, uint64_t n) {
                                              return s.engine->CopyIn(s.device, src, dst + done, n);
                                            }));
    return out;
  }

  void Prefetch(Group& g) {
    if (!g.in_arena) {
      g.prefetch_promise.set_value(Status::Ok());
      return;
    }
    Result<client::Placement> placement = g.client->Prefetch(g.daemon_id);
    if (placement.ok()) {
      g.read_extents = placement->extents;
    } else if (IsTransport(placement.status().code()) ||
               ((placement.status().code() == StatusCode::kNotFound ||
                 placement.status().code() == StatusCode::kUnauthenticated) &&
                (g.client != client_ || client_broken_))) {
      // The daemon is gone (or restarted and no longer knows the session):
      // the data is still in this process's mapping of the old chunks, whose
      // extents nobody else was given.
      NoteFailure(placement.status(), "Prefetch");
      g.read_extents = g.write_extents;
    } else {
      NoteFailure(placement.status(), "Prefetch");
      g.prefetch_promise.set_value(
          DataLoss("offload group " + std::to_string(g.key) +
                   " cannot be read back: " + placement.status().ToString()));
      return;
    }
    std::vector<std::shared_ptr<StoredStorage>> storages;
    {
      std::lock_guard<std::mutex> lock(mu_);
      storages = g.storages;
    }
    uint64_t bytes = 0;
    for (auto& s : storages) {
      if (!s->offloaded) continue;
      Result<c10::Storage> restored = Restore(g, *s);
      if (!restored.ok()) {
        g.prefetch_promise.set_value(restored.status());
        return;
      }
      std::lock_guard<std::mutex> lock(g.mu);
      s->restored = *restored;
      bytes += s->nbytes;
    }
    Count([bytes](OffloaderStats& st) { st.prefetched_bytes += bytes; });
    g.prefetch_promise.set_value(Status::Ok());
  }

  void Release(Group& g) {
    for (auto& s : g.storages) {
      if (s->ready != 0) {
        s->engine->DropToken(s->ready);
        s->ready = 0;
      }
    }
    if (g.client) {
      Status st = g.client->Release(g.daemon_id);
      if (!st.ok() && !IsTransport(st.code())) NoteFailure(st, "Release");
      g.client.reset();
    }
    if (!g.prefetch_issued) g.prefetch_promise.set_value(Status::Ok());
  }

  static Status DataLoss(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }

  const OffloaderOptions options_;
  std::unique_ptr<CopyEngine> host_engine_;
  std::unique_ptr<CopyEngine> cuda_engine_;

  std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Group>> groups_;    // GUARDED_BY(mu_)
  std::unordered_map<int64_t, uint64_t> learned_bytes_;  // GUARDED_BY(mu_)
  uint64_t next_daemon_id_ = 0;                          // GUARDED_BY(mu_)

  mutable std::mutex stats_mu_;
  OffloaderStats stats_;        // GUARDED_BY(stats_mu_)
  std::set<int> logged_codes_;  // GUARDED_BY(stats_mu_)

  // Worker-only state.
  std::shared_ptr<Client> client_;
  bool client_broken_ = false;
  bool attempted_ = false;
  Clock::time_point last_attempt_;
  uint64_t chunk_bytes_ = 0;

  Worker worker_;  // last: destroyed (joined) first
};

std::shared_ptr<GroupOffloader> GroupOffloader::Create(const OffloaderOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  impl->AttachNow();
  return std::shared_ptr<GroupOffloader>(new GroupOffloader(std::move(impl)));
}

GroupOffloader::GroupOffloader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GroupOffloader::~GroupOffloader() = default;

Status GroupOffloader::BeginGroup(uint64_t key, int64_t slot) {
  return impl_->BeginGroup(key, slot);
}
Result<int64_t> GroupOffloader::Add(uint64_t key, const at::Tensor& tensor, uintptr_t stream) {
  return impl_->Add(key, tensor, stream);
}
Status GroupOffloader::CloseGroup(uint64_t key) { return impl_->CloseGroup(key); }
Status GroupOffloader::PrefetchGroup(uint64_t key) { return impl_->PrefetchGroup(key); }
Result<at::Tensor> GroupOffloader::Get(uint64_t key, int64_t entry) {
  return impl_->Get(key, entry);
}
Status GroupOffloader::DropEntry(uint64_t key, int64_t entry) {
  return impl_->DropEntry(key, entry);
}
Status GroupOffloader::ReleaseGroup(uint64_t key) { return impl_->ReleaseGroup(key); }

Status GroupOffloader::OffloadGroup(uint64_t key, const std::vector<at::Tensor>& tensors,
                                    uintptr_t stream, int64_t slot) {
  MEMOFFLOAD_RETURN_IF_ERROR(impl_->BeginGroup(key, slot));
  for (const at::Tensor& t : tensors) {
    Result<int64_t> added = impl_->Add(key, t, stream);
    if (!added.ok()) {
      Status st = impl_->ReleaseGroup(key);
      (void)st;
      return added.status();
    }
  }
  return impl_->CloseGroup(key);
}

Result<std::vector<at::Tensor>> GroupOffloader::GetGroup(uint64_t key) {
  return impl_->GetGroup(key);
}
void GroupOffloader::Flush() { impl_->Flush(); }
OffloaderStats GroupOffloader::stats() const { return impl_->stats(); }

}  // namespace memoffload::torch
