// Client::Impl's side of a take-over or a restart that kept its sessions:
// the session resumed on the daemon that took the node over or started
// next (attach_wire.h, "Resume"), its groups and placed blocks where they
// were, in the same memory.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "client_impl.h"
#include "memoffload/client/daemon_trust.h"
#include "memoffload/client/log.h"
#include "memoffload/common/runtime_dir.h"

namespace memoffload::client {
namespace {

// How long a resume waits for the new daemon's answer: it answers at once
// (it placed the sessions before it took the sockets); one that does not
// is not resuming anything.
constexpr int kResumeAnswerMs = 5000;

bool SameFile(int a, int b) {
  struct stat sa {};
  struct stat sb {};
  return fstat(a, &sa) == 0 && fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

}  // namespace

Status Client::Impl::Resume() {
  if (!LifelineClosed()) return Status::Ok();
  absl::MutexLock lock(&resume_mu);
  if (!LifelineClosed()) return Status::Ok();  // another thread resumed it
  if (resume_final) return resume_status;
  const auto now = std::chrono::steady_clock::now();
  if (resume_first_try == std::chrono::steady_clock::time_point{}) resume_first_try = now;
  {
    // The last frames of the closed lifeline: a restart's kResume notice.
    absl::MutexLock map_lock(&map_mu);
    ReadNotices();
  }
  bool answered = false;
  resume_status = ResumeOnce(&answered);
  if (resume_status.ok()) {
    resume_first_try = {};  // a later take-over resumes it again
    resume_expected = false;
  } else if (answered || now - resume_first_try >= kResumeWindow) {
    resume_final = true;
  }
  return resume_status;
}

void Client::Impl::Watch() {
  for (;;) {
    pollfd p[2] = {{lifeline_fd, POLLRDHUP, 0}, {watcher_stop[0], POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR) return;
    if (p[1].revents != 0) return;
    if ((p[0].revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) == 0) continue;
    if (Resume().ok()) continue;  // watch the new connection
    {
      absl::MutexLock lock(&resume_mu);
      if (resume_final) return;  // ended: the calls say so
    }
    pollfd stop{watcher_stop[0], POLLIN, 0};
    if (poll(&stop, 1, 100) != 0) return;  // no daemon yet: again in 100 ms
  }
}

void Client::Impl::StartWatching() {
  if (lifeline_fd < 0 || pipe2(watcher_stop, O_CLOEXEC) != 0) return;
  watching = pthread_create(
                 &watcher, nullptr,
                 [](void* impl) -> void* {
                   static_cast<Impl*>(impl)->Watch();
                   return nullptr;
                 },
                 this) == 0;
  watcher_pid = getpid();
  if (!watching) {
    close(watcher_stop[0]);
    close(watcher_stop[1]);
    watcher_stop[0] = watcher_stop[1] = -1;
  }
}

void Client::Impl::StopWatching() {
  if (!watching) return;
  watching = false;
  if (getpid() != watcher_pid) return;  // a forked child's copy: not its thread, nor its pipe
  (void)!write(watcher_stop[1], "x", 1);
  pthread_join(watcher, nullptr);
  close(watcher_stop[0]);
  close(watcher_stop[1]);
  watcher_stop[0] = watcher_stop[1] = -1;
}

Status Client::Impl::ResumeOnce(bool* answered) {
  const auto start = std::chrono::steady_clock::now();
  const std::string session = "session " + std::to_string(reply.session_id);
  Result<TrustedRuntimeDir> dir = DiscoverTrustedRuntimeDir(runtime_dir, kBrokerSocketName);
  if (!dir.ok()) return dir.status();
  Result<int> fd = ConnectVerified(*dir, kBrokerSocketName);
  if (!fd.ok()) return fd.status();
  const int sock = *fd;
  auto fail = [&](Status st) {
    close(sock);
    return st;
  };
  if (Status st = SendFrame(sock, EncodeResume({reply.session_id, reply.session_token}));
      !st.ok()) {
    return fail(st);
  }
  pollfd answer{sock, POLLIN, 0};
  int polled = 0;
  do {
    polled = poll(&answer, 1, kResumeAnswerMs);
  } while (polled < 0 && errno == EINTR);
  if (polled <= 0) {
    return fail(Unavailable("memoffloadd at " + runtime_dir + " did not answer the resume of " +
                            session + " within " + std::to_string(kResumeAnswerMs) + " ms"));
  }
  timeval frame_wait{kResumeAnswerMs / 1000, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &frame_wait, sizeof(frame_wait));
  std::string payload;
  std::vector<int> fds;
  if (Status st = RecvFrame(sock, &payload, &fds); !st.ok()) {
    CloseFds(&fds);
    return fail(Unavailable("resuming " + session + ": " + st.message()));
  }
  CloseFds(&fds);
  Result<AttachReply> got = DecodeAttachReply(payload);
  *answered = true;
  if (!got.ok()) return fail(got.status());
  if (got->code != StatusCode::kOk) {
    return fail(Status(got->code, "memoffloadd did not resume " + session + ": " + got->message));
  }
  if (got->session_id != reply.session_id || got->instance_id != reply.instance_id ||
      got->chunks.size() != reply.chunks.size()) {
    return fail(Internal("memoffloadd resumed " + session + " as session " +
                         std::to_string(got->session_id) + " of instance " +
                         std::to_string(got->instance_id) + " with " +
                         std::to_string(got->chunks.size()) + " chunks"));
  }
  absl::MutexLock lock(&map_mu);
  std::vector<bool> resent(chunks.size(), false);
  for (uint32_t frame = 0; frame < got->fd_frames; ++frame) {
    if (Status st = RecvFrame(sock, &payload, &fds); !st.ok()) {
      CloseFds(&fds);
      return fail(Unavailable("resuming " + session + ": receiving chunk fds: " + st.message()));
    }
    Result<ChunkFdBatch> batch = DecodeChunkFdBatch(payload);
    if (!batch.ok() || batch->chunk_indexes.size() != fds.size() ||
        batch->generations.size() != fds.size()) {
      CloseFds(&fds);
      return fail(Internal("resuming " + session + ": malformed chunk fd batch"));
    }
    // A chunk this process maps must be the very memory it maps: its groups
    // and placed blocks are there.
    std::vector<uint32_t> fresh_indexes;
    std::vector<uint64_t> fresh_generations;
    std::vector<int> fresh_fds;
    Status same;
    for (size_t i = 0; i < fds.size(); ++i) {
      const uint32_t c = batch->chunk_indexes[i];
      if (c < resent.size()) resent[c] = true;
      if (c < chunks.size() && chunks[c].valid()) {
        if (!SameFile(fds[i], chunks[c].fd()) && same.ok()) {
          same = Internal("resuming " + session + ": the new daemon's chunk " + std::to_string(c) +
                          " is not the memory this process maps");
        }
        generations[c] = batch->generations[i];
        close(fds[i]);
      } else {
        fresh_indexes.push_back(c);
        fresh_generations.push_back(batch->generations[i]);
        fresh_fds.push_back(fds[i]);
      }
    }
    fds.clear();
    if (!same.ok()) {
      CloseFds(&fresh_fds);
      return fail(same);
    }
    if (Status st = MapReceived(fresh_indexes, fresh_generations, &fresh_fds); !st.ok()) {
      return fail(st);
    }
  }
  // Every chunk this process maps is its tenant's still: the daemon holds
  // them for the session, so each must have come again.
  for (uint32_t c = 0; c < chunks.size(); ++c) {
    if (chunks[c].valid() && !resent[c]) {
      return fail(Internal("resuming " + session + ": the new daemon did not hand chunk " +
                           std::to_string(c) + " again, which this process maps"));
    }
  }
  timeval no_wait_limit{0, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &no_wait_limit, sizeof(no_wait_limit));
  // The same fd number from here on (close-on-exec, as the first): threads
  // that poll the lifeline without a lock see the new connection, never a
  // closed or reused number.
  if (dup3(sock, lifeline_fd, O_CLOEXEC) < 0) {
    return fail(Internal("resuming " + session + ": dup3: " + std::strerror(errno)));
  }
  close(sock);
  channel->Renew();
  lifeline_state.store((lifeline_state.load() | 1) + 1);  // a new generation, open
  instance_gone = false;
  ++resumed;
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  Log(LogLevel::kInfo, StatusCode::kOk,
      session + " resumed on the memoffloadd that took the node over or restarted (" +
          std::to_string(static_cast<int>(ms)) + " ms); its groups and placed blocks are kept",
      rank);
  return Status::Ok();
}

}  // namespace memoffload::client
