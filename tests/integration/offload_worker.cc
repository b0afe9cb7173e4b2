// offload_worker: a client process driven by the integration tests.
//
//   offload_worker verify RUNTIME_DIR SEED GROUPS MIN_BYTES MAX_BYTES
//     Offloads GROUPS groups of random size (log-uniform in [MIN, MAX]) with
//     random contents, two in flight at a time, reads each back after
//     Prefetch and compares every byte. Exit 0 when all matched.
//   offload_worker hold RUNTIME_DIR GROUPS BYTES
//     Reserves GROUPS groups of BYTES, writes them, commits every other one,
//     prints "HELD <total bytes>" and sleeps until killed.
//   offload_worker fork-hold RUNTIME_DIR BYTES
//     Reserves one group, forks a child that inherits the broker connection
//     and sleeps, prints "HELD <bytes> <child pid>" and sleeps until killed.
//   offload_worker tenant-probe RUNTIME_DIR UID BYTES
//     Drops to UID, asks for every chunk's fd, reserves BYTES and checks they
//     read as zeros. Prints "REFUSED <chunks> GOT <chunks> ZEROS <yes|no>".
//   offload_worker forge-probe RUNTIME_DIR UID SESSION GROUP...
//     Drops to UID, attaches over the raw broker protocol (to learn its own
//     token) and sends Prefetch, Release and Commit for each GROUP of
//     another tenant's SESSION twice: (a) with SESSION's id and its own token,
//     (b) with its own session and token. Prints one line per request,
//     "<method> <a|b> <group> <STATUS_CODE>".
//   offload_worker soak RUNTIME_DIR SEED SECONDS
//     Random reserve/write/commit/prefetch/read-and-verify/release cycles
//     with CRC32C checksums for SECONDS. RESOURCE_EXHAUSTED is expected under
//     contention; any other error or a mismatch exits 1. Prints
//     "DONE cycles=N verified=N exhausted=N".
//   offload_worker attach-as RUNTIME_DIR UID [GID]
//     Drops to UID (and its gid; GID, if given, as its one supplementary
//     group), attaches, reserves and releases one page; prints "OK" or
//     "ERR <CODE> <message>". Exit 0 on OK, 1 otherwise.
//   offload_worker job-as RUNTIME_DIR UID JOB BYTES JOB_MAX_BYTES
//     Drops to UID, attaches as job JOB asking for a JOB_MAX_BYTES job limit
//     (0: the default), asks for every chunk's fd and reserves BYTES. Prints
//     "RESERVED <bytes> REFUSED <chunks> GOT <chunks>" or "ERR <CODE> <message>".
//   offload_worker reserve-loop-as RUNTIME_DIR UID GO_FILE COUNT BYTES
//     Drops to UID, attaches, reserves one page (its tenant's first chunk)
//     and prints "READY"; once GO_FILE exists (20 s at most), makes COUNT
//     plain Reserve(BYTES) + Release pairs. Prints "OK <n> FAIL <n> <first
//     error>".
#include <grp.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "memoffload/client/client.h"
#include "memoffload/v1/memoffload.grpc.pb.h"
#include "raw_attach.h"

using memoffload::client::AttachOptions;
using memoffload::client::Client;

namespace {

int Die(const std::string& what, const memoffload::Status& st) {
  std::fprintf(stderr, "offload_worker: %s: %s\n", what.c_str(), st.ToString().c_str());
  return 1;
}

std::unique_ptr<Client> AttachOrNull(const std::string& dir, int rank) {
  AttachOptions options;
  options.runtime_dir = dir;
  options.job_id = "integration";
  options.rank = rank;
  auto c = Client::Attach(options);
  if (!c.ok()) {
    Die("attach", c.status());
    return nullptr;
  }
  return std::move(c).value();
}

struct Live {
  uint64_t group;
  std::vector<uint8_t> data;
};

int Verify(const std::string& dir, uint64_t seed, int groups, uint64_t min_bytes,
           uint64_t max_bytes) {
  auto client = AttachOrNull(dir, static_cast<int>(seed));
  if (!client) return 1;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log(static_cast<double>(min_bytes)),
                                                  std::log(static_cast<double>(max_bytes)));
  std::deque<Live> live;
  uint64_t total = 0;
  auto finish = [&](Live& g) -> int {
    auto p = client->Prefetch(g.group);
    if (!p.ok()) return Die("prefetch", p.status());
    if (p->used_bytes != g.data.size()) {
      std::fprintf(stderr, "used_bytes %lu != %zu\n", static_cast<unsigned long>(p->used_bytes),
                   g.data.size());
      return 1;
    }
    std::vector<uint8_t> back(g.data.size());
    if (auto st = client->Read(p->extents, 0, back.data(), back.size()); !st.ok()) {
      return Die("read", st);
    }
    if (back != g.data) {
      std::fprintf(stderr, "offload_worker: group %lu came back different\n",
                   static_cast<unsigned long>(g.group));
      return 1;
    }
    if (auto st = client->Release(g.group); !st.ok()) return Die("release", st);
    return 0;
  };
  for (int i = 0; i < groups; ++i) {
    const uint64_t size = static_cast<uint64_t>(std::exp(log_size(rng)));
    Live g{static_cast<uint64_t>(i) + 1, std::vector<uint8_t>(size)};
    for (size_t k = 0; k < size; k += 8) {
      const uint64_t v = rng();
      std::memcpy(g.data.data() + k, &v, std::min<size_t>(8, size - k));
    }
    // Reserve a little more than needed so Commit returns a tail.
    auto r = client->Reserve(g.group, size + 3 * 4096);
    if (!r.ok()) return Die("reserve " + std::to_string(size), r.status());
    if (auto st = client->Write(r->extents, 0, g.data.data(), size); !st.ok()) {
      return Die("write", st);
    }
    auto c = client->Commit(g.group, size);
    if (!c.ok()) return Die("commit", c.status());
    total += size;
    live.push_back(std::move(g));
    if (live.size() > 2) {
      if (finish(live.front()) != 0) return 1;
      live.pop_front();
    }
  }
  for (Live& g : live) {
    if (finish(g) != 0) return 1;
  }
  std::printf("verified %d groups, %lu bytes\n", groups, static_cast<unsigned long>(total));
  return 0;
}

int Hold(const std::string& dir, int groups, uint64_t bytes) {
  auto client = AttachOrNull(dir, 0);
  if (!client) return 1;
  std::vector<uint8_t> pattern(bytes, 0xab);
  uint64_t held = 0;
  for (int i = 0; i < groups; ++i) {
    auto r = client->Reserve(i + 1, bytes);
    if (!r.ok()) return Die("reserve", r.status());
    if (auto st = client->Write(r->extents, 0, pattern.data(), bytes); !st.ok()) {
      return Die("write", st);
    }
    if (i % 2 == 0) {
      auto c = client->Commit(i + 1, bytes);
      if (!c.ok()) return Die("commit", c.status());
    }
    held += r->reserved_bytes;
  }
  std::printf("HELD %lu\n", static_cast<unsigned long>(held));
  std::fflush(stdout);
  while (true) pause();
}

int ForkHold(const std::string& dir, uint64_t bytes) {
  auto client = AttachOrNull(dir, 0);
  if (!client) return 1;
  auto r = client->Reserve(1, bytes);
  if (!r.ok()) return Die("reserve", r.status());
  const pid_t child = fork();
  if (child == 0) {
    // Holds the inherited broker connection; touches nothing else.
    while (true) pause();
  }
  std::printf("HELD %lu %d\n", static_cast<unsigned long>(r->reserved_bytes), child);
  std::fflush(stdout);
  while (true) pause();
}

// Becomes uid (primary gid = uid), with `groups` as its supplementary groups.
bool DropTo(uid_t uid, const std::vector<gid_t>& groups = {}) {
  if (setgroups(groups.size(), groups.data()) != 0 || setgid(uid) != 0 || setuid(uid) != 0) {
    std::printf("ERR SETUID cannot drop to uid %u\n", uid);
    return false;
  }
  return true;
}

int TenantProbe(const std::string& dir, uid_t uid, uint64_t bytes) {
  if (!DropTo(uid)) return 1;
  auto client = AttachOrNull(dir, 0);
  if (!client) return 1;
  std::string refused, got;
  for (uint32_t c = 0; c < client->chunk_count(); ++c) {
    memoffload::Status st = client->MapChunks({c});
    if (st.code() == memoffload::StatusCode::kPermissionDenied) {
      refused += (refused.empty() ? "" : ",") + std::to_string(c);
    } else if (!st.ok()) {
      return Die("map chunk", st);
    }
  }
  auto r = client->Reserve(1, bytes);
  if (!r.ok()) return Die("reserve", r.status());
  std::vector<uint8_t> data(bytes);
  if (auto st = client->Read(r->extents, 0, data.data(), bytes); !st.ok()) return Die("read", st);
  bool zeros = true;
  for (uint8_t b : data) zeros = zeros && b == 0;
  for (const auto& e : r->extents) got += (got.empty() ? "" : ",") + std::to_string(e.chunk);
  std::printf("REFUSED %s GOT %s ZEROS %s\n", refused.empty() ? "-" : refused.c_str(), got.c_str(),
              zeros ? "yes" : "no");
  return 0;
}

int ForgeProbe(const std::string& dir, uid_t uid, uint64_t victim_session,
               const std::vector<uint64_t>& groups) {
  namespace v1 = memoffload::v1;
  if (!DropTo(uid)) return 1;
  int lifeline = -1;
  auto me = memoffload::testing::RawAttach(dir, "forger", &lifeline);
  if (!me.ok()) return Die("raw attach", me.status());
  auto stub = v1::Offload::NewStub(
      grpc::CreateChannel("unix:" + me->grpc_socket, grpc::InsecureChannelCredentials()));
  auto print = [](const char* method, const char* which, uint64_t group, const grpc::Status& st) {
    std::printf("%s %s %lu %s\n", method, which, static_cast<unsigned long>(group),
                memoffload::StatusCodeName(static_cast<memoffload::StatusCode>(st.error_code())));
  };
  for (uint64_t group : groups) {
    // (a) the victim's session id with our own (valid, but not its) token;
    // (b) our own session, naming the victim's group id.
    const std::pair<const char*, uint64_t> cases[] = {{"a", victim_session}, {"b", me->session_id}};
    for (const auto& [which, session] : cases) {
      {
        v1::PrefetchRequest req;
        req.mutable_session()->set_session_id(session);
        req.mutable_session()->set_session_token(me->session_token);
        req.set_group_id(group);
        v1::PrefetchResponse resp;
        grpc::ClientContext ctx;
        print("Prefetch", which, group, stub->Prefetch(&ctx, req, &resp));
      }
      {
        v1::CommitRequest req;
        req.mutable_session()->set_session_id(session);
        req.mutable_session()->set_session_token(me->session_token);
        req.set_group_id(group);
        req.set_used_bytes(0);
        v1::CommitResponse resp;
        grpc::ClientContext ctx;
        print("Commit", which, group, stub->Commit(&ctx, req, &resp));
      }
      {
        v1::ReleaseRequest req;
        req.mutable_session()->set_session_id(session);
        req.mutable_session()->set_session_token(me->session_token);
        req.set_group_id(group);
        v1::ReleaseResponse resp;
        grpc::ClientContext ctx;
        print("Release", which, group, stub->Release(&ctx, req, &resp));
      }
    }
  }
  std::fflush(stdout);
  close(lifeline);
  return 0;
}

int Soak(const std::string& dir, uint64_t seed, int seconds) {
  AttachOptions options;
  options.runtime_dir = dir;
  options.job_id = "soak";
  options.rank = static_cast<int>(seed % 1000);
  options.checksums = true;
  auto c = Client::Attach(options);
  if (!c.ok()) return Die("attach", c.status());
  Client& client = **c;
  std::mt19937_64 rng(seed);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  uint64_t cycles = 0, verified = 0, exhausted = 0;
  std::vector<uint8_t> data, back;
  for (uint64_t group = 1; std::chrono::steady_clock::now() < deadline; ++group) {
    const uint64_t size = 4096 + rng() % (8 << 20);
    data.resize(size);
    for (size_t k = 0; k + 8 <= size; k += 8) {
      const uint64_t v = rng();
      std::memcpy(data.data() + k, &v, 8);
    }
    auto r = client.Reserve(group, size);
    if (!r.ok()) {
      if (r.status().code() == memoffload::StatusCode::kResourceExhausted) {
        ++exhausted;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
      return Die("reserve", r.status());
    }
    if (auto st = client.Write(r->extents, 0, data.data(), size); !st.ok()) {
      return Die("write", st);
    }
    if (auto cm = client.Commit(group, size); !cm.ok()) return Die("commit", cm.status());
    auto p = client.Prefetch(group);
    if (!p.ok()) return Die("prefetch", p.status());
    back.resize(size);
    if (auto st = client.Read(p->extents, 0, back.data(), size); !st.ok()) {
      return Die("read", st);
    }
    if (back != data || p->extent_crc32c.empty()) {
      std::fprintf(stderr, "offload_worker: soak group %lu came back different\n",
                   static_cast<unsigned long>(group));
      return 1;
    }
    ++verified;
    if (auto st = client.Release(group); !st.ok()) return Die("release", st);
    ++cycles;
  }
  std::printf("DONE cycles=%lu verified=%lu exhausted=%lu\n", static_cast<unsigned long>(cycles),
              static_cast<unsigned long>(verified), static_cast<unsigned long>(exhausted));
  return 0;
}

int AttachAs(const std::string& dir, uid_t uid, const std::vector<gid_t>& groups) {
  if (!DropTo(uid, groups)) return 1;
  AttachOptions options;
  options.runtime_dir = dir;
  options.job_id = "other-user";
  auto c = Client::Attach(options);
  if (!c.ok()) {
    std::printf("ERR %s %s\n", memoffload::StatusCodeName(c.status().code()),
                c.status().message().c_str());
    return 1;
  }
  auto r = (*c)->Reserve(1, 4096);
  if (!r.ok()) {
    std::printf("ERR %s %s\n", memoffload::StatusCodeName(r.status().code()),
                r.status().message().c_str());
    return 1;
  }
  if (auto st = (*c)->Release(1); !st.ok()) {
    std::printf("ERR %s %s\n", memoffload::StatusCodeName(st.code()), st.message().c_str());
    return 1;
  }
  std::printf("OK\n");
  return 0;
}

int JobAs(const std::string& dir, uid_t uid, const std::string& job, uint64_t bytes,
          uint64_t job_max_bytes) {
  if (!DropTo(uid)) return 1;
  AttachOptions options;
  options.runtime_dir = dir;
  options.job_id = job;
  options.job_max_bytes = job_max_bytes;
  auto c = Client::Attach(options);
  auto fail = [](const memoffload::Status& st) {
    std::printf("ERR %s %s\n", memoffload::StatusCodeName(st.code()), st.message().c_str());
    return 1;
  };
  if (!c.ok()) return fail(c.status());
  std::string refused, got;
  for (uint32_t chunk = 0; chunk < (*c)->chunk_count(); ++chunk) {
    memoffload::Status st = (*c)->MapChunks({chunk});
    if (st.code() == memoffload::StatusCode::kPermissionDenied) {
      refused += (refused.empty() ? "" : ",") + std::to_string(chunk);
    } else if (!st.ok()) {
      return fail(st);
    }
  }
  auto r = (*c)->Reserve(1, bytes);
  if (!r.ok()) return fail(r.status());
  for (const auto& e : r->extents) got += (got.empty() ? "" : ",") + std::to_string(e.chunk);
  std::printf("RESERVED %lu REFUSED %s GOT %s\n", static_cast<unsigned long>(r->reserved_bytes),
              refused.empty() ? "-" : refused.c_str(), got.c_str());
  return 0;
}

int ReserveLoopAs(const std::string& dir, uid_t uid, const std::string& go_file, int count,
                  uint64_t bytes) {
  if (!DropTo(uid)) return 1;
  auto client = AttachOrNull(dir, 0);
  if (!client) return 1;
  auto first = client->Reserve(1, 4096);
  if (!first.ok()) return Die("first reserve", first.status());
  std::printf("READY\n");
  std::fflush(stdout);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (access(go_file.c_str(), F_OK) != 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::printf("ERR no %s after 20 s\n", go_file.c_str());
      return 1;
    }
    usleep(1000);
  }
  int ok = 0, failed = 0;
  std::string first_error = "-";
  for (int i = 0; i < count; ++i) {
    auto r = client->Reserve(2, bytes);
    if (r.ok()) {
      ++ok;
      if (auto st = client->Release(2); !st.ok()) return Die("release", st);
    } else {
      if (failed++ == 0) {
        first_error =
            std::string(memoffload::StatusCodeName(r.status().code())) + " " + r.status().message();
      }
    }
  }
  std::printf("OK %d FAIL %d %s\n", ok, failed, first_error.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 7 && std::strcmp(argv[1], "reserve-loop-as") == 0) {
    return ReserveLoopAs(argv[2], static_cast<uid_t>(std::stoul(argv[3])), argv[4],
                         std::stoi(argv[5]), std::stoull(argv[6]));
  }
  if (argc == 4 && std::strcmp(argv[1], "fork-hold") == 0) {
    return ForkHold(argv[2], std::stoull(argv[3]));
  }
  if (argc == 5 && std::strcmp(argv[1], "soak") == 0) {
    return Soak(argv[2], std::stoull(argv[3]), std::stoi(argv[4]));
  }
  if (argc == 5 && std::strcmp(argv[1], "tenant-probe") == 0) {
    return TenantProbe(argv[2], static_cast<uid_t>(std::stoul(argv[3])), std::stoull(argv[4]));
  }
  if (argc >= 6 && std::strcmp(argv[1], "forge-probe") == 0) {
    std::vector<uint64_t> groups;
    for (int i = 5; i < argc; ++i) groups.push_back(std::stoull(argv[i]));
    return ForgeProbe(argv[2], static_cast<uid_t>(std::stoul(argv[3])), std::stoull(argv[4]),
                      groups);
  }
  if (argc == 7 && std::strcmp(argv[1], "job-as") == 0) {
    return JobAs(argv[2], static_cast<uid_t>(std::stoul(argv[3])), argv[4], std::stoull(argv[5]),
                 std::stoull(argv[6]));
  }
  if ((argc == 4 || argc == 5) && std::strcmp(argv[1], "attach-as") == 0) {
    std::vector<gid_t> groups;
    if (argc == 5) groups.push_back(static_cast<gid_t>(std::stoul(argv[4])));
    return AttachAs(argv[2], static_cast<uid_t>(std::stoul(argv[3])), groups);
  }

  if (argc == 7 && std::strcmp(argv[1], "verify") == 0) {
    return Verify(argv[2], std::stoull(argv[3]), std::stoi(argv[4]), std::stoull(argv[5]),
                  std::stoull(argv[6]));
  }
  if (argc == 5 && std::strcmp(argv[1], "hold") == 0) {
    return Hold(argv[2], std::stoi(argv[3]), std::stoull(argv[4]));
  }
  std::fprintf(stderr, "usage: offload_worker verify DIR SEED GROUPS MIN MAX | hold DIR N BYTES\n");
  return 2;
}
