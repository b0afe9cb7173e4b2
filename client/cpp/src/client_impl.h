// Client::Impl: the attached session's state, shared by client.cc (attach,
// groups, mappings) and client_regions.cc (checkpoint regions). Private to
// the client library.
#ifndef MEMOFFLOAD_CLIENT_SRC_CLIENT_IMPL_H_
#define MEMOFFLOAD_CLIENT_SRC_CLIENT_IMPL_H_

#include <poll.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon_channel.h"
#include "grpc_util.h"
#include "memoffload/client/client.h"
#include "memoffload/common/crc32c.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/chunk.h"
#include "memoffload/shared_mem/fd_passing.h"
#include "memoffload/v1/memoffload.grpc.pb.h"

namespace memoffload::client {

void FillCredentials(v1::SessionCredentials* creds, uint64_t id, const std::string& token);
std::vector<Extent> FromProto(const google::protobuf::RepeatedPtrField<v1::Extent>& in);

class Client::Impl {
 public:
  ~Impl() {
    // Before the chunks are unmapped (members go after this body).
    StopWatching();
    absl::MutexLock lock(&populator_mu);
    stop_populating.store(true);
    if (populator.joinable()) populator.join();
    if (lifeline_fd >= 0) close(lifeline_fd);
  }

  // Fills the page tables of `extents` on a thread of its own, a few MiB at
  // a time, ahead of a writer or reader that is about to copy them front to
  // back: it finds its blocks mapped instead of filling them itself (a
  // process new to these pages pays ~0.1 s per GiB). One at a time; a
  // running one is waited for first.
  void PopulateAhead(std::vector<Extent> extents) ABSL_LOCKS_EXCLUDED(populator_mu) {
    if (!populate_on_first_use) return;
    absl::MutexLock lock(&populator_mu);
    if (populator.joinable()) populator.join();
    populator = std::thread([this, extents = std::move(extents)] {
      constexpr uint64_t kStep = 4 * kPopulateBlockBytes;
      for (const Extent& e : extents) {
        for (uint64_t at = 0; at < e.length && !stop_populating.load(); at += kStep) {
          PopulateRange(e.chunk, e.offset + at, std::min(kStep, e.length - at));
        }
      }
    });
  }
  absl::Mutex populator_mu;
  std::thread populator ABSL_GUARDED_BY(populator_mu);
  std::atomic<bool> stop_populating{false};  // the Client is going away

  std::string runtime_dir;  // as discovered (what messages name)
  // After attach, frames on it are sent and received only while map_mu is
  // held (one exchange at a time); polled anywhere.
  int lifeline_fd = -1;
  int rpc_timeout_ms = 30000;
  bool populate = false;

  // Populate-on-first-use state, one byte per kPopulateBlockBytes of each
  // chunk (kBlockMapped once its page tables are filled). Sized at attach and
  // never resized; racing threads may both populate a block, which is
  // harmless (MADV_POPULATE_READ is idempotent).
  static constexpr uint64_t kPopulateBlockBytes = 2ull << 20;
  static constexpr uint8_t kBlockMapped = 1;
  bool populate_on_first_use = false;
  std::unique_ptr<std::atomic<uint8_t>[]> block_state;
  std::vector<uint64_t> first_block;  // index into block_state, per chunk
  bool checksums = false;
  // The extents of each reserved group, until Commit; then the placement of
  // each committed group, until Release. Kept so that, once the daemon that
  // held this session is gone, a committed group is still read from this
  // process's own mapping (see Prefetch).
  absl::Mutex groups_mu;
  std::unordered_map<uint64_t, std::vector<Extent>> reserved ABSL_GUARDED_BY(groups_mu);
  std::unordered_map<uint64_t, Placement> committed ABSL_GUARDED_BY(groups_mu);

  // Whether the daemon closed this session's broker connection. The daemon
  // ends a session exactly when it closes its connection (or exits), so a
  // closed lifeline is the only sure sign that the session is gone; once
  // seen it stays so, for that connection. The state is the connection's
  // generation (a resume makes a new one) times two, plus one once it was
  // seen closed: a thread that saw the old one closed cannot mark the new
  // one so.
  std::atomic<uint64_t> lifeline_state{2};
  bool Lost() const { return (lifeline_state.load() & 1) != 0; }
  void MarkLost(uint64_t seen) { lifeline_state.compare_exchange_strong(seen, seen | 1); }
  bool LifelineClosed() {
    const uint64_t seen = lifeline_state.load();
    if ((seen & 1) != 0) return true;
    pollfd p{lifeline_fd, POLLRDHUP, 0};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) MarkLost(seen);
    return Lost();
  }
  // A take-over (memoffloadd --take-over) hands this session to a new
  // daemon: the old one answers kTakeoverPause until it exits, its exit
  // closes the lifeline, and the session is resumed on the new one over a
  // new broker connection (client_resume.cc), by the watcher thread at once
  // or by the first call that finds it closed. A daemon's answer that it
  // does not hold the session (a restart, a crash) or refuses it is final
  // for that connection, and so is no answer within kResumeWindow; until
  // then a failed attempt (no daemon yet) is tried again. OK while the
  // lifeline is open.
  Status Resume() ABSL_LOCKS_EXCLUDED(resume_mu, map_mu);
  // Resume's one attempt; *answered: the daemon answered it.
  Status ResumeOnce(bool* answered) ABSL_LOCKS_EXCLUDED(map_mu);
  static constexpr std::chrono::seconds kResumeWindow{30};
  bool ResumeFinal() ABSL_LOCKS_EXCLUDED(resume_mu) {
    absl::MutexLock lock(&resume_mu);
    return resume_final;
  }
  absl::Mutex resume_mu;
  bool resume_final ABSL_GUARDED_BY(resume_mu) = false;
  Status resume_status ABSL_GUARDED_BY(resume_mu);
  std::chrono::steady_clock::time_point resume_first_try ABSL_GUARDED_BY(resume_mu);
  std::atomic<uint64_t> resumed{0};  // sessions resumed, for stats and tests
  int rank = -1;                     // for log lines
  // Watches the lifeline on a thread of its own and resumes the session as
  // soon as it closes (a process whose next call is minutes away still
  // resumes within the new daemon's window). Started after attach.
  void StartWatching();
  void StopWatching();
  // A pthread, not a std::thread: a child forked meanwhile (a DataLoader
  // worker) has a copy of this object but not the thread; there it is
  // neither joined nor stopped (watcher_pid says whose it is).
  pthread_t watcher{};
  bool watching = false;
  pid_t watcher_pid = 0;
  int watcher_stop[2] = {-1, -1};
  void Watch();  // the watcher's loop
  // Whether the daemon ended this session: its lifeline closed and no
  // daemon resumed it.
  // A restart that kept the session (kResume) has not ended it until the
  // next daemon refuses the resume or the window passes: meanwhile its
  // memory is this process's mapping, untouched, and calls wait (Call).
  bool SessionGone() {
    if (!LifelineClosed() || Resume().ok()) return false;
    return !resume_expected || ResumeFinal();
  }

  // One unary call of the session: its credentials filled in, the RPC
  // deadline (`timeout_ms`, or rpc_timeout_ms when 0), gRPC's status as ours
  // (FromGrpc). The caller decides what a failure means (SessionGoneOr).
  // Across a take-over the call waits (at most rpc_timeout_ms in all) and
  // is sent again: the daemon did nothing with a call it answered
  // kTakeoverPause, nor with one its gRPC transport never took.
  template <typename Request, typename Response>
  Status Call(grpc::Status (v1::Offload::Stub::*method)(grpc::ClientContext*, const Request&,
                                                        Response*),
              Request* req, Response* resp, int timeout_ms = 0) {
    // The serving daemon bounds a take-over's freeze (kTakeoverPauseMaxMs): a call
    // waits that long at most, its RPC timeout notwithstanding.
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(std::max(rpc_timeout_ms, kTakeoverPauseMaxMs));
    bool saw_pause = false;  // a take-over is under way
    for (;;) {
      bool transport = false;
      const uint64_t generation = lifeline_state.load() | 1;
      Status st = CallOnce(method, req, resp, timeout_ms, &transport);
      const bool paused = st.code() == StatusCode::kUnavailable &&
                          st.message().find(kTakeoverPause) != std::string::npos;
      saw_pause |= paused;
      const auto now = std::chrono::steady_clock::now();
      // Sent again only where the daemon did nothing with it: answered with
      // the pause, or cancelled or cut by a daemon that had handed the
      // session on (it was frozen) and closed the lifeline, then only to a
      // daemon that resumes the session.
      // (The watcher may have resumed it already: a new generation.)
      const bool gone_mid_call = (transport || st.code() == StatusCode::kCancelled) &&
                                 (LifelineClosed() || (lifeline_state.load() | 1) != generation);
      if (!(paused || gone_mid_call) || now >= until) return st;
      if (LifelineClosed()) {
        if (Resume().ok()) continue;
        // No daemon resumes it yet: during a take-over or a restart that
        // kept the session, wait for the new one (its answer is final);
        // otherwise (a crash) the call fails now.
        if (!(saw_pause || resume_expected) || ResumeFinal()) return st;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      // Until the old daemon exits (its lifeline closes: resume at once) or
      // a while passes (a take-over that did not happen: the old one serves
      // on). Asking again sooner only takes CPU from the take-over.
      pollfd p{lifeline_fd, POLLRDHUP, 0};
      (void)poll(&p, 1, paused ? 50 : 20);
    }
  }
  template <typename Request, typename Response>
  Status CallOnce(grpc::Status (v1::Offload::Stub::*method)(grpc::ClientContext*, const Request&,
                                                            Response*),
                  Request* req, Response* resp, int timeout_ms, bool* transport) {
    FillCredentials(req->mutable_session(), reply.session_id, reply.session_token);
    Result<std::shared_ptr<v1::Offload::Stub>> stub = channel->Stub();
    if (!stub.ok()) {
      *transport = stub.status().code() == StatusCode::kUnavailable;
      return stub.status();
    }
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_ms > 0 ? timeout_ms : rpc_timeout_ms);
    const grpc::Status st = ((**stub).*method)(&ctx, *req, resp);
    *transport = TransportFailed(st);
    if (*transport) channel->Failed(*stub);
    return FromGrpc(st, channel->socket_path());
  }
  // A failed call of a session that is gone is UNAVAILABLE, whatever the
  // daemon answered (a restarted daemon says NOT_FOUND or UNAUTHENTICATED for
  // a session it never knew): the caller attaches again.
  Status SessionGoneOr(const Status& st) {
    if (st.ok() || !SessionGone()) return st;
    return Unavailable("memoffloadd ended session " + std::to_string(reply.session_id) +
                       " (the daemon restarted or dropped its broker connection): attach again; "
                       "the daemon said: " +
                       (st.code() == StatusCode::kUnavailable ? st.message() : st.ToString()));
  }
  // Whether the daemon instance that held this session is gone (a new
  // instance answers, or none). Only then are this process's old mappings
  // its own: a live instance may have handed the space to another session.
  std::atomic<bool> instance_gone{false};
  bool InstanceGone() {
    if (instance_gone.load()) return true;
    // Asked twice at most: a connection gRPC gave up on is made again
    // (verified) before "nobody answers" is concluded.
    bool answered = false;
    v1::GetStatusResponse resp;
    for (int attempt = 0; attempt < 2 && !answered; ++attempt) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx, std::min(rpc_timeout_ms, 2000));
      Result<std::shared_ptr<v1::Offload::Stub>> stub = channel->Stub();
      if (!stub.ok()) break;
      const grpc::Status st = (*stub)->GetStatus(&ctx, v1::GetStatusRequest(), &resp);
      answered = st.ok();
      if (!TransportFailed(st)) break;
      channel->Failed(*stub);
    }
    if (!answered || resp.instance_id() != reply.instance_id) instance_gone = true;
    return instance_gone.load();
  }

  // CRC32C of the used bytes of each extent they touch, in order. Every
  // extent must be mapped (a checksum of bytes we cannot see is no checksum).
  Result<std::vector<uint32_t>> ExtentChecksums(const std::vector<Extent>& extents,
                                                uint64_t used) const {
    std::vector<uint32_t> out;
    uint64_t pos = 0;
    for (const Extent& e : extents) {
      if (pos >= used) break;
      const uint64_t n = std::min(e.length, used - pos);
      const uint8_t* p = Locate(e);
      if (p == nullptr) {
        return FailedPrecondition("cannot checksum extent (chunk " + std::to_string(e.chunk) +
                                  ", offset " + std::to_string(e.offset) + ", length " +
                                  std::to_string(e.length) +
                                  "): its chunk is not mapped in this process");
      }
      out.push_back(Crc32c(p, n));
      pos += e.length;
    }
    return out;
  }
  // Checks the placement's bytes against its stored checksums: DATA_LOSS
  // naming `where`, the chunk and offset on a mismatch, or when the count of
  // checksums is not one per extent the used bytes touch.
  Status Verify(const Placement& placement, const std::string& where) const {
    const size_t touched = ExtentsTouched(placement.extents, placement.used_bytes);
    if (placement.extent_crc32c.size() != touched) {
      return Status(StatusCode::kDataLoss,
                    "cannot verify " + where + ": the daemon returned " +
                        std::to_string(placement.extent_crc32c.size()) + " checksums for the " +
                        std::to_string(touched) + " extents holding its " +
                        std::to_string(placement.used_bytes) +
                        " used bytes (expected one per extent; was it committed without "
                        "checksums?)");
    }
    Result<std::vector<uint32_t>> actual = ExtentChecksums(placement.extents, placement.used_bytes);
    if (!actual.ok())
      return Status(StatusCode::kDataLoss, where + ": " + actual.status().message());
    for (size_t i = 0; i < actual->size(); ++i) {
      if ((*actual)[i] != placement.extent_crc32c[i]) {
        const Extent& e = placement.extents[i];
        char buf[96];
        std::snprintf(buf, sizeof(buf), "expected crc32c %08x, read %08x",
                      placement.extent_crc32c[i], (*actual)[i]);
        return Status(StatusCode::kDataLoss, "checksum mismatch in " + where + " at chunk " +
                                                 std::to_string(e.chunk) + " offset " +
                                                 std::to_string(e.offset) + " (extent " +
                                                 std::to_string(i) + "): " + buf);
      }
    }
    return Status::Ok();
  }
  // How many extents the first `used` bytes touch.
  static size_t ExtentsTouched(const std::vector<Extent>& extents, uint64_t used) {
    size_t n = 0;
    for (uint64_t pos = 0; n < extents.size() && pos < used; ++n) pos += extents[n].length;
    return n;
  }
  AttachReply reply;  // immutable after attach
  std::unique_ptr<DaemonChannel> channel;

  // Chunk mappings. A chunk is mapped when this session is first handed its
  // fd; the base address is published once and never changes, so Locate
  // reads it without a lock.
  absl::Mutex map_mu;
  std::vector<Chunk> chunks ABSL_GUARDED_BY(map_mu);
  std::unique_ptr<std::atomic<uint8_t*>[]> bases;  // indexed by chunk

  // Generation of each mapped chunk's backing (0: not mapped).
  std::vector<uint64_t> generations ABSL_GUARDED_BY(map_mu);

  // A chunk whose base was published (bases[chunk] not null): it never
  // changes again, so it is read without map_mu (the acquire load of its
  // base orders the read after the mapping).
  const Chunk& MappedChunk(uint32_t chunk) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return chunks[chunk];
  }

  // Maps received fds (taking ownership of all of them). A chunk this
  // session already maps keeps its mapping only when the daemon names the
  // same generation: a backing handed to a live session is never replaced,
  // so another generation is a daemon bug (INTERNAL).
  Status MapReceived(const std::vector<uint32_t>& indexes,
                     const std::vector<uint64_t>& generations_received, std::vector<int>* fds)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(map_mu) {
    Status result;
    for (size_t i = 0; i < fds->size(); ++i) {
      const int fd = (*fds)[i];
      const uint32_t index = i < indexes.size() ? indexes[i] : UINT32_MAX;
      const uint64_t generation = i < generations_received.size() ? generations_received[i] : 0;
      if (!result.ok() || index >= reply.chunks.size() || chunks[index].valid()) {
        close(fd);
        if (result.ok() && index >= reply.chunks.size()) {
          result = Internal("daemon sent chunk index " + std::to_string(index) + " out of range");
        } else if (result.ok() && generations[index] != generation) {
          result = Internal("daemon sent chunk " + std::to_string(index) + " generation " +
                            std::to_string(generation) + " while this session maps generation " +
                            std::to_string(generations[index]));
        }
        continue;
      }
      Result<Chunk> chunk = Chunk::Map(fd, reply.chunks[index].size_bytes, populate);
      if (!chunk.ok()) {
        result = chunk.status();
        continue;
      }
      chunks[index] = std::move(chunk).value();
      generations[index] = generation;
      bases[index].store(chunks[index].data(), std::memory_order_release);
    }
    fds->clear();
    return result;
  }

  // Makes sure every chunk the extents touch is mapped, asking the daemon
  // for the missing fds over the broker connection.
  Status EnsureMapped(const std::vector<uint32_t>& wanted) ABSL_LOCKS_EXCLUDED(map_mu) {
    std::vector<uint32_t> missing;
    for (uint32_t c : wanted) {
      if (c >= reply.chunks.size()) {
        return InvalidArgument("chunk " + std::to_string(c) + " does not exist");
      }
      if (bases[c].load(std::memory_order_acquire) == nullptr &&
          std::find(missing.begin(), missing.end(), c) == missing.end()) {
        missing.push_back(c);
      }
    }
    if (missing.empty()) return Status::Ok();
    absl::MutexLock lock(&map_mu);
    missing.erase(std::remove_if(missing.begin(), missing.end(),
                                 [&](uint32_t c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(map_mu) {
                                   return chunks[c].valid();
                                 }),
                  missing.end());
    for (size_t first = 0; first < missing.size(); first += kMaxFdsPerFrame) {
      const size_t last = std::min(missing.size(), first + kMaxFdsPerFrame);
      ChunkRequest request{{missing.begin() + first, missing.begin() + last}};
      MEMOFFLOAD_RETURN_IF_ERROR(RequestChunks(request));
    }
    return Status::Ok();
  }

  // The daemon's notices (attach_wire.h): kLeave asks this session to give
  // its long-lived blocks back (the daemon drains). Sticky once received.
  std::atomic<bool> leave{false};
  std::string leave_message ABSL_GUARDED_BY(map_mu);
  void Note(const std::string& payload) ABSL_EXCLUSIVE_LOCKS_REQUIRED(map_mu) {
    Result<Notice> notice = DecodeNotice(payload);
    if (!notice.ok()) return;  // a newer daemon's notice: nothing this client acts on
    if (notice->kind == NoticeKind::kResume) {
      resume_expected = true;
      return;
    }
    leave_message = notice->message;
    leave = true;
  }
  // kResume came on this lifeline: the daemon restarts keeping the session,
  // so a call waits for the resume (within kResumeWindow) instead of failing.
  std::atomic<bool> resume_expected{false};
  // Reads the notices already queued on the lifeline, without waiting: a
  // request must not be sent while the daemon's last frame is unread (the
  // daemon ends such a connection). A closed lifeline marks the session lost.
  void ReadNotices() ABSL_EXCLUSIVE_LOCKS_REQUIRED(map_mu) {
    for (;;) {
      pollfd p{lifeline_fd, POLLIN | POLLRDHUP, 0};
      if (poll(&p, 1, 0) <= 0) return;
      if ((p.revents & POLLIN) == 0) {
        if ((p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) MarkLost(lifeline_state.load());
        return;
      }
      std::string payload;
      std::vector<int> fds;
      const Status st = RecvFrame(lifeline_fd, &payload, &fds);
      CloseFds(&fds);  // a notice carries none
      if (!st.ok()) {
        MarkLost(lifeline_state.load());
        return;
      }
      if (IsNotice(payload)) Note(payload);
    }
  }
  // The reply to the request just sent, keeping the notices before it.
  Status RecvReply(std::string* payload, std::vector<int>* fds)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(map_mu) {
    for (;;) {
      MEMOFFLOAD_RETURN_IF_ERROR(RecvFrame(lifeline_fd, payload, fds));
      if (!IsNotice(*payload)) return Status::Ok();
      CloseFds(fds);
      Note(*payload);
    }
  }

  // One request/reply exchange on the broker connection.
  Status RequestChunks(const ChunkRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(map_mu) {
    ReadNotices();
    MEMOFFLOAD_RETURN_IF_ERROR(SendFrame(lifeline_fd, EncodeChunkRequest(request)));
    std::string payload;
    std::vector<int> fds;
    if (Status st = RecvReply(&payload, &fds); !st.ok()) {
      CloseFds(&fds);
      return Unavailable("memoffloadd broker connection lost: " + st.message());
    }
    Result<ChunkReply> chunk_reply = DecodeChunkReply(payload);
    if (!chunk_reply.ok()) {
      CloseFds(&fds);
      return chunk_reply.status();
    }
    if (chunk_reply->code != StatusCode::kOk) {
      CloseFds(&fds);
      return Status(chunk_reply->code, "memoffloadd refused chunk fds: " + chunk_reply->message);
    }
    if (chunk_reply->chunk_indexes.size() != fds.size()) {
      CloseFds(&fds);
      return Internal("chunk reply lists " + std::to_string(chunk_reply->chunk_indexes.size()) +
                      " chunks but carries " + std::to_string(fds.size()) + " fds");
    }
    return MapReceived(chunk_reply->chunk_indexes, chunk_reply->generations, &fds);
  }

  static std::vector<uint32_t> ChunksOf(const std::vector<Extent>& extents) {
    std::vector<uint32_t> out;
    for (const Extent& e : extents) out.push_back(e.chunk);
    return out;
  }

  // Fills the page tables of [offset, offset + length) of a mapped chunk
  // unless done before (see block_state).
  void PopulateRange(uint32_t chunk, uint64_t offset, uint64_t length) const {
    if (!populate_on_first_use || length == 0) return;
    std::atomic<uint8_t>* state = &block_state[first_block[chunk]];
    const uint64_t last = (offset + length - 1) / kPopulateBlockBytes;
    for (uint64_t b = offset / kPopulateBlockBytes; b <= last; ++b) {
      if (state[b].load(std::memory_order_acquire) == kBlockMapped) continue;
      uint64_t end = b;  // populate a run of unmapped blocks in one call
      while (end < last && state[end + 1].load(std::memory_order_relaxed) != kBlockMapped) ++end;
      const uint64_t from = b * kPopulateBlockBytes;
      // Mapped: callers located the extent first.
      const Chunk& mapped = MappedChunk(chunk);
      const uint64_t to = std::min((end + 1) * kPopulateBlockBytes, mapped.size_bytes());
      // Cannot fail for an in-range request; pages would fault on touch anyway.
      (void)mapped.MapPages(from, to - from);
      for (uint64_t i = b; i <= end; ++i) state[i].store(kBlockMapped, std::memory_order_release);
      b = end;
    }
  }

  uint8_t* Locate(const Extent& e) const {
    if (e.chunk >= reply.chunks.size()) return nullptr;
    uint8_t* base = bases[e.chunk].load(std::memory_order_acquire);
    const uint64_t size = reply.chunks[e.chunk].size_bytes;
    if (base == nullptr || e.offset > size || e.length > size - e.offset) return nullptr;
    return base + e.offset;
  }
};

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_SRC_CLIENT_IMPL_H_
