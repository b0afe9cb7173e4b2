// Checkpoint regions against the real daemon: a region survives its writer's
// crash once committed and never reads as complete before; checksums catch a
// changed byte; another uid cannot reach it; a uid's limits count all its
// job ids; memoffloadctl lists and deletes regions; the metrics show them.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "memoffload/client/admin.h"
#include "memoffload/client/client.h"
#include "memoffload/client/verified_read.h"

namespace memoffload::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

std::unique_ptr<client::Client> Attach(const DaemonProcess& d, const std::string& job) {
  client::AttachOptions options;
  options.runtime_dir = d.runtime_dir();
  options.job_id = job;
  auto c = client::Client::Attach(options);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

std::string Worker(const std::vector<std::string>& args, int* code) {
  std::vector<std::string> argv = {BinDir() + "/region_worker"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::string out;
  *code = RunCapture(argv, &out);
  return out;
}

TEST(Regions, AWriterKilledBeforeItsCommitLeavesNothingAndACommittedRegionOutlivesItsWriter) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string dir = daemon->runtime_dir();
  const std::string size = std::to_string(3 * kMiB + 123);
  int code = 0;
  // SIGKILL after every byte is written, before the commit.
  std::string out = Worker({"write", dir, "train", "dcp/1/__0_0.distcp", size, "kill"}, &code);
  EXPECT_EQ(out, "WRITTEN\n");
  EXPECT_EQ(code, -1);  // killed by a signal
  out = Worker({"read", dir, "train", "dcp/1/__0_0.distcp", size}, &code);
  EXPECT_EQ(out.rfind("ERR NOT_FOUND", 0), 0u) << out;
  // The daemon freed it with the writer's session.
  for (int i = 0; i < 100 && daemon->Status().region_bytes() != 0; ++i) usleep(20000);
  EXPECT_EQ(daemon->Status().region_bytes(), 0u);
  // Its session's log line counts the region it freed (3 MiB + 123 bytes
  // in 4 KiB pages), not "reclaimed 0 bytes" alone.
  const std::string freed = "reclaimed 0 bytes and " + std::to_string(3 * kMiB + 4096) +
                            " bytes of 1 region (left unfinished";
  for (int i = 0; i < 100 && daemon->Log().find(freed) == std::string::npos; ++i) usleep(20000);
  EXPECT_NE(daemon->Log().find(freed), std::string::npos) << daemon->Log();

  out = Worker({"write", dir, "train", "dcp/2/__0_0.distcp", size, "commit"}, &code);
  ASSERT_EQ(code, 0) << out;
  // The writer is gone; a new process of the job reads every byte back,
  // checksums verified.
  out = Worker({"read", dir, "train", "dcp/2/__0_0.distcp", size}, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(out, "OK\n");
  EXPECT_EQ(daemon->Status().regions(), 1u);
  // Another job of the same uid does not see it.
  out = Worker({"read", dir, "eval", "dcp/2/__0_0.distcp", size}, &code);
  EXPECT_EQ(out.rfind("ERR NOT_FOUND", 0), 0u) << out;
}

TEST(Regions, AChangedByteIsDataLossNamingTheRegion) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  int code = 0;
  std::string out = Worker(
      {"write", daemon->runtime_dir(), "train", "ckpt", std::to_string(kMiB), "commit"}, &code);
  ASSERT_EQ(code, 0) << out;
  auto c = Attach(*daemon, "train");
  ASSERT_NE(c, nullptr);
  auto p = c->OpenRegion("ckpt");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  uint8_t* at = c->Address(p->extents[0]);
  ASSERT_NE(at, nullptr);
  at[4242] ^= 0x20;  // what a stray write through a mapping would do
  ASSERT_TRUE(c->CloseRegion("ckpt").ok());
  auto again = c->OpenRegion("ckpt");
  EXPECT_EQ(again.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(again.status().message().find("region ckpt"), std::string::npos)
      << again.status().ToString();
  // The refused open was closed again: the region can be deleted and freed.
  auto freed = c->DeleteRegion("ckpt");
  ASSERT_TRUE(freed.ok()) << freed.status().ToString();
  EXPECT_EQ(*freed, kMiB);
}

TEST(Regions, AVerifiedReadChecksAsItCopiesInOrderAndTheRestAtTheEnd) {
  std::string error;
  auto daemon = DaemonProcess::Start({}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const uint64_t size = 3 * kMiB + 123;
  int code = 0;
  std::string out = Worker(
      {"write", daemon->runtime_dir(), "train", "ckpt", std::to_string(size), "commit"}, &code);
  ASSERT_EQ(code, 0) << out;
  auto c = Attach(*daemon, "train");
  ASSERT_NE(c, nullptr);
  std::vector<uint8_t> all(size), piece(size);
  auto open = [&] {
    auto p = c->OpenRegion("ckpt", /*verify=*/false);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? *p : client::Placement{};
  };
  client::Placement placement = open();
  ASSERT_FALSE(placement.extent_crc32c.empty());
  ASSERT_TRUE(c->Read(placement.extents, 0, all.data(), size).ok());
  {
    // Front to back in uneven reads: checked as it goes, nothing left.
    client::VerifiedRead read(c.get(), "ckpt", placement);
    for (uint64_t at = 0; at < size;) {
      const uint64_t n = std::min<uint64_t>(size - at, 777777);
      ASSERT_TRUE(read.Read(at, piece.data() + at, n).ok());
      at += n;
    }
    EXPECT_EQ(piece, all);
    EXPECT_TRUE(read.VerifyRest().ok());
  }
  // One changed byte near the end.
  uint8_t* at = c->Address(placement.extents[0]);
  ASSERT_NE(at, nullptr);
  at[size - 5] ^= 0x01;
  {
    client::VerifiedRead read(c.get(), "ckpt", placement);
    ASSERT_TRUE(read.Read(0, piece.data(), kMiB).ok());
    const Status st = read.Read(kMiB, piece.data() + kMiB, size - kMiB);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
    EXPECT_NE(st.message().find("region ckpt"), std::string::npos) << st.ToString();
  }
  {
    // Out of order: the reads check nothing; VerifyRest finds it.
    client::VerifiedRead read(c.get(), "ckpt", placement);
    ASSERT_TRUE(read.Read(kMiB, piece.data(), kMiB).ok());
    ASSERT_TRUE(read.Read(0, piece.data(), 4096).ok());
    EXPECT_EQ(read.VerifyRest().code(), StatusCode::kDataLoss);
  }
  at[size - 5] ^= 0x01;
  {
    client::VerifiedRead read(c.get(), "ckpt", placement);
    ASSERT_TRUE(read.Read(kMiB, piece.data(), kMiB).ok());
    EXPECT_TRUE(read.VerifyRest().ok());
  }
  ASSERT_TRUE(c->CloseRegion("ckpt").ok());
}

TEST(Regions, AnotherUidNeitherReadsNorListsNorDeletesARegion) {
  std::string error;
  auto daemon = DaemonProcess::Start(TwoTenantOptions("256MiB", "64MiB"), &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string dir = daemon->runtime_dir();
  int code = 0;
  std::string out = Worker({"write", dir, "train", "ckpt", "65536", "commit"}, &code);
  ASSERT_EQ(code, 0) << out;
  // uid 65534 naming the same job id reaches its own (empty) namespace.
  const std::vector<std::string> as_other = {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534",
                                             "--clear-groups"};
  std::vector<std::string> argv = as_other;
  argv.insert(argv.end(), {BinDir() + "/region_worker", "read", dir, "train", "ckpt", "65536"});
  ASSERT_EQ(RunCapture(argv, &out), 1) << out;
  EXPECT_EQ(out.rfind("ERR NOT_FOUND", 0), 0u) << out;
  // Nor can it delete it as an operator: the admin token is root's.
  argv = as_other;
  argv.insert(argv.end(), {BinDir() + "/memoffloadctl", "--runtime-dir", dir, "delete-region", "0",
                           "train", "ckpt"});
  EXPECT_EQ(RunCapture(argv, &out), 4) << out;
  out = Worker({"read", dir, "train", "ckpt", "65536"}, &code);
  EXPECT_EQ(out, "OK\n");
}

// A uid names as many job ids as it likes; regions.uid_max_bytes and
// regions.max_per_uid bound its regions over all of them, and the refusal
// reaches the client with its code and the setting's name. Another uid
// keeps its room.
TEST(Regions, AUidsLimitsCountEveryJobItNamesAndLeaveAnotherUidItsRoom) {
  std::string error;
  DaemonProcess::Options options = TwoTenantOptions("256MiB", "64MiB");
  options.extra_args.push_back("--regions-uid-max-bytes=4MiB");
  options.extra_args.push_back("--regions-max-per-uid=2");
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string dir = daemon->runtime_dir();
  const std::string three_mib = std::to_string(3 * kMiB);
  int code = 0;
  std::string out = Worker({"write", dir, "a", "ckpt", three_mib, "commit"}, &code);
  ASSERT_EQ(code, 0) << out;
  out = Worker({"write", dir, "b", "ckpt", three_mib, "commit"}, &code);
  EXPECT_EQ(out.rfind("ERR RESOURCE_EXHAUSTED", 0), 0u) << out;
  EXPECT_NE(out.find("regions.uid_max_bytes"), std::string::npos) << out;
  // uid 65534 has its own allowance.
  std::vector<std::string> argv = {"/usr/bin/setpriv",
                                   "--reuid=65534",
                                   "--regid=65534",
                                   "--clear-groups",
                                   BinDir() + "/region_worker",
                                   "write",
                                   dir,
                                   "a",
                                   "ckpt",
                                   three_mib,
                                   "commit"};
  ASSERT_EQ(RunCapture(argv, &out), 0) << out;
  EXPECT_EQ(out, "OK\n");
  out = Worker({"write", dir, "b", "small", "65536", "commit"}, &code);
  ASSERT_EQ(code, 0) << out;
  out = Worker({"write", dir, "c", "tiny", "4096", "commit"}, &code);
  EXPECT_EQ(out.rfind("ERR RESOURCE_EXHAUSTED", 0), 0u) << out;
  EXPECT_NE(out.find("regions.max_per_uid"), std::string::npos) << out;
  EXPECT_EQ(daemon->Status().regions(), 3u);
}

// Issue 29: with the per-uid limits off by default, one uid took every
// region slot of the node (under many job ids) and every other uid's
// CreateRegion was RESOURCE_EXHAUSTED until the TTL. By default a uid now
// gets an eighth of regions.max_count and half of regions.max_bytes, and
// the refusal names the limit and how to raise it.
TEST(Regions, PerUidLimitsAreOnByDefaultSoOneUidCannotTakeEveryRegionSlot) {
  std::string error;
  // 256 MiB arena: regions.max_bytes defaults to 128 MiB, so a uid gets
  // 64 MiB; with 16 regions on the node a uid gets 2.
  DaemonProcess::Options options = TwoTenantOptions("256MiB", "64MiB");
  options.extra_args.push_back("--regions-max-count=16");
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  std::vector<std::unique_ptr<client::Client>> jobs;
  auto create = [&](const std::string& job, uint64_t size) {
    jobs.push_back(Attach(*daemon, job));
    if (jobs.back() == nullptr) return Status(StatusCode::kInternal, "no attach");
    auto r = jobs.back()->CreateRegion("ckpt", size);
    return r.ok() ? jobs.back()->CommitRegion("ckpt", size).status() : r.status();
  };
  ASSERT_TRUE(create("j0", 60 * kMiB).ok());
  const Status over_bytes = create("j1", 8 * kMiB);
  EXPECT_EQ(over_bytes.code(), StatusCode::kResourceExhausted) << over_bytes.ToString();
  EXPECT_NE(over_bytes.message().find("raise regions.uid_max_bytes"), std::string::npos)
      << over_bytes.message();
  // As the hostile uid did: one region per job id until refused.
  int created = 1;
  Status refused;
  for (int i = 2; i < 20 && refused.ok(); ++i) {
    refused = create("j" + std::to_string(i), 4096);
    if (refused.ok()) ++created;
  }
  EXPECT_EQ(created, 2);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  EXPECT_NE(refused.message().find("raise regions.max_per_uid"), std::string::npos)
      << refused.message();
  // Another uid keeps its room, in count and in bytes.
  std::string out;
  ASSERT_EQ(RunCapture({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        BinDir() + "/region_worker", "write", daemon->runtime_dir(), "a", "ckpt",
                        std::to_string(32 * kMiB), "commit"},
                       &out),
            0)
      << out;
  EXPECT_EQ(out, "OK\n");
}

// Issue 38: regions.uid_max_bytes counted bytes, while a region keeps its
// whole chunk from other tenants. One uid that committed four 4 KiB regions,
// each alone in a chunk (one job id each, tenant = job), then went away,
// held the node's whole region-chunk budget (128 MiB) until the TTL: every
// other uid's CreateRegion was RESOURCE_EXHAUSTED. The chunks a uid's
// regions pin now count toward its share too, and the refusal names it.
TEST(Regions, OneUidsTinyRegionsInChunksOfTheirOwnLeaveRoomForAnotherUid) {
  std::string error;
  // 256 MiB in 32 MiB chunks: regions pin at most 128 MiB (4 chunks), a uid
  // by default half of that (2 chunks).
  DaemonProcess::Options options = TwoTenantOptions("256MiB", "32MiB");
  options.extra_args.push_back("--tenant=job");
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  std::vector<Status> tiny;
  for (int i = 0; i < 4; ++i) {
    auto job = Attach(*daemon, "tiny-" + std::to_string(i));
    ASSERT_NE(job, nullptr);
    auto r = job->CreateRegion("ckpt", 4096);
    tiny.push_back(r.ok() ? job->CommitRegion("ckpt", 4096).status() : r.status());
  }  // their sessions end; the committed regions stay, each in its chunk
  EXPECT_TRUE(tiny[0].ok()) << tiny[0].ToString();
  EXPECT_TRUE(tiny[1].ok()) << tiny[1].ToString();
  for (int i = 2; i < 4; ++i) {
    EXPECT_EQ(tiny[i].code(), StatusCode::kResourceExhausted) << i << ": " << tiny[i].ToString();
    EXPECT_NE(tiny[i].message().find("uid 0's regions would keep 96.00 MiB of chunks"),
              std::string::npos)
        << tiny[i].message();
    EXPECT_NE(tiny[i].message().find("(regions.uid_max_bytes,"), std::string::npos)
        << tiny[i].message();
  }
  // Another uid's checkpoint (two chunks' worth, in two jobs) still fits.
  for (const char* job : {"a", "b"}) {
    std::string out;
    EXPECT_EQ(RunCapture({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          BinDir() + "/region_worker", "write", daemon->runtime_dir(), job, "ckpt",
                          std::to_string(24 * kMiB), "commit"},
                         &out),
              0)
        << job << ": " << out;
    EXPECT_EQ(out, "OK\n") << job;
  }
}

// Issue 38's review: a uid's first region was exempt from the per-uid chunk
// cap whatever it pinned. A uid that left a 4 KiB hole in each of four
// chunks (reserves of a chunk less a page) and then created a 16 KiB region
// had it scattered over all four: the node's whole region-chunk budget,
// kept after it released the reserves. The first region may now pin only
// what its size needs at best (its chunks and one it straddles).
TEST(Regions, AFirstRegionScatteredOverManyChunksIsBoundedByTheUidsShare) {
  std::string error;
  auto daemon = DaemonProcess::Start(TwoTenantOptions("256MiB", "32MiB"), &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto holder = Attach(*daemon, "frag");
  ASSERT_NE(holder, nullptr);
  client::ReserveOptions whole;
  whole.single_extent = true;
  for (uint64_t g = 1; g <= 4; ++g) {
    auto r = holder->Reserve(g, 32 * kMiB - 4096, whole);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  auto scattered = holder->CreateRegion("ckpt", 4 * 4096);
  EXPECT_EQ(scattered.status().code(), StatusCode::kResourceExhausted)
      << scattered.status().ToString();
  EXPECT_NE(scattered.status().message().find("(regions.uid_max_bytes,"), std::string::npos)
      << scattered.status().message();
  for (uint64_t g = 1; g <= 4; ++g) ASSERT_TRUE(holder->Release(g).ok());
  // With the reserves gone the same region fits in one chunk.
  ASSERT_TRUE(holder->CreateRegion("ckpt", 4 * 4096).ok());
  ASSERT_TRUE(holder->CommitRegion("ckpt", 4 * 4096).ok());
  holder.reset();
  for (const char* job : {"a", "b"}) {  // another uid keeps its share
    std::string out;
    EXPECT_EQ(RunCapture({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          BinDir() + "/region_worker", "write", daemon->runtime_dir(), job, "ckpt",
                          std::to_string(24 * kMiB), "commit"},
                         &out),
              0)
        << job << ": " << out;
  }
}

TEST(Regions, MemoffloadctlListsAndDeletesRegionsAndTheMetricsShowThem) {
  std::string error;
  DaemonProcess::Options options;
  options.metrics_address = "127.0.0.1:0";
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  const std::string dir = daemon->runtime_dir();
  int code = 0;
  std::string out = Worker({"write", dir, "train", "dcp/7/.metadata", "5000", "commit"}, &code);
  ASSERT_EQ(code, 0) << out;
  auto writer = Attach(*daemon, "train");
  ASSERT_NE(writer, nullptr);
  ASSERT_TRUE(writer->CreateRegion("dcp/8/__0_0.distcp", 2 * kMiB).ok());

  ASSERT_EQ(RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", dir, "regions"}, &out), 0);
  EXPECT_NE(out.find("dcp/7/.metadata"), std::string::npos) << out;
  EXPECT_NE(out.find("committed"), std::string::npos) << out;
  EXPECT_NE(out.find("dcp/8/__0_0.distcp"), std::string::npos) << out;
  EXPECT_NE(out.find("writing"), std::string::npos) << out;
  ASSERT_EQ(
      RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", dir, "regions", "dcp/7"}, &out), 0);
  EXPECT_EQ(out.find("dcp/8"), std::string::npos) << out;
  ASSERT_EQ(RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", dir, "status"}, &out), 0);
  EXPECT_NE(out.find("regions"), std::string::npos) << out;

  const std::string addr = daemon->Status().metrics_address();
  const int port = std::stoi(addr.substr(addr.rfind(':') + 1));
  std::string metrics = HttpGet(port, "/metrics");
  EXPECT_NE(metrics.find("memoffload_regions{state=\"committed\"} 1"), std::string::npos);
  EXPECT_NE(metrics.find("memoffload_regions{state=\"writing\"} 1"), std::string::npos);
  EXPECT_NE(metrics.find("memoffload_region_bytes{state=\"committed\"} 8192"), std::string::npos);
  EXPECT_NE(metrics.find("memoffload_region_bytes{state=\"writing\"} 2097152"), std::string::npos);
  EXPECT_NE(metrics.find("memoffload_requests_total{code=\"OK\",method=\"CreateRegion\"} 2"),
            std::string::npos)
      << metrics.substr(0, 4000);

  // The operator's delete: a region being written is refused, a committed one goes.
  const std::string uid = std::to_string(getuid());
  EXPECT_EQ(RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", dir, "delete-region", uid,
                        "train", "dcp/8/__0_0.distcp"},
                       &out),
            1);
  ASSERT_EQ(RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", dir, "delete-region", uid,
                        "train", "dcp/7/.metadata"},
                       &out),
            0)
      << out;
  EXPECT_NE(out.find("8.00 KiB freed"), std::string::npos) << out;
  EXPECT_EQ(RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", dir, "delete-region", uid,
                        "train", "dcp/7/.metadata"},
                       &out),
            1);
  EXPECT_EQ(RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", dir, "delete-region", "x",
                        "train", "dcp/7/.metadata"},
                       &out),
            2);
  metrics = HttpGet(port, "/metrics");
  EXPECT_NE(metrics.find("memoffload_regions{state=\"committed\"} 0"), std::string::npos);
}

TEST(Regions, TheNodeListingStopsAt512RegionsAndSaysHowManyMoreThereAre) {
  std::string error;
  DaemonProcess::Options options;
  options.extra_args = {"--regions-max-per-job=8192"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto c = Attach(*daemon, "train");
  ASSERT_NE(c, nullptr);
  const std::string longest(240, 'n');
  for (int i = 0; i < 1500; ++i) {
    const std::string name = longest + std::to_string(10000 + i);
    ASSERT_TRUE(c->CreateRegion(name, 1).ok()) << i;
    ASSERT_TRUE(c->CommitRegion(name, 0).ok()) << i;
  }
  std::string out;
  ASSERT_EQ(
      RunCapture({BinDir() + "/memoffloadctl", "--runtime-dir", daemon->runtime_dir(), "regions"},
                 &out),
      0);
  EXPECT_NE(out.find("(988 more not listed"), std::string::npos) << out.substr(out.size() - 300);
  auto admin = client::AdminClient::Connect(daemon->runtime_dir());
  ASSERT_TRUE(admin.ok());
  auto listed = (*admin)->ListRegions();
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_EQ(listed->regions_size(), 512);
  EXPECT_EQ(listed->omitted(), 988u);
}

TEST(Regions, TheTtlDeletesACommittedRegion) {
  std::string error;
  DaemonProcess::Options options;
  options.extra_args = {"--regions-ttl=1s"};
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  auto c = Attach(*daemon, "train");
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->CreateRegion("ckpt", 4096, /*ttl_seconds=*/3600).ok());
  ASSERT_TRUE(c->CommitRegion("ckpt", 4096).ok());
  auto list = c->ListRegions();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_DOUBLE_EQ((*list)[0].ttl_seconds, 1.0);  // capped to regions.ttl
  for (int i = 0; i < 150 && daemon->Status().regions() != 0; ++i) usleep(20000);
  EXPECT_EQ(daemon->Status().regions(), 0u);
  EXPECT_EQ(c->OpenRegion("ckpt").status().code(), StatusCode::kNotFound);
  EXPECT_NE(daemon->Log().find("past its TTL"), std::string::npos) << daemon->Log();
}

TEST(Regions, SigtermDoesNotWaitForCheckpointRegionsAndSaysTheyEnd) {
  std::string error;
  DaemonProcess::Options options;
  options.drain_timeout = "20s";
  auto daemon = DaemonProcess::Start(options, &error);
  ASSERT_NE(daemon, nullptr) << error;
  int code = 0;
  std::string out = Worker(
      {"write", daemon->runtime_dir(), "train", "ckpt", std::to_string(4 * kMiB), "commit"}, &code);
  ASSERT_EQ(code, 0) << out;
  const auto start = std::chrono::steady_clock::now();
  kill(daemon->pid(), SIGTERM);
  const int status = daemon->Wait(15000);
  ASSERT_NE(status, -1) << "the drain waited for a committed region" << daemon->Log();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  // The bytes the drain waits for are the groups' (none), the region's apart.
  EXPECT_NE(daemon->Log().find("draining (0 sessions, 0 B held in groups; deadline 20000 ms; 1 "
                               "checkpoint region (4.00 MiB) not waited for)"),
            std::string::npos)
      << daemon->Log();
  EXPECT_NE(daemon->Log().find("drained: no groups held"), std::string::npos) << daemon->Log();
  EXPECT_NE(daemon->Log().find("1 checkpoint region (4.00 MiB) end with the daemon"),
            std::string::npos)
      << daemon->Log();
}

}  // namespace
}  // namespace memoffload::testing
