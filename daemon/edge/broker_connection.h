// Broker::Connection: one attached (or attaching) client of the broker.
// Private to broker.cc, which includes it once (the class is defined inline
// there for Broker's use), to broker_connection_send.cc (its write path) and
// broker_connection_resume.cc (a resume);
// see broker.h for the rules it keeps.
#ifndef MEMOFFLOAD_DAEMON_SRC_BROKER_CONNECTION_H_
#define MEMOFFLOAD_DAEMON_SRC_BROKER_CONNECTION_H_

#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "base/log.h"
#include "edge/broker.h"
#include "memoffload/shared_mem/attach_wire.h"
#include "memoffload/shared_mem/fd_passing.h"

namespace memoffload::daemon {

namespace asio = boost::asio;
using boost::system::error_code;
using Socket = asio::local::stream_protocol::socket;

// ", rank 3, local rank 1" for log lines: each part only when the hello
// named it (a client that knows no rank sends -1; a log never says "rank -1").
inline std::string RankLabel(int32_t rank, int32_t local_rank) {
  std::string label;
  if (rank >= 0) label += ", rank " + std::to_string(rank);
  if (local_rank >= 0) label += ", local rank " + std::to_string(local_rank);
  return label;
}

// One frame on its way out. The fds travel with the frame's first byte.
// They are the arena's chunk fds, borrowed while the reply goes out at once;
// a reply that has to wait for the peer owns duplicates instead (a chunk's
// fd may be replaced meanwhile), closed once sent or dropped.
struct OutFrame {
  std::string bytes;  // length prefix + payload
  std::vector<int> fds;
  // A chunk reply: when the kernel refuses to pass its fds (ETOOMANYREFS),
  // RefusedChunkReply() goes instead; any other frame ends the connection.
  bool chunk_reply = false;
};

// Bytes (with the fds they carry) sent on `fd` and not yet read by its peer.
inline int UnreadBytes(int fd) {
  int unread = 0;
  return ioctl(fd, SIOCOUTQ, &unread) == 0 ? unread : 0;
}

// One attached (or attaching) client. Lives in Broker::connections_ until its
// socket closes. It reads one frame at a time (as bytes arrive), and reads
// the next only once the reply to the last one is written.
class Broker::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Broker* broker, uint64_t id, Socket socket, PeerCredentials peer)
      : broker_(broker),
        id_(id),
        socket_(std::move(socket)),
        hello_timer_(broker->io_),
        write_timer_(broker->io_),
        pidfd_(broker->io_),
        peer_(peer) {}

  uid_t uid() const { return peer_.uid; }

  void Start() {
    hello_timer_.expires_after(std::chrono::milliseconds(broker_->options_.hello_timeout_ms));
    auto self = shared_from_this();
    hello_timer_.async_wait([self](error_code ec) {
      if (!ec && !self->closed_ && self->session_id_ == 0) {
        MO_LOG_WARN_LIMITED("attach from pid %d: no hello within %d ms; dropping", self->peer_.pid,
                            self->broker_->options_.hello_timeout_ms);
        self->broker_->metrics_->AttachRefused("hello_timeout");
        self->Finish();
      }
    });
    ReadFrame([this] { OnHello(); });
  }

  // Stops every watch and shuts the socket down both ways; closes it too
  // unless `keep_socket` (it is about to linger, Broker::Linger).
  void Shutdown(bool keep_socket = false) {
    error_code ignored;
    hello_timer_.cancel();
    write_timer_.cancel();
    pidfd_.close(ignored);
    socket_.cancel(ignored);
    socket_.shutdown(Socket::shutdown_both, ignored);
    if (!keep_socket) socket_.close(ignored);
  }

  void CloseSession(CloseReason reason) {
    if (session_id_ == 0) return;
    Result<SessionTable::Closed> closed = broker_->table_->Close(session_id_, reason);
    if (closed.ok()) {
      broker_->metrics_->SessionClosed(reason, closed->group_bytes);
      const std::string regions = closed->regions == 0
                                      ? ""
                                      : " and " + std::to_string(closed->region_bytes) +
                                            " bytes of " + std::to_string(closed->regions) +
                                            (closed->regions == 1 ? " region" : " regions") +
                                            " (left unfinished, or deleted and last read by it)";
      MO_LOG_INFO("session %lu (pid %d, job '%s'%s) closed (%s); reclaimed %lu bytes%s",
                  static_cast<unsigned long>(session_id_), peer_.pid, hello_.job_id.c_str(),
                  RankLabel(hello_.rank, -1).c_str(), CloseReasonName(reason),
                  static_cast<unsigned long>(closed->group_bytes), regions.c_str());
    } else {
      // The broker closes each session once; a second close means a bug.
      MO_LOG_ERROR("internal error: closing session %lu: %s",
                   static_cast<unsigned long>(session_id_), closed.status().ToString().c_str());
    }
    session_id_ = 0;
  }

  // Sends a Notice asking the session to leave (the daemon drains: `why`)
  // when it is a state session (SessionKind::kState, long-lived blocks it
  // gives back only by moving them out), once per connection.
  void AskToLeave(const std::string& why) {
    if (closed_ || session_id_ == 0 || hello_.kind != SessionKind::kState || leave_sent_) return;
    leave_sent_ = true;
    OutFrame notice = Frame(EncodeNotice({NoticeKind::kLeave, why}));
    MO_LOG_INFO("asking session %lu (pid %d, job '%s'%s) to move its placed state out: %s",
                static_cast<unsigned long>(session_id_), peer_.pid, hello_.job_id.c_str(),
                RankLabel(hello_.rank, hello_.local_rank).c_str(), why.c_str());
    std::vector<OutFrame> frames;
    frames.push_back(std::move(notice));
    // What the socket reports unread once the notice is written (SIOCOUTQ
    // counts the kernel's buffer, not the payload: a few hundred bytes):
    // a request may come while that much is unread.
    Send(std::move(frames), [this] { leave_unread_ = UnreadBytes(socket_.native_handle()); });
  }

  // Tells the session that the daemon exits keeping it for the next one (a
  // restart with a state store; `why`): its process resumes it there.
  void NoticeResume(const std::string& why);
  // Whether every frame queued is written.
  bool Flushed() const { return out_.empty() && queued_.empty(); }

  // Marks the connection closed for handlers still queued (CloseAll).
  void MarkClosed() {
    closed_ = true;
    DropAllFds();
  }

 private:
  // Reads one frame into payload_, allocating only as its bytes arrive, then
  // calls `done`. A frame over kMaxRequestFrameBytes or a closed peer ends
  // the connection (a hello gets a reply first).
  void ReadFrame(std::function<void()> done) {
    header_bytes_ = 0;
    frame_bytes_ = 0;
    payload_.clear();
    payload_.shrink_to_fit();
    on_frame_ = std::move(done);
    // Bytes of the next frame may be queued already (the last read stopped at
    // a frame's end, and the reactor is edge-triggered): try first, through
    // the event loop so that a busy peer neither recurses nor starves others.
    auto self = shared_from_this();
    asio::post(broker_->io_, [self] {
      if (!self->closed_) self->ReadAvailable();
    });
  }

  void WaitReadable() {
    auto self = shared_from_this();
    socket_.async_wait(Socket::wait_read, [self](error_code ec) {
      if (self->closed_) return;
      if (ec) return self->Finish();
      self->ReadAvailable();
    });
  }

  void ReadAvailable() {
    std::array<unsigned char, 4096> buf;
    for (;;) {
      size_t want = header_bytes_ < kFrameHeaderBytes ? kFrameHeaderBytes - header_bytes_
                                                      : frame_bytes_ - payload_.size();
      want = std::min(want, buf.size());
      const ssize_t n = recv(socket_.native_handle(), buf.data(), want, MSG_DONTWAIT);
      if (n == 0) return Finish();
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return WaitReadable();
        return Finish();
      }
      size_t used = static_cast<size_t>(n);
      if (header_bytes_ < kFrameHeaderBytes) {
        std::memcpy(header_.data() + header_bytes_, buf.data(), used);
        header_bytes_ += used;
        if (header_bytes_ < kFrameHeaderBytes) continue;
        frame_bytes_ = DecodeFrameHeader(header_.data());
        if (frame_bytes_ > kMaxRequestFrameBytes) return FrameTooLarge();
      } else {
        payload_.append(reinterpret_cast<const char*>(buf.data()), used);
      }
      if (payload_.size() == frame_bytes_) {
        std::function<void()> done = std::move(on_frame_);
        return done();
      }
    }
  }

  void FrameTooLarge() {
    const std::string what = std::to_string(frame_bytes_) + "-byte frame (limit " +
                             std::to_string(kMaxRequestFrameBytes) + ")";
    if (session_id_ == 0) return Refuse("bad_hello", InvalidArgument("hello is a " + what));
    MO_LOG_WARN_LIMITED("session %lu sent a %s on its broker connection; closing it",
                        static_cast<unsigned long>(session_id_), what.c_str());
    Finish();
  }

  void OnHello() {
    hello_timer_.cancel();
    // Access is decided after the hello so the client, which writes its hello
    // first, always reads the reason instead of a broken pipe.
    if (std::string denied = AccessDenied(broker_->policy_, peer_); !denied.empty()) {
      return Refuse("access_denied", PermissionDenied(denied));
    }
    if (IsResume(payload_)) return OnResume();
    Result<Hello> hello = DecodeHello(payload_);
    if (!hello.ok()) return Refuse("bad_hello", hello.status());
    hello_ = *hello;
    Result<SessionGrant> grant = broker_->table_->Open(
        hello_, peer_, broker_->metrics_->SeriesFor(hello_.job_id, hello_.rank));
    if (!grant.ok()) {
      return Refuse(
          grant.status().code() == StatusCode::kUnavailable ? "draining" : "session_error",
          grant.status());
    }
    Granted(*grant, "attached");
  }

  // A session a take-over handed on, resumed by its process (attach_wire.h;
  // broker_connection_resume.cc).
  void OnResume();

  // The session is this connection's: its chunk table goes out, then the
  // connection is its lifeline.
  void Granted(const SessionGrant& grant, const std::string& how) {
    session_id_ = grant.session_id;
    Result<std::vector<OutFrame>> frames = GrantFrames(grant);
    if (!frames.ok()) {
      MO_LOG_WARN("attach of pid %d failed while building the chunk table: %s", peer_.pid,
                  frames.status().ToString().c_str());
      return Finish();
    }
    if (how == "attached") broker_->metrics_->SessionOpened();
    MO_LOG_INFO("session %lu %s: pid %d, uid %u, job '%s'%s (instance %016lx)",
                static_cast<unsigned long>(session_id_), how.c_str(), peer_.pid, peer_.uid,
                hello_.job_id.c_str(), RankLabel(hello_.rank, hello_.local_rank).c_str(),
                static_cast<unsigned long>(broker_->options_.instance_id));
    WatchProcess();
    Send(std::move(*frames), [this] { WatchLifeline(); });
  }

  // Closes the session when the peer process exits, even if a child it
  // forked keeps the connection open. Skipped where the pid is not visible.
  void WatchProcess() {
    if (peer_.pid <= 0) return;
    const int fd = static_cast<int>(syscall(SYS_pidfd_open, peer_.pid, 0));
    if (fd < 0) return;
    pidfd_.assign(fd);
    auto self = shared_from_this();
    pidfd_.async_wait(asio::posix::stream_descriptor::wait_read, [self](error_code ec) {
      if (ec || self->closed_ || self->session_id_ == 0) return;
      // A process closes its fds before its pidfd turns readable: a hung-up
      // socket means the ordinary lifeline case, an open one means a child
      // still holds it.
      pollfd p{self->socket_.native_handle(), POLLIN | POLLRDHUP, 0};
      const bool hung_up = poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP));
      self->CloseSession(hung_up ? CloseReason::kLifelineClosed : CloseReason::kProcessExited);
      self->Finish();
    });
  }

  Result<std::vector<OutFrame>> GrantFrames(const SessionGrant& grant) {
    const Arena& arena = *broker_->arena_;
    Result<std::vector<ChunkGrant>> granted = broker_->table_->AttachChunks(grant.session_id);
    if (!granted.ok()) return granted.status();
    AttachReply reply;
    reply.session_id = grant.session_id;
    reply.session_token = grant.token;
    reply.grpc_socket = broker_->options_.grpc_socket_path;
    reply.page_bytes = arena.page_bytes();
    reply.session_limit_bytes = grant.limit_bytes;
    reply.instance_id = broker_->options_.instance_id;
    for (uint32_t i = 0; i < arena.chunk_count(); ++i) {
      reply.chunks.push_back({i, arena.chunk_bytes(i)});
    }
    reply.fd_frames =
        static_cast<uint32_t>((granted->size() + kMaxFdsPerFrame - 1) / kMaxFdsPerFrame);
    std::vector<OutFrame> frames;
    frames.push_back(Frame(EncodeAttachReply(reply)));
    for (size_t first = 0; first < granted->size(); first += kMaxFdsPerFrame) {
      ChunkFdBatch batch;
      std::vector<int> fds;
      for (size_t i = first; i < granted->size() && i < first + kMaxFdsPerFrame; ++i) {
        batch.chunk_indexes.push_back((*granted)[i].index);
        batch.generations.push_back((*granted)[i].generation);
        fds.push_back((*granted)[i].backing->fd());
      }
      frames.push_back(Frame(EncodeChunkFdBatch(batch), std::move(fds)));
    }
    return frames;
  }

  static OutFrame Frame(const std::string& payload, std::vector<int> fds = {}) {
    return OutFrame{
        EncodeFrameHeader(static_cast<uint32_t>(payload.size())) + payload, std::move(fds), {}};
  }

  // Serves chunk and key requests until the peer closes: the connection is
  // the session's lifeline.
  void WatchLifeline() {
    ReadFrame([this] {
      if (IsLinkKeyRequest(payload_)) return ServeLinkKeyRequest();
      ServeChunkRequest();
    });
  }

  // The job's replication keys, for this connection's uid and job id.
  void ServeLinkKeyRequest() {
    if (const int unread = UnreadBytes(socket_.native_handle()); unread > leave_unread_) {
      MO_LOG_WARN_LIMITED(
          "session %lu (pid %d uid %u) asked for keys before reading its last reply; closing it",
          static_cast<unsigned long>(session_id_), peer_.pid, peer_.uid);
      return Finish();
    }
    LinkKeyReply reply;
    Result<LinkKeyRequest> request = DecodeLinkKeyRequest(payload_);
    Result<std::vector<DerivedLinkKey>> keys =
        !request.ok() ? Result<std::vector<DerivedLinkKey>>(request.status())
        : broker_->options_.link_keys == nullptr
            ? Result<std::vector<DerivedLinkKey>>(NotFound("this memoffloadd serves no keys"))
            : broker_->options_.link_keys->KeysFor(peer_.uid, hello_.job_id);
    if (keys.ok()) {
      for (const DerivedLinkKey& k : *keys) {
        if (reply.keys.size() == kMaxLinkKeys) break;
        reply.key_ids.push_back(k.id);
        reply.keys.push_back(k.key);
      }
      MO_LOG_INFO_LIMITED("session %lu (uid %u, job '%s') was given its replication key (%s)",
                          static_cast<unsigned long>(session_id_), peer_.uid, hello_.job_id.c_str(),
                          reply.key_ids.front().c_str());
    } else {
      reply.code = keys.status().code();
      reply.message = keys.status().message();
    }
    std::vector<OutFrame> frames;
    frames.push_back(Frame(EncodeLinkKeyReply(reply)));
    Send(std::move(frames), [this] { WatchLifeline(); });
  }

  void ServeChunkRequest() {
    // A client reads each reply before it asks again. One that does not
    // would pile up chunk fds in its socket, which count against the
    // daemon's uid (RLIMIT_NOFILE) until read: past that limit no peer
    // could be handed a chunk. So each connection has at most one reply's
    // fds unread.
    if (const int unread = UnreadBytes(socket_.native_handle()); unread > leave_unread_) {
      MO_LOG_WARN_LIMITED(
          "session %lu (pid %d uid %u) asked for chunks before reading its last reply; closing "
          "it (a client reads each reply before it asks again; %d bytes queued)",
          static_cast<unsigned long>(session_id_), peer_.pid, peer_.uid, unread);
      broker_->metrics_->AttachRefused("slow_reader");
      return Finish();
    }
    ChunkReply reply;
    std::vector<int> fds;
    Result<ChunkRequest> request = DecodeChunkRequest(payload_);
    Status st = request.ok() ? Status::Ok() : request.status();
    if (st.ok() && request->chunk_indexes.size() > kMaxFdsPerFrame) {
      st = InvalidArgument("at most " + std::to_string(kMaxFdsPerFrame) + " chunks per request");
    }
    if (st.ok()) {
      std::vector<uint32_t> sorted = request->chunk_indexes;
      std::sort(sorted.begin(), sorted.end());
      if (auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
        st = InvalidArgument("chunk " + std::to_string(*twice) + " asked for twice in one request");
      }
    }
    Result<std::vector<ChunkGrant>> grants = InvalidArgument("no chunks");
    if (st.ok()) {
      grants = broker_->table_->GrantChunks(session_id_, request->chunk_indexes);
      st = grants.status();
    }
    if (st.ok()) {
      for (const ChunkGrant& g : *grants) {
        reply.chunk_indexes.push_back(g.index);
        reply.generations.push_back(g.generation);
        fds.push_back(g.backing->fd());
      }
    } else {
      reply.code = st.code();
      reply.message = st.message();
      MO_LOG_WARN_LIMITED("session %lu (pid %d): chunk request refused: %s",
                          static_cast<unsigned long>(session_id_), peer_.pid,
                          st.ToString().c_str());
    }
    std::vector<OutFrame> frames;
    frames.push_back(Frame(EncodeChunkReply(reply), std::move(fds)));
    frames.back().chunk_reply = true;
    Send(std::move(frames), [this] { WatchLifeline(); });
  }

  void Refuse(const std::string& reason, const Status& status) {
    broker_->metrics_->AttachRefused(reason);
    if (reason == "draining") {
      // Expected while draining: trainers try again until a daemon takes them.
      MO_LOG_INFO_LIMITED("attach of pid %d uid %u refused while draining: %s", peer_.pid,
                          peer_.uid, status.message().c_str());
    } else {
      MO_LOG_WARN_LIMITED("attach refused (pid %d uid %u): %s", peer_.pid, peer_.uid,
                          status.ToString().c_str());
    }
    AttachReply reply;
    reply.code = status.code();
    reply.message = status.message();
    std::vector<OutFrame> frames;
    frames.push_back(Frame(EncodeAttachReply(reply)));
    Send(std::move(frames), [this] { Finish(); });
  }

  // The write path (broker_connection_send.cc).
  // Queues `frames` (the whole reply) and writes them without blocking; calls
  // `done` once all are written. A peer that does not take them within
  // kReplyTimeoutMs is dropped.
  void Send(std::vector<OutFrame> frames, std::function<void()> done);
  // Send's start, with `owned`: whether the frames' fds are duplicates
  // (closed once sent) or borrowed from the arena's backings.
  void SendOwned(std::vector<OutFrame> frames, std::function<void()> done, bool owned);
  // Writes what the socket takes now; waits for it to be writable again, or
  // calls on_sent_ once all is written.
  void Flush();
  // Replaces the borrowed fds of frames not yet started by duplicates.
  bool OwnPendingFds();
  // Closes (when owned) and forgets a frame's fds.
  void DropFds(OutFrame* frame);
  void DropAllFds();

  static OutFrame RefusedChunkReply() {
    ChunkReply refused;
    refused.code = StatusCode::kResourceExhausted;
    refused.message =
        "memoffloadd cannot pass descriptors now (its uid has too many in flight, over "
        "RLIMIT_NOFILE); try again";
    return Frame(EncodeChunkReply(refused));
  }

  // The connection is over: reclaim and forget it. A socket whose peer has
  // not read all that was sent lingers (Broker::Linger) with its slot.
  void Finish() {
    if (closed_) return;
    closed_ = true;
    CloseSession(CloseReason::kLifelineClosed);
    DropAllFds();
    const bool unread = UnreadBytes(socket_.native_handle()) > 0;
    Shutdown(/*keep_socket=*/unread);
    if (unread) broker_->Linger(std::move(socket_), peer_);
    // May drop the last owner but `self`; a lingering socket keeps its slot.
    broker_->OnClosed(id_, peer_.uid, /*release_slot=*/!unread);
  }

  Broker* broker_;
  const uint64_t id_;
  Socket socket_;
  asio::steady_timer hello_timer_;
  asio::steady_timer write_timer_;
  asio::posix::stream_descriptor pidfd_;
  const PeerCredentials peer_;
  Hello hello_;
  uint64_t session_id_ = 0;
  bool closed_ = false;
  // Reading: the frame so far.
  std::array<unsigned char, kFrameHeaderBytes> header_{};
  size_t header_bytes_ = 0;
  uint32_t frame_bytes_ = 0;
  std::string payload_;
  // Continuations stored in the connection capture `this`, never a
  // shared_ptr: they run from a member called by a pending handler (which
  // holds the connection), and a stored strong reference would be a cycle
  // that outlives the io_context (LeakSanitizer found it at shutdown).
  std::function<void()> on_frame_;
  // Writing: the one reply in flight.
  std::vector<OutFrame> out_;
  size_t out_frame_ = 0;
  size_t out_offset_ = 0;
  std::function<void()> on_sent_;
  bool fds_owned_ = false;  // out_'s fds are duplicates to close
  // Replies that came while a notice was being written, in order, their
  // fds duplicated when queued (a chunk's backing may be replaced before
  // they are sent; the duplicates keep the ones the reply names).
  struct Queued {
    std::vector<OutFrame> frames;
    std::function<void()> done;
  };
  // Duplicates the fds of `frames` (true), or closes those it made and
  // returns false.
  static bool OwnFds(std::vector<OutFrame>* frames);
  std::deque<Queued> queued_;
  // The leave notice: sent once; it may still be unread when the client
  // asks for something (it reads notices before each request, but one may
  // cross), so a request is not taken for a slow reader's while no more is
  // unread than the socket reported right after the notice was written.
  bool leave_sent_ = false;
  int leave_unread_ = 0;
};

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SRC_BROKER_CONNECTION_H_
