// DaemonLink: the worker's link to memoffloadd. It holds one of the
// daemon's sessions at a time (a "session" is the daemon's record of an
// attached client, nothing else). Attaches on demand, marks itself broken
// on transport errors and attaches a new session when the daemon is back,
// at most once per reconnect interval.
//
// Thread-safety: worker thread only (GroupOffloader::Create's first attach
// runs there too). Counters go to the shared StatsBook under its own lock.
#ifndef MEMOFFLOAD_TORCH_SRC_DAEMON_LINK_H_
#define MEMOFFLOAD_TORCH_SRC_DAEMON_LINK_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>

#include "memoffload/client/client.h"
#include "memoffload/common/status.h"
#include "memoffload/torch/copy_engine.h"
#include "memoffload/torch/group_offloader.h"
#include "stats_book.h"

namespace memoffload::torch {

// Transport failures: the daemon is gone or not answering. Committed data is
// still in this process's mapping of the chunks and can be read back.
bool IsTransport(StatusCode code);

class DaemonLink {
 public:
  // `pinning_engine` (may be null: the CUDA engine) registers whole chunks:
  // the daemon's chunk size is asked at each attach, and each client's
  // registrations are dropped (ForgetHostRanges) before its chunks are
  // unmapped. `pinning_engine` and `stats` must outlive every client.
  DaemonLink(const OffloaderOptions& options, CopyEngine* pinning_engine, StatsBook* stats);

  // The current session, attaching a new one when there is none (at most
  // once per reconnect interval unless `force`). nullptr: no daemon.
  std::shared_ptr<client::Client> Ensure(bool force = false);

  // Logs once per status code and counts the error; marks the session broken
  // on transport errors.
  void NoteFailure(const Status& st, const char* what);

  // Whether `c` is the current session and still believed to be alive.
  bool IsCurrent(const std::shared_ptr<client::Client>& c) const {
    return c == client_ && !broken_;
  }

 private:
  using Clock = std::chrono::steady_clock;

  const OffloaderOptions options_;
  CopyEngine* const pinning_engine_;
  StatsBook* const stats_;

  std::shared_ptr<client::Client> client_;
  bool broken_ = false;
  bool attempted_ = false;
  Clock::time_point last_attempt_;
  std::set<int> logged_codes_;
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_DAEMON_LINK_H_
