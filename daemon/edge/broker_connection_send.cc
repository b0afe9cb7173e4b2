// Broker::Connection's write path: a reply's frames, with the chunk fds
// they pass, written without blocking (broker_connection.h).
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <vector>

#include "base/log.h"
#include "edge/broker_connection.h"

namespace memoffload::daemon {

void Broker::Connection::Send(std::vector<OutFrame> frames, std::function<void()> done) {
  if (!out_.empty()) {
    // A notice is being written (AskToLeave): this goes after it, owning
    // duplicates of its fds.
    if (!OwnFds(&frames)) {
      MO_LOG_WARN_LIMITED("broker: pid %d: cannot keep chunk fds for a queued reply: %s", peer_.pid,
                          std::strerror(errno));
      return Finish();
    }
    queued_.push_back({std::move(frames), std::move(done)});
    return;
  }
  SendOwned(std::move(frames), std::move(done), /*owned=*/false);
}

bool Broker::Connection::OwnFds(std::vector<OutFrame>* frames) {
  for (size_t i = 0; i < frames->size(); ++i) {
    for (size_t j = 0; j < (*frames)[i].fds.size(); ++j) {
      const int dup = fcntl((*frames)[i].fds[j], F_DUPFD_CLOEXEC, 0);
      if (dup >= 0) {
        (*frames)[i].fds[j] = dup;
        continue;
      }
      const int error = errno;
      for (size_t a = 0; a <= i; ++a) {  // close what was duplicated, forget the rest
        for (size_t b = 0; b < (a == i ? j : (*frames)[a].fds.size()); ++b) {
          close((*frames)[a].fds[b]);
        }
      }
      for (OutFrame& f : *frames) f.fds.clear();
      errno = error;
      return false;
    }
  }
  return true;
}

void Broker::Connection::SendOwned(std::vector<OutFrame> frames, std::function<void()> done,
                                   bool owned) {
  out_ = std::move(frames);
  fds_owned_ = owned;
  out_frame_ = 0;
  out_offset_ = 0;
  on_sent_ = std::move(done);
  write_timer_.expires_after(std::chrono::milliseconds(kReplyTimeoutMs));
  auto self = shared_from_this();
  write_timer_.async_wait([self](error_code ec) {
    if (ec || self->closed_ || self->out_frame_ == self->out_.size()) return;
    MO_LOG_WARN_LIMITED("broker: pid %d uid %u did not read its reply within %d ms; dropping it",
                        self->peer_.pid, self->peer_.uid, kReplyTimeoutMs);
    self->broker_->metrics_->AttachRefused("slow_reader");
    self->Finish();
  });
  Flush();
}

void Broker::Connection::Flush() {
  while (out_frame_ < out_.size()) {
    OutFrame& frame = out_[out_frame_];
    iovec iov{frame.bytes.data() + out_offset_, frame.bytes.size() - out_offset_};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
    if (out_offset_ == 0 && !frame.fds.empty()) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * frame.fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * frame.fds.size());
      std::memcpy(CMSG_DATA(c), frame.fds.data(), sizeof(int) * frame.fds.size());
    }
    const ssize_t n = sendmsg(socket_.native_handle(), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!OwnPendingFds()) {
          MO_LOG_WARN_LIMITED("broker: pid %d: cannot keep chunk fds for a pending reply: %s",
                              peer_.pid, std::strerror(errno));
          return Finish();
        }
        auto self = shared_from_this();
        socket_.async_wait(Socket::wait_write, [self](error_code ec) {
          if (self->closed_) return;
          if (ec) return self->Finish();
          self->Flush();
        });
        return;
      }
      if (errno == ETOOMANYREFS && out_offset_ == 0) {
        // Descriptors in flight from the daemon's uid are over its
        // RLIMIT_NOFILE: the daemon's condition, not this peer's fault.
        MO_LOG_WARN_LIMITED(
            "broker: cannot pass %zu chunk fds to pid %d uid %u: the daemon's uid has more "
            "descriptors in flight than RLIMIT_NOFILE; %s",
            frame.fds.size(), peer_.pid, peer_.uid,
            frame.chunk_reply ? "refusing the chunk request" : "ending the attach");
        if (frame.chunk_reply) {
          DropFds(&frame);
          frame = RefusedChunkReply();
          continue;
        }
      }
      return Finish();  // the peer is gone
    }
    if (out_offset_ == 0) DropFds(&frame);  // they went with this first byte
    out_offset_ += static_cast<size_t>(n);
    if (out_offset_ == frame.bytes.size()) {
      ++out_frame_;
      out_offset_ = 0;
    }
  }
  write_timer_.cancel();
  out_.clear();
  out_.shrink_to_fit();
  out_frame_ = 0;
  fds_owned_ = false;
  std::function<void()> done = std::move(on_sent_);
  if (done) done();
  if (!closed_ && out_.empty() && !queued_.empty()) {
    Queued next = std::move(queued_.front());
    queued_.pop_front();
    SendOwned(std::move(next.frames), std::move(next.done), /*owned=*/true);
  }
}

bool Broker::Connection::OwnPendingFds() {
  if (fds_owned_) return true;
  for (size_t i = out_frame_; i < out_.size(); ++i) {
    for (int& fd : out_[i].fds) {
      const int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (dup < 0) {
        // Borrowed and owned fds are mixed now: forget the borrowed ones.
        const int error = errno;
        for (size_t j = out_frame_; j <= i; ++j) {
          for (int& owned : out_[j].fds) {
            if (&owned == &fd) break;
            close(owned);
          }
          out_[j].fds.clear();
        }
        for (size_t j = i + 1; j < out_.size(); ++j) out_[j].fds.clear();
        errno = error;
        return false;
      }
      fd = dup;
    }
  }
  fds_owned_ = true;
  return true;
}

void Broker::Connection::DropFds(OutFrame* frame) {
  if (fds_owned_) {
    for (int fd : frame->fds) close(fd);
  }
  frame->fds.clear();
}

void Broker::Connection::DropAllFds() {
  for (size_t i = out_frame_; i < out_.size(); ++i) DropFds(&out_[i]);
  for (Queued& q : queued_) {  // their fds are duplicates
    for (OutFrame& f : q.frames) {
      for (int fd : f.fds) close(fd);
    }
  }
  queued_.clear();
}

}  // namespace memoffload::daemon
