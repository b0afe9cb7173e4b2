// memoffload-bench pause-worker: one client of bench/takeover_pause_bench.py.
// Attaches, then cycles groups (reserve, write, commit with checksums; four
// in flight; prefetch, read back, compare, release) for a given time, each
// call timed. Across a take-over its calls wait and are sent again (the
// session resumes), so the longest call is the pause this client saw.
// Prints one line:
//   PAUSE <session id> <calls> <errors> <mismatches> <longest call, ms> <resumes>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "benches.h"
#include "memoffload/client/client.h"

namespace memoffload::bench {

int RunPauseWorker(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: memoffload-bench pause-worker DIR SECONDS INDEX\n");
    return 2;
  }
  client::AttachOptions attach;
  attach.runtime_dir = argv[1];
  attach.job_id = "pause";
  attach.rank = std::atoi(argv[3]);
  attach.checksums = true;
  auto attached = client::Client::Attach(attach);
  if (!attached.ok()) {
    std::fprintf(stderr, "pause-worker: %s\n", attached.status().ToString().c_str());
    return 1;
  }
  client::Client& c = **attached;
  const uint64_t session = c.session_id();
  constexpr uint64_t kBytes = 64 << 10;
  uint64_t calls = 0, errors = 0, mismatches = 0, next = 1;
  double longest_ms = 0;
  auto timed = [&](auto&& call) {
    const auto t0 = std::chrono::steady_clock::now();
    auto result = call();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    longest_ms = std::max(longest_ms, ms);
    ++calls;
    return result;
  };
  struct Live {
    uint64_t group;
    uint8_t fill;
  };
  std::deque<Live> live;
  std::vector<uint8_t> buf(kBytes), back(kBytes);
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(std::atof(argv[2]));
  while (std::chrono::steady_clock::now() < until) {
    const Live g{next++, static_cast<uint8_t>(next * 31 + attach.rank)};
    std::memset(buf.data(), g.fill, kBytes);
    auto r = timed([&] { return c.Reserve(g.group, kBytes); });
    Status st = r.ok() ? c.Write(r->extents, 0, buf.data(), kBytes) : r.status();
    if (st.ok()) st = timed([&] { return c.Commit(g.group, kBytes); }).status();
    if (!st.ok()) {
      if (errors++ == 0)
        std::fprintf(stderr, "pause-worker %d: %s\n", attach.rank, st.ToString().c_str());
      continue;
    }
    live.push_back(g);
    if (live.size() < 4) continue;
    const Live old = live.front();
    live.pop_front();
    auto p = timed([&] { return c.Prefetch(old.group); });
    st = p.ok() ? c.Read(p->extents, 0, back.data(), kBytes) : p.status();
    if (!st.ok()) {
      if (errors++ == 0)
        std::fprintf(stderr, "pause-worker %d: %s\n", attach.rank, st.ToString().c_str());
      continue;
    }
    for (uint8_t b : back) {
      if (b != old.fill) {
        ++mismatches;
        break;
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    st = c.Release(old.group);
    longest_ms = std::max(
        longest_ms,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    ++calls;
    if (!st.ok() && errors++ == 0) {
      std::fprintf(stderr, "pause-worker %d: %s\n", attach.rank, st.ToString().c_str());
    }
  }
  std::printf("PAUSE %lu %lu %lu %lu %.3f %lu\n", static_cast<unsigned long>(session),
              static_cast<unsigned long>(calls), static_cast<unsigned long>(errors),
              static_cast<unsigned long>(mismatches), longest_ms,
              static_cast<unsigned long>(c.resumes()));
  return 0;
}

}  // namespace memoffload::bench
