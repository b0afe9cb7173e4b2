// LoadState and what it needs: reading what a store kept (state_store.h).
#include <absl/strings/match.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "app/state_names.h"
#include "app/state_store.h"
#include "base/log.h"
#include "memoffload/common/crc32c.h"
#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

// How long lifecycle.state_store = "keeper" waits for the keeper's socket.
constexpr std::chrono::seconds kKeeperWait{10};

// A read-only view of a kept memfd.
struct Mapped {
  explicit Mapped(int fd) {
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_size <= 0) return;
    size = static_cast<size_t>(st.st_size);
    void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    data = p == MAP_FAILED ? nullptr : p;
  }
  ~Mapped() {
    if (data != nullptr) munmap(data, size);
  }
  void* data = nullptr;
  size_t size = 0;
};

uint64_t NameSeq(const std::string& name, const char* prefix) {
  return std::strtoull(name.c_str() + std::strlen(prefix), nullptr, 10);
}

// Newest first: the later record, and at the same record the one with sessions.
bool SnapshotNewer(const std::string& a, const std::string& b) {
  const uint64_t sa = NameSeq(a, kSnapshotPrefix), sb = NameSeq(b, kSnapshotPrefix);
  if (sa != sb) return sa > sb;
  return absl::EndsWith(a, kWithSessions) && !absl::EndsWith(b, kWithSessions);
}

Result<std::unique_ptr<FdStore>> OpenStore(const std::string& mode, const std::string& keeper) {
  const bool under_systemd = std::getenv("NOTIFY_SOCKET") != nullptr;
  if (mode == "none") return std::unique_ptr<FdStore>();
  if (mode == "systemd" || (mode == "auto" && under_systemd)) {
    if (!under_systemd) {
      return FailedPrecondition("lifecycle.state_store = systemd, but NOTIFY_SOCKET is not set");
    }
    return SystemdFdStore();
  }
  if (mode == "keeper") {
    // A keeper started beside the daemon (a pod's sidecar) may still be
    // coming up: wait for its socket a while.
    const auto until = std::chrono::steady_clock::now() + kKeeperWait;
    if (access(keeper.c_str(), F_OK) != 0) {
      MO_LOG_INFO("state store: waiting up to %lld s for the keeper at %s",
                  static_cast<long long>(kKeeperWait.count()), keeper.c_str());
    }
    while (access(keeper.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return ConnectKeeper(keeper);
  }
  if (mode == "auto" && access(keeper.c_str(), F_OK) == 0) return ConnectKeeper(keeper);
  return std::unique_ptr<FdStore>();
}

}  // namespace

std::string MemfdProblem(int fd, uint64_t size, int seals) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return "not a regular file";
  char link[64];
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(proc.c_str(), link, sizeof link - 1);
  if (n <= 0 || std::string(link, static_cast<size_t>(n)).rfind("/memfd:", 0) != 0) {
    return "not a memfd";
  }
  if (size != 0 && static_cast<uint64_t>(st.st_size) != size) {
    return "holds " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(size);
  }
  const bool hugetlb = IsHugetlbFd(fd);
  const int have = fcntl(fd, F_GET_SEALS);
  if (!hugetlb && (have < 0 || (have & seals) != seals)) return "lacks its seals";
  return "";
}

Result<int> SealedMemfd(const std::string& name, const std::string& bytes) {
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Unavailable(std::string("memfd_create: ") + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0 && errno != EINTR) {
      const int e = errno;
      close(fd);
      return Unavailable(std::string("writing ") + name + ": " + std::strerror(e));
    }
    if (n > 0) done += static_cast<size_t>(n);
  }
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
    const int e = errno;
    close(fd);
    return Unavailable(std::string("sealing ") + name + ": " + std::strerror(e));
  }
  return fd;
}

Result<SnapshotContents> DecodeSnapshotFd(int fd) {
  Mapped m(fd);
  if (m.data == nullptr) return DataLoss("cannot map the snapshot");
  return DecodeSnapshot(m.data, m.size);
}

void CloseChunkFds(StateLoad* load) {
  for (int& fd : load->chunk_fds) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
}

bool IsStateName(const std::string& name) {
  return absl::StartsWith(name, kSnapshotPrefix) || absl::StartsWith(name, kJournalPrefix);
}

// The newest record number the names of a store's state carry.
uint64_t NewestSeq(const std::vector<StoredFd>& fds) {
  uint64_t newest = 0;
  for (const StoredFd& f : fds) {
    newest = std::max({newest, NameSeq(f.name, kSnapshotPrefix), NameSeq(f.name, kJournalPrefix)});
  }
  return newest;
}

bool HasState(const std::vector<StoredFd>& fds) {
  return std::any_of(fds.begin(), fds.end(), [](const StoredFd& f) { return IsStateName(f.name); });
}

bool HasMark(const std::vector<StoredFd>& fds) {
  return std::any_of(fds.begin(), fds.end(),
                     [](const StoredFd& f) { return f.name == kHandedOverName; });
}

// Another pod's keeper beside `keeper_socket` (keeper*.sock in its dir, this
// uid's, mode 0600, live) that holds a node: an unmarked one before a
// marked one (whose node went to another daemon, which may have died before
// it kept it), the newest state first. Its fds in *fds; null when none.
std::unique_ptr<FdStore> SiblingWithState(const std::string& keeper_socket,
                                          std::vector<StoredFd>* fds, std::string* source,
                                          std::vector<std::string>* problems) {
  const std::string dir = keeper_socket.substr(0, keeper_socket.rfind('/'));
  std::vector<std::string> paths;
  if (DIR* d = opendir(dir.empty() ? "/" : dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      const std::string path = dir + "/" + name;
      if (absl::StartsWith(name, "keeper") && absl::EndsWith(name, ".sock") &&
          path != keeper_socket) {
        paths.push_back(path);
      }
    }
    closedir(d);
  }
  std::sort(paths.begin(), paths.end());
  std::unique_ptr<FdStore> best;
  std::pair<bool, uint64_t> best_rank{false, 0};  // (unmarked, newest record)
  for (const std::string& path : paths) {
    // A keeper that is gone left its socket: not one to take from.
    Result<std::unique_ptr<FdStore>> store = ConnectKeeper(path);
    if (!store.ok()) continue;
    Result<std::vector<StoredFd>> taken = (*store)->Take();
    if (!taken.ok()) {
      problems->push_back("the keeper at " + path + " was not read: " + taken.status().message());
      continue;
    }
    if (!HasState(*taken)) {
      CloseStored(&*taken);
      continue;
    }
    const std::pair<bool, uint64_t> rank{!HasMark(*taken), NewestSeq(*taken)};
    // A marked keeper's copy is stale beside another: only an unmarked one
    // left aside is worth a word.
    if (best != nullptr && rank <= best_rank) {
      if (rank.first)
        problems->push_back("the keeper at " + path + " holds a node no daemon serves too (state " +
                            "through record " + std::to_string(rank.second) + "); the one at " +
                            *source + " is taken");
      CloseStored(&*taken);
      continue;
    }
    if (best != nullptr && best_rank.first) {
      problems->push_back("the keeper at " + *source +
                          " holds a node no daemon serves too (state " + "through record " +
                          std::to_string(best_rank.second) + "); the one at " + path + " is taken");
    }
    CloseStored(fds);
    *fds = std::move(taken).value();
    *source = path;
    best_rank = rank;
    best = std::move(store).value();
  }
  return best;
}

Status MarkStoreHandedOver(FdStore* store, const std::string& why) {
  Result<int> sealed = SealedMemfd("memoffload-handed-over", why);
  if (!sealed.ok()) return sealed.status();
  Status st = store->Put(kHandedOverName, *sealed);
  close(*sealed);
  return st;
}

Result<bool> HoldsHandOverMark(const std::string& mode, const std::string& keeper_socket) {
  const bool under_systemd = std::getenv("NOTIFY_SOCKET") != nullptr;
  // systemd's store hands its fds over once; a take-over is refused there.
  if (mode == "systemd" || (mode == "auto" && under_systemd)) return false;
  Result<std::unique_ptr<FdStore>> store = OpenStore(mode, keeper_socket);
  if (!store.ok()) return store.status();
  if (*store == nullptr) return false;
  Result<std::vector<StoredFd>> taken = (*store)->Take();
  if (!taken.ok()) return taken.status();
  const bool marked = HasMark(*taken);
  CloseStored(&*taken);
  return marked;
}

Result<StateLoad> LoadState(const std::string& mode, const std::string& keeper_socket,
                            bool from_another_keeper) {
  StateLoad load;
  Result<std::unique_ptr<FdStore>> store = OpenStore(mode, keeper_socket);
  if (!store.ok()) return store.status();
  load.store = std::move(store).value();
  if (load.store == nullptr) return load;
  Result<std::vector<StoredFd>> taken = load.store->Take();
  if (!taken.ok()) return taken.status();
  std::vector<StoredFd> fds = std::move(taken).value();
  if (from_another_keeper && load.store->Kind() == "keeper" && !HasState(fds)) {
    std::string path;
    std::vector<StoredFd> theirs;
    std::unique_ptr<FdStore> source =
        SiblingWithState(keeper_socket, &theirs, &path, &load.problems);
    if (source != nullptr) {
      CloseStored(&fds);
      fds = std::move(theirs);
      load.source_path = path;
      // At once: that pod's daemon, started again meanwhile, stands by
      // rather than take the node back (LoadState's header).
      if (Status st = MarkStoreHandedOver(source.get(), "taken by pid " + std::to_string(getpid()));
          !st.ok()) {
        load.problems.push_back("the keeper at " + path + " was not marked as handed over (" +
                                st.message() + "): its daemon, started again, could serve its " +
                                "copy of the node");
      }
    }
  }
  // The snapshots, newest first; the first readable one is used.
  std::vector<StoredFd*> snapshots;
  std::vector<JournalContents> journals;
  std::map<uint32_t, StoredFd*> chunks;
  StoredFd* handed = nullptr;
  // The newest journal by name, and its daemon's generation (0: unreadable).
  uint64_t newest_journal = 0, newest_generation = 0;
  for (StoredFd& f : fds) {
    load.old_names.push_back(f.name);
    if (absl::StartsWith(f.name, kSnapshotPrefix)) {
      if (std::string why = MemfdProblem(f.fd, 0, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE);
          !why.empty()) {
        load.problems.push_back(f.name + " refused: " + why);
        continue;
      }
      snapshots.push_back(&f);
    } else if (absl::StartsWith(f.name, kJournalPrefix)) {
      const uint64_t seq = NameSeq(f.name, kJournalPrefix);
      const bool newest = seq >= newest_journal;
      if (newest) {
        newest_journal = seq;
        newest_generation = 0;  // until it reads
      }
      if (std::string why = MemfdProblem(f.fd, kJournalBytes, F_SEAL_SHRINK | F_SEAL_GROW);
          !why.empty()) {
        load.problems.push_back(f.name + " refused: " + why);
        continue;
      }
      Mapped m(f.fd);
      Result<JournalContents> j =
          m.data == nullptr ? DataLoss("cannot map it") : DecodeJournal(m.data, m.size);
      if (newest && j.ok()) newest_generation = j->generation;
      if (!j.ok()) {
        load.problems.push_back(f.name + ": " + j.status().message());
        load.refused |= j.status().code() == StatusCode::kFailedPrecondition;
        continue;
      }
      journals.push_back(std::move(j).value());
    } else if (absl::StartsWith(f.name, kChunkPrefix)) {
      const uint64_t index = std::strtoull(f.name.c_str() + std::strlen(kChunkPrefix), nullptr, 10);
      if (index < (1u << 20) && chunks.count(static_cast<uint32_t>(index)) == 0) {
        chunks[static_cast<uint32_t>(index)] = &f;
      }
    } else if (f.name == kHandedOverName) {
      // Read by HoldsHandOverMark; the store's own, not a problem.
    } else if (f.name == kHandedChunksName) {
      handed = &f;
    } else {
      load.problems.push_back("an fd named '" + f.name + "' is not the daemon's; closed");
    }
  }
  std::sort(snapshots.begin(), snapshots.end(),
            [](const StoredFd* a, const StoredFd* b) { return SnapshotNewer(a->name, b->name); });
  std::optional<SnapshotContents> snapshot;
  bool newest = true;
  for (StoredFd* f : snapshots) {
    Result<SnapshotContents> s = DecodeSnapshotFd(f->fd);
    if (s.ok()) {
      snapshot = std::move(s).value();
      // Sessions are kept for the very next start only: those of an older
      // snapshot than the newest (that one unreadable) are not the state
      // their processes left.
      if (!newest && !snapshot->sessions.empty()) {
        load.problems.push_back(f->name + ": its " + std::to_string(snapshot->sessions.size()) +
                                " sessions are not resumed (a newer snapshot was unreadable)");
        snapshot->sessions.clear();
        snapshot->owners.clear();
      }
      break;
    }
    newest = false;
    load.problems.push_back(f->name + ": " + s.status().message());
    load.refused |= s.status().code() == StatusCode::kFailedPrecondition;
  }
  load.state = Replay(snapshot ? &*snapshot : nullptr, journals);
  if (load.state.journal_records != 0 && !load.state.sessions.empty()) {
    // Written at the daemon's last exit, nothing after: a change recorded
    // since means a later daemon ran, and those processes moved on.
    load.problems.push_back(std::to_string(load.state.sessions.size()) +
                            " kept sessions are not resumed: the journal has changes after them");
    load.state.sessions.clear();
    load.state.owners.clear();
  }
  // The chunks the kept regions lie in, checked against the kept layout.
  const ArenaLayout& layout = load.state.layout;
  load.chunk_fds.assign(layout.chunk_count(), -1);
  // Sessions to resume map chunks that hold none of their groups too (every
  // chunk with tenant = none): each must stay the memory they map.
  std::vector<bool> needed(layout.chunk_count(), !load.state.sessions.empty());
  for (const auto& [key, region] : load.state.regions) {
    for (const Extent& e : region.extents) {
      if (e.chunk < needed.size()) needed[e.chunk] = true;
    }
  }
  if (handed != nullptr && load.state.found) {
    const std::string why = MemfdProblem(handed->fd, 0, F_SEAL_SHRINK | F_SEAL_GROW);
    // Marked: another daemon took this node and handed its chunks on.
    Result<std::vector<bool>> read =
        !why.empty() ? DataLoss(why)
        : HasMark(fds)
            ? FailedPrecondition("the store holds the hand-over mark: another daemon took the node")
            : ReadHandedChunks(handed->fd, layout.chunk_count(), newest_generation);
    // Another pod's: what this daemon hands out is in its own record only,
    // so no later start may believe that one (even if marking it failed).
    if (!load.source_path.empty()) {
      if (Status st = DisownHandedChunksFd(handed->fd); !st.ok()) {
        load.problems.push_back(std::string(kHandedChunksName) + " of " + load.source_path + ": " +
                                st.message());
      }
    }
    if (read.ok()) {
      load.handed = std::move(read).value();
    } else {
      load.problems.push_back(std::string(kHandedChunksName) + " not used (" +
                              read.status().message() +
                              "): every kept chunk with no region counts as handed out");
    }
  }
  // A chunk never handed out is kept as it is: nobody else maps it.
  for (size_t i = 0; i < load.handed.size() && i < needed.size(); ++i) {
    if (!load.handed[i]) needed[i] = true;
  }
  for (auto& [index, f] : chunks) {
    if (index >= needed.size() || !needed[index]) continue;
    const uint64_t size =
        std::min(layout.chunk_bytes, layout.capacity_bytes - index * layout.chunk_bytes);
    if (std::string why = MemfdProblem(f->fd, size, F_SEAL_SHRINK | F_SEAL_GROW); !why.empty()) {
      load.problems.push_back(f->name + " refused: " + why);
      continue;
    }
    load.chunk_fds[index] = std::exchange(f->fd, -1);
  }
  CloseStored(&fds);
  return load;
}

void VerifyRegions(const Arena& arena, int threads, std::vector<RegionRecord>* regions,
                   std::vector<std::string>* dropped, std::vector<std::string>* unverified) {
  std::vector<std::string> why(regions->size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < regions->size();) {
      const RegionRecord& r = (*regions)[i];
      uint64_t start = 0;
      for (size_t k = 0; k < r.extent_crc32c.size() && k < r.extents.size(); ++k) {
        const Extent& e = r.extents[k];
        if (e.chunk >= arena.chunk_count() || e.offset > arena.chunk_bytes(e.chunk) ||
            e.length > arena.chunk_bytes(e.chunk) - e.offset) {
          why[i] = "extent " + std::to_string(k) + " lies past its chunk";
          break;
        }
        const uint64_t used = std::min(e.length, r.used_bytes > start ? r.used_bytes - start : 0);
        const uint32_t crc = Crc32c(arena.chunk(e.chunk).data() + e.offset, used);
        if (crc != r.extent_crc32c[k]) {
          char buf[80];
          std::snprintf(buf, sizeof buf, "extent %zu fails its CRC32C (expected %08x, read %08x)",
                        k, r.extent_crc32c[k], crc);
          why[i] = buf;
          break;
        }
        start += e.length;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::max(threads, 1); ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  std::vector<RegionRecord> kept;
  for (size_t i = 0; i < regions->size(); ++i) {
    RegionRecord& r = (*regions)[i];
    const std::string what =
        "region " + r.name + " of job " + r.job_id + " (uid " + std::to_string(r.uid) + ")";
    if (!why[i].empty()) {
      dropped->push_back(what + ": " + why[i]);
      continue;
    }
    if (r.extent_crc32c.empty() && r.used_bytes > 0) unverified->push_back(what);
    kept.push_back(std::move(r));
  }
  *regions = std::move(kept);
}

}  // namespace memoffload::daemon
