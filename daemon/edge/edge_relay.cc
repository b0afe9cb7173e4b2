#include "edge/edge_relay.h"

#include <malloc.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstring>

#include "base/log.h"

namespace memoffload::daemon {

namespace asio = boost::asio;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;

namespace {
// Bytes read per call, and the most either direction holds before it stops
// reading (one read plus, towards gRPC, one unfinished frame).
constexpr size_t kReadBytes = 64 * 1024;
constexpr size_t kMaxHeld = 64 * 1024;
// Rounds of one connection's pump before the others get a turn.
constexpr int kRoundsPerTurn = 16;
constexpr auto kTickEvery = std::chrono::milliseconds(500);
// After a connection goes, gRPC frees its calls on its own threads: trim
// the heap a little later, and at most once a second.
constexpr auto kTrimAfter = std::chrono::milliseconds(300);
constexpr auto kTrimEvery = std::chrono::seconds(1);
// A uid's budget outlives its last connection by this much, so that
// reconnecting does not refill its buckets.
constexpr auto kBudgetIdle = std::chrono::seconds(60);
}  // namespace

class EdgeRelay::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(EdgeRelay* relay, int client_fd, int grpc_fd, pid_t pid, uid_t uid,
             std::shared_ptr<H2Budget> budget, std::function<void(H2Violation)> closed)
      : relay_(relay),
        client_(relay->io_, client_fd),
        grpc_(relay->io_, grpc_fd),
        pid_(pid),
        uid_(uid),
        closed_(std::move(closed)),
        guard_(relay->limits_, std::move(budget), Clock::now()) {}

  void Pump();
  // Closes both ends once; runs `closed`.
  void Close();
  void Check(Clock::time_point now) {
    if (!done_ && guard_.Expired(now) != H2Violation::kNone) Violation();
  }
  const H2Guard& guard() const { return guard_; }
  pid_t pid() const { return pid_; }
  uid_t uid() const { return uid_; }

 private:
  enum Side { kClientRead, kClientWrite, kGrpcRead, kGrpcWrite };
  void Arm(Side side);
  void Violation();
  // One non-blocking transfer; false when the connection closed.
  bool ReadClient(bool* progress);
  bool WriteGrpc(bool* progress);
  bool ReadGrpc(bool* progress);
  bool WriteClient(bool* progress);

  EdgeRelay* relay_;
  asio::posix::stream_descriptor client_;
  asio::posix::stream_descriptor grpc_;
  const pid_t pid_;
  const uid_t uid_;
  std::function<void(H2Violation)> closed_;
  H2Guard guard_;
  std::string to_grpc_;          // client bytes not yet written to gRPC
  uint64_t to_grpc_base_ = 0;    // client bytes before to_grpc_[0]
  std::string to_client_;        // gRPC bytes not yet written to the client
  std::array<bool, 4> armed_{};  // an async_wait is pending on that side
  // Whether a read may find bytes: true until a read comes back short (all
  // there was) or empty, then false until the socket says it is readable.
  // Saves the read that would only say EAGAIN.
  bool client_readable_ = true;
  bool grpc_readable_ = true;
  bool grpc_closed_ = false;
  bool done_ = false;
};

void EdgeRelay::Connection::Arm(Side side) {
  if (armed_[side]) return;
  armed_[side] = true;
  auto& d = (side == kClientRead || side == kClientWrite) ? client_ : grpc_;
  const auto type = (side == kClientRead || side == kGrpcRead)
                        ? asio::posix::stream_descriptor::wait_read
                        : asio::posix::stream_descriptor::wait_write;
  d.async_wait(type, [self = shared_from_this(), side](error_code ec) {
    self->armed_[side] = false;
    if (ec == asio::error::operation_aborted || self->done_) return;
    if (side == kClientRead) self->client_readable_ = true;
    if (side == kGrpcRead) self->grpc_readable_ = true;
    self->Pump();
  });
}

bool EdgeRelay::Connection::ReadClient(bool* progress) {
  if (!client_readable_ || to_grpc_.size() >= kMaxHeld) return true;
  char buf[kReadBytes];
  const ssize_t n = recv(client_.native_handle(), buf, sizeof(buf), 0);
  if (n > 0) {
    const std::string_view bytes(buf, static_cast<size_t>(n));
    if (guard_.ClientBytes(bytes, Clock::now()) != H2Violation::kNone) {
      Violation();
      return false;
    }
    to_grpc_.append(bytes);
    *progress = true;
    if (static_cast<size_t>(n) < sizeof(buf)) {
      client_readable_ = false;
      Arm(kClientRead);
    }
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    if (errno != EINTR) {
      client_readable_ = false;
      Arm(kClientRead);
    }
    return true;
  }
  Close();  // the client closed or failed: nothing more can come
  return false;
}

bool EdgeRelay::Connection::WriteGrpc(bool* progress) {
  const size_t ready = static_cast<size_t>(guard_.ForwardableBytes() - to_grpc_base_);
  if (ready == 0 || armed_[kGrpcWrite] || grpc_closed_) return true;
  const ssize_t n = send(grpc_.native_handle(), to_grpc_.data(), ready, MSG_NOSIGNAL);
  if (n > 0) {
    to_grpc_.erase(0, static_cast<size_t>(n));
    to_grpc_base_ += static_cast<uint64_t>(n);
    *progress = true;
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    if (errno != EINTR) Arm(kGrpcWrite);
    return true;
  }
  Close();
  return false;
}

bool EdgeRelay::Connection::ReadGrpc(bool* progress) {
  if (grpc_closed_ || !grpc_readable_ || to_client_.size() >= kMaxHeld) return true;
  char buf[kReadBytes];
  const ssize_t n = recv(grpc_.native_handle(), buf, sizeof(buf), 0);
  if (n > 0) {
    const std::string_view bytes(buf, static_cast<size_t>(n));
    guard_.ServerBytes(bytes);
    to_client_.append(bytes);
    *progress = true;
    if (static_cast<size_t>(n) < sizeof(buf)) {
      grpc_readable_ = false;
      Arm(kGrpcRead);
    }
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    if (errno != EINTR) {
      grpc_readable_ = false;
      Arm(kGrpcRead);
    }
    return true;
  }
  // gRPC closed the connection (GOAWAY, shutdown): pass on what it said.
  grpc_closed_ = true;
  *progress = true;
  return true;
}

bool EdgeRelay::Connection::WriteClient(bool* progress) {
  if (to_client_.empty()) {
    if (grpc_closed_) {
      Close();
      return false;
    }
    return true;
  }
  if (armed_[kClientWrite]) return true;
  const ssize_t n =
      send(client_.native_handle(), to_client_.data(), to_client_.size(), MSG_NOSIGNAL);
  if (n > 0) {
    to_client_.erase(0, static_cast<size_t>(n));
    *progress = true;
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    if (errno != EINTR) Arm(kClientWrite);
    return true;
  }
  Close();
  return false;
}

void EdgeRelay::Connection::Pump() {
  for (int round = 0; round < kRoundsPerTurn; ++round) {
    if (done_) return;
    bool progress = false;
    if (!ReadClient(&progress) || !WriteGrpc(&progress) || !ReadGrpc(&progress) ||
        !WriteClient(&progress)) {
      return;
    }
    if (!progress) return;
  }
  // Still busy: let the other connections have the thread first.
  asio::post(relay_->io_, [self = shared_from_this()] {
    if (!self->done_) self->Pump();
  });
}

void EdgeRelay::Connection::Violation() {
  relay_->OnViolation(*this);
  Close();
}

void EdgeRelay::Connection::Close() {
  if (done_) return;
  done_ = true;
  // Said before the client can see its end: the listener then counts a
  // violation (and refuses its uid) before that client can connect again.
  if (closed_) closed_(guard_.violation());
  closed_ = nullptr;
  error_code ignored;
  client_.close(ignored);
  grpc_.close(ignored);
  to_grpc_.clear();
  to_grpc_.shrink_to_fit();
  to_client_.clear();
  to_client_.shrink_to_fit();
  relay_->connections_.erase(shared_from_this());
  relay_->TrimSoon();
}

EdgeRelay::EdgeRelay(const H2Limits& limits)
    : limits_(limits), work_(io_.get_executor()), tick_(io_), trim_(io_) {
  Tick();
  thread_ = std::thread([this] { io_.run(); });
}

EdgeRelay::~EdgeRelay() { Stop(); }

void EdgeRelay::Stop() {
  if (stopped_.exchange(true)) return;
  asio::post(io_, [this] {
    // A timer that already fired has its handler queued, and cancel() does
    // not reach it: the handlers check stopping_ and arm nothing more.
    stopping_ = true;
    tick_.cancel();
    trim_.cancel();
    // Close() erases from the set: close copies.
    auto all = connections_;
    for (const auto& c : all) c->Close();
    work_.reset();
  });
  if (thread_.joinable()) thread_.join();
}

Result<int> EdgeRelay::Relay(int client_fd, pid_t pid, uid_t uid,
                             std::function<void(H2Violation)> closed) {
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, pair) != 0) {
    const int error = errno;
    close(client_fd);
    const std::string why =
        std::string("cannot make a socket pair for a gRPC connection: ") + std::strerror(error);
    // Out of descriptors is the listener's to report (readiness) and wait out.
    if (error == EMFILE || error == ENFILE) return ResourceExhausted(why);
    return Unavailable(why);
  }
  if (stopped_.load()) {
    close(client_fd);
    close(pair[0]);
    close(pair[1]);
    return Unavailable("the daemon is stopping");
  }
  asio::post(io_,
             [this, client_fd, ours = pair[0], pid, uid, closed = std::move(closed)]() mutable {
               if (stopping_) {  // posted before Stop, run after it
                 close(client_fd);
                 close(ours);
                 return;
               }
               auto& budget = budgets_[uid];
               if (budget == nullptr) budget = std::make_shared<H2Budget>(limits_, Clock::now());
               auto c = std::make_shared<Connection>(this, client_fd, ours, pid, uid, budget,
                                                     std::move(closed));
               connections_.insert(c);
               c->Pump();
             });
  return pair[1];
}

void EdgeRelay::OnViolation(const Connection& c) {
  const H2Violation v = c.guard().violation();
  MO_LOG_WARN_LIMITED("gRPC connection of pid %d uid %u closed (%s): %s", c.pid(), c.uid(),
                      H2ViolationName(v), c.guard().Message().c_str());
}

void EdgeRelay::Tick() {
  tick_.expires_after(kTickEvery);
  tick_.async_wait([this](error_code ec) {
    if (ec || stopping_) return;
    const auto now = Clock::now();
    auto all = connections_;
    for (const auto& c : all) c->Check(now);
    for (auto it = budgets_.begin(); it != budgets_.end();) {
      const H2Budget& b = *it->second;
      const bool idle = it->second.use_count() == 1 && now - b.resets.last > kBudgetIdle;
      it = idle ? budgets_.erase(it) : std::next(it);
    }
    Tick();
  });
}

void EdgeRelay::TrimSoon() {
  if (stopping_) return;
  // Twice: soon, and once more a second later, for calls gRPC ends late.
  trims_wanted_ = 2;
  if (trim_pending_) return;
  trim_pending_ = true;
  trim_.expires_after(kTrimAfter);
  trim_.async_wait([this](error_code ec) { OnTrimTimer(ec); });
}

void EdgeRelay::OnTrimTimer(error_code ec) {
  if (ec || stopping_ || trims_wanted_ == 0) {
    trim_pending_ = false;
    return;
  }
  --trims_wanted_;
  malloc_trim(0);
  trim_.expires_after(kTrimEvery);
  trim_.async_wait([this](error_code again) { OnTrimTimer(again); });
}

}  // namespace memoffload::daemon
