#include "config/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <vector>

#include "memoffload/common/units.h"

namespace memoffload::daemon {
namespace {

Result<DaemonConfig> Parse(std::vector<const char*> args, std::vector<std::string> env = {}) {
  args.insert(args.begin(), "memoffloadd");
  return LoadConfig(static_cast<int>(args.size()), args.data(), env);
}

// A TOML file in a temp dir, removed with the object.
class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    char name[] = "/tmp/memoffload-config-XXXXXX";
    int fd = mkstemp(name);
    path_ = name;
    std::ofstream(path_) << text;
    close(fd);
  }
  ~TempFile() { unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(Config, FlagsInBothForms) {
  Result<DaemonConfig> c =
      Parse({"--arena-size=4GiB", "--chunk-size", "512MiB", "--runtime-dir", "/tmp/x",
             "--metrics-address=none", "--hugepages", "--prefault-threads=3", "--no-mlock"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->arena_size_bytes, 4 * kGiB);
  EXPECT_EQ(c->chunk_size_bytes, 512 * kMiB);
  EXPECT_EQ(c->runtime_dir, "/tmp/x");
  EXPECT_EQ(c->metrics_address, "");
  EXPECT_TRUE(c->hugepages);
  EXPECT_FALSE(c->mlock);
  EXPECT_EQ(c->prefault_threads, 3);
  EXPECT_EQ(c->sources["arena.size"], "flag");
  EXPECT_EQ(c->sources["quotas.job_max_bytes"], "default");
}

// --take-over alone is "always" (as before it had values); auto and the
// keeper's own socket are what a DaemonSet's surge pod runs with.
TEST(Config, TakeOverModesAndTheKeeperSocket) {
  Result<DaemonConfig> c = Parse({"--runtime-dir=/run/x"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->take_over, "never");
  EXPECT_EQ(c->after_handover, "exit");
  ASSERT_TRUE(ResolveAndValidate(&*c).ok());
  EXPECT_EQ(c->keeper_socket, "/run/x/keeper.sock");
  c = Parse({"--take-over", "--runtime-dir=/run/x"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->take_over, "always");
  EXPECT_EQ(c->runtime_dir, "/run/x");  // --take-over did not eat the next flag
  c = Parse({"--take-over=auto", "--after-handover=wait"},
            {"MEMOFFLOAD_KEEPER_SOCKET=/run/x/keeper-pod-1.sock"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->take_over, "auto");
  EXPECT_EQ(c->after_handover, "wait");
  ASSERT_TRUE(ResolveAndValidate(&*c).ok());
  EXPECT_EQ(c->keeper_socket, "/run/x/keeper-pod-1.sock");
  for (const auto& [args, needle] : std::vector<std::pair<std::vector<const char*>, std::string>>{
           {{"--take-over=yes"}, "'yes' is not one of never, always, auto"},
           {{"--after-handover=linger"}, "'linger' is not one of exit, wait"},
           {{"--keeper-socket=keeper.sock"}, "'keeper.sock' is not an absolute path"}}) {
    Result<DaemonConfig> bad = Parse(args);
    ASSERT_FALSE(bad.ok()) << needle;
    EXPECT_NE(bad.status().message().find(needle), std::string::npos) << bad.status().message();
  }
  c = Parse({std::string("--keeper-socket=/" + std::string(120, 'k')).c_str()});
  ASSERT_TRUE(c.ok());
  Status st = ResolveAndValidate(&*c);
  EXPECT_NE(st.message().find("too long for a Unix socket path"), std::string::npos)
      << st.ToString();
}

TEST(Config, ErrorsNameTheKey) {
  struct Case {
    std::vector<const char*> args;
    const char* needle;
  } cases[] = {
      {{"--arena-size=lots"}, "--arena-size"},
      {{"--bogus"}, "unknown flag '--bogus'"},
      {{"--arena-size"}, "needs a value"},
      {{"--help=yes"}, "takes no value"},
      {{"--prefault-threads=-2"}, "--prefault-threads"},
      {{"--metrics-address=9477"}, "HOST:PORT"},
      {{"--health-address=9478"}, "IP:PORT"},
      {{"--health-address=localhost:9478"}, "IP:PORT"},
      {{"--health-address=127.0.0.1:65536"}, "IP:PORT"},
      {{"--health-address=127.0.0.1:"}, "IP:PORT"},
      {{"--health-address=[::1:9478"}, "IP:PORT"},
      {{"--log-level=loud"}, "debug, info, warn, error"},
      {{"--socket-mode=999"}, "octal"},
      {{"--allowed-uids=1000,bob"}, "numeric uid"},
      {{"--hugepages=maybe"}, "boolean"},
      {{"--runtime-dir=relative/dir"}, "absolute path"},
      {{"--drain-timeout=forever"}, "--drain-timeout"},
      {{"stray"}, "unexpected argument"},
  };
  for (const Case& c : cases) {
    Result<DaemonConfig> r = Parse(c.args);
    ASSERT_FALSE(r.ok()) << c.needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().message();
  }
}

TEST(Config, PrecedenceDefaultsFileEnvFlags) {
  TempFile file(
      "[arena]\nsize = \"2GiB\"\nchunk_size = \"256MiB\"\nprefault_threads = 4\n"
      "[quotas]\nsession_max_bytes = \"1GiB\"\njob_max_bytes = 4294967296\n"
      "[access]\nallowed_uids = [1000, 1001]\n");
  Result<DaemonConfig> c = Parse({"--config", file.path().c_str(), "--prefault-threads=1"},
                                 {"MEMOFFLOAD_CHUNK_SIZE=128MiB", "MEMOFFLOAD_PREFAULT_THREADS=2",
                                  "UNRELATED=1", "MEMOFFLOAD_SOMETHING_CLIENT_SIDE=1"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->arena_size_bytes, 2 * kGiB);      // file
  EXPECT_EQ(c->chunk_size_bytes, 128 * kMiB);    // env beats file
  EXPECT_EQ(c->prefault_threads, 1);             // flag beats env
  EXPECT_EQ(c->policy.session_max_bytes, kGiB);  // file, string form
  EXPECT_EQ(c->policy.job_max_bytes, 4 * kGiB);  // file, integer form
  EXPECT_EQ(c->policy.allowed_uids, (std::vector<uint32_t>{1000, 1001}));
  EXPECT_EQ(c->sources["arena.size"], "file");
  EXPECT_EQ(c->sources["arena.chunk_size"], "env");
  EXPECT_EQ(c->sources["arena.prefault_threads"], "flag");
  EXPECT_EQ(c->config_file, file.path());
}

TEST(Config, ConfigFileFromEnvironment) {
  TempFile file("[quotas]\nnode_reserve_bytes = \"64MiB\"\n");
  Result<DaemonConfig> c = Parse({}, {"MEMOFFLOAD_CONFIG=" + file.path()});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->policy.node_reserve_bytes, 64 * kMiB);
}

TEST(Config, BadFilesAreErrorsNamingFileKeyAndChoices) {
  struct Case {
    const char* text;
    const char* needle;
  } cases[] = {
      {"[arena]\nsise = \"1GiB\"\n",
       "unknown key 'arena.sise'; keys in [arena] are size, chunk_size"},
      {"[arenas]\nsize = 1\n", "unknown section 'arenas'"},
      {"size = 1\n", "unknown section 'size'"},
      {"[arena]\nsize = \"big\"\n", "arena.size: invalid size 'big'"},
      {"[arena]\nsize = 1.5\n", "arena.size: invalid size '1.5'"},
      {"[arena]\nsize = 2024-01-01\n", "unsupported value type"},
      {"[arena\nsize = 1\n", ":1:"},
  };
  for (const Case& c : cases) {
    TempFile file(c.text);
    Result<DaemonConfig> r = Parse({"--config", file.path().c_str()});
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_NE(r.status().message().find(file.path()), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().message();
  }
  Result<DaemonConfig> missing = Parse({"--config=/nonexistent/memoffloadd.toml"});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/memoffloadd.toml"), std::string::npos);
}

TEST(Config, DefaultsResolveToSmallArena) {
  Result<DaemonConfig> c = Parse({});
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(ResolveAndValidate(&*c).ok());
  EXPECT_EQ(c->arena_size_bytes, std::min<uint64_t>(kGiB, PhysicalMemoryBytes() / 4 / 4096 * 4096));
  EXPECT_EQ(c->chunk_size_bytes, std::min<uint64_t>(kGiB, c->arena_size_bytes));
  EXPECT_FALSE(c->runtime_dir.empty());
  EXPECT_GE(c->prefault_threads, 1);
  EXPECT_EQ(c->metrics_address, kDefaultMetricsAddress);
  EXPECT_EQ(c->drain_timeout_ms, 30000u);
}

TEST(Config, ChunkLargerThanArenaIsClamped) {
  Result<DaemonConfig> c = Parse({"--arena-size=64MiB", "--chunk-size=1GiB"});
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(ResolveAndValidate(&*c).ok());
  EXPECT_EQ(c->chunk_size_bytes, 64 * kMiB);
}

TEST(Config, RejectsImpossibleSizes) {
  struct Case {
    std::vector<const char*> args;
    const char* needle;
  } cases[] = {
      {{"--chunk-size=1000"}, "multiple of the page size"},
      {{"--arena-size=100TiB"}, "exceeds this machine's RAM"},
      {{"--arena-size=1GiB", "--chunk-size=4KiB"}, "at most 65536"},
      {{"--arena-size=64MiB", "--node-reserve-bytes=64MiB"}, "leaves nothing"},
      {{"--max-wait=3600001ms"},
       "quotas.max_wait: 3600001ms is more than the maximum of 3600000ms (1h)"},
  };
  for (const Case& c : cases) {
    Result<DaemonConfig> r = Parse(c.args);
    ASSERT_TRUE(r.ok());
    Status st = ResolveAndValidate(&*r);
    EXPECT_NE(st.message().find(c.needle), std::string::npos) << st.message();
  }
}

// Issue 13 item 6: these values were accepted and then overflowed (every
// attach dropped, a drain deadline in the past) or silently meant the default.
TEST(Config, RejectsOutOfRangeTimeoutsLimitsAndAZeroArena) {
  struct Case {
    std::vector<const char*> args;
    const char* needle;
  } cases[] = {
      {{"--hello-timeout=0"}, "lifecycle.hello_timeout: 0ms is outside 100ms..3600000ms"},
      {{"--hello-timeout=597h"}, "lifecycle.hello_timeout: 2149200000ms is outside"},
      {{"--hello-timeout=99ms"}, "lifecycle.hello_timeout: 99ms is outside"},
      {{"--drain-timeout=25h"}, "lifecycle.drain_timeout: 90000000ms is more than the maximum"},
      {{"--drain-timeout=600000h"}, "lifecycle.drain_timeout"},
      {{"--arena-size=0"}, "arena.size: 0 is not a size"},
      {{"--max-connections=10", "--max-connections-per-uid=11"},
       "server.max_connections_per_uid: 11 is outside 1..10"},
  };
  for (const Case& c : cases) {
    Result<DaemonConfig> r = Parse(c.args);
    ASSERT_TRUE(r.ok()) << r.status().message();
    Status st = ResolveAndValidate(&*r);
    EXPECT_NE(st.message().find(c.needle), std::string::npos) << c.args[0] << ": " << st.message();
  }
  TempFile zero("[arena]\nsize = \"0\"\n");
  Result<DaemonConfig> from_file = Parse({"--config", zero.path().c_str()});
  ASSERT_TRUE(from_file.ok()) << from_file.status().message();
  EXPECT_NE(ResolveAndValidate(&*from_file).message().find("arena.size: 0 is not a size"),
            std::string::npos);
  // The ends of the ranges are fine, and leaving arena.size out is the default.
  Result<DaemonConfig> edges = Parse({"--hello-timeout=1h", "--drain-timeout=0",
                                      "--max-connections=1", "--max-connections-per-uid=1"});
  ASSERT_TRUE(edges.ok());
  EXPECT_TRUE(ResolveAndValidate(&*edges).ok());
  EXPECT_GT(edges->arena_size_bytes, 0u);
  for (const char* bad : {"--max-connections=-1", "--max-connections=0"}) {
    Result<DaemonConfig> bad_count = Parse({bad});
    EXPECT_FALSE(bad_count.ok()) << bad;
  }
}

// The limits of issue 13 exist: 0 is not "none", and each has a ceiling.
TEST(Config, ReserveLimitsAreCountsFromOneToTheirCeiling) {
  Result<DaemonConfig> c = Parse({"--max-waiting-reserves=10",
                                  "--max-waiting-reserves-per-tenant=5", "--reserve-aging=500ms",
                                  "--max-extents-per-reserve=64", "--max-groups-per-session=100"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->policy.max_waiting_reserves, 10u);
  EXPECT_EQ(c->policy.max_waiting_reserves_per_tenant, 5u);
  EXPECT_EQ(c->policy.reserve_aging_ms, 500u);
  EXPECT_EQ(c->policy.max_extents_per_reserve, 64u);
  EXPECT_EQ(c->policy.max_groups_per_session, 100u);
  for (const char* bad : {"--max-waiting-reserves=0", "--max-groups-per-session=-1",
                          "--max-extents-per-reserve=100001", "--max-waiting-reserves=ten"}) {
    Result<DaemonConfig> r = Parse({bad});
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("is not an integer in 1.."), std::string::npos)
        << r.status().message();
  }
  Result<DaemonConfig> aging = Parse({"--reserve-aging=2h"});
  ASSERT_TRUE(aging.ok());
  EXPECT_NE(ResolveAndValidate(&*aging).message().find("quotas.reserve_aging"), std::string::npos);
}

// quotas.state_share: a fraction in (0, 1] from every source, a TOML float
// or integer in a file, printed as it parses back.
TEST(Config, StateShareIsAFractionFromZeroExcludedToOne) {
  Result<DaemonConfig> c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->policy.state_share, 0.5);
  EXPECT_NE(FormatConfig(*c).find("state_share = 0.5  # default"), std::string::npos)
      << FormatConfig(*c);
  c = Parse({"--state-share=0.25"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->policy.state_share, 0.25);
  c = Parse({}, {"MEMOFFLOAD_STATE_SHARE=1"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->policy.state_share, 1.0);
  EXPECT_EQ(c->sources["quotas.state_share"], "env");
  for (const char* text :
       {"[quotas]\nstate_share = 0.75\n", "[quotas]\nstate_share = \"0.75\"\n"}) {
    TempFile file(text);
    c = Parse({"--config", file.path().c_str()});
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->policy.state_share, 0.75) << text;
  }
  TempFile whole("[quotas]\nstate_share = 1\n");
  c = Parse({"--config", whole.path().c_str()});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->policy.state_share, 1.0);
  for (const char* bad :
       {"--state-share=0", "--state-share=1.01", "--state-share=-0.5", "--state-share=nan",
        "--state-share=inf", "--state-share=half", "--state-share=0.5x", "--state-share="}) {
    Result<DaemonConfig> r = Parse({bad});
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("is not a fraction in (0, 1]"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("--state-share"), std::string::npos)
        << r.status().message();
  }
  TempFile zero("[quotas]\nstate_share = 0.0\n");
  Result<DaemonConfig> r = Parse({"--config", zero.path().c_str()});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("quotas.state_share"), std::string::npos)
      << r.status().message();
}

TEST(Config, PrintedConfigParsesBackToTheSameValues) {
  for (const char* share : {"--state-share=0.3", "--state-share=1", "--state-share=1e-9"}) {
    Result<DaemonConfig> c = Parse({"--arena-size=3GiB", "--allowed-gids=10,20", "--max-wait=5s",
                                    "--socket-mode=0600", share});
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE(ResolveAndValidate(&*c).ok());
    TempFile file(FormatConfig(*c));
    Result<DaemonConfig> back = Parse({"--config", file.path().c_str()});
    ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << FormatConfig(*c);
    ASSERT_TRUE(ResolveAndValidate(&*back).ok());
    const auto a = ConfigEntries(*c);
    const auto b = ConfigEntries(*back);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].value, b[i].value) << a[i].key;
    EXPECT_EQ(back->policy.state_share, c->policy.state_share) << share;
  }
}

TEST(Config, HealthAddressFromEverySourceDefaultsToNone) {
  Result<DaemonConfig> c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->health_address, "");
  EXPECT_NE(FormatConfig(*c).find("health_address = \"none\"  # default"), std::string::npos)
      << FormatConfig(*c);
  c = Parse({"--health-address=0.0.0.0:9478"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->health_address, "0.0.0.0:9478");
  EXPECT_NE(FormatConfig(*c).find("health_address = \"0.0.0.0:9478\"  # flag"), std::string::npos);
  c = Parse({}, {"MEMOFFLOAD_HEALTH_ADDRESS=[::1]:0"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->health_address, "[::1]:0");
  EXPECT_EQ(c->sources["server.health_address"], "env");
  TempFile file("[server]\nhealth_address = \"127.0.0.1:9478\"\n");
  c = Parse({"--config", file.path().c_str()});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->health_address, "127.0.0.1:9478");
  c = Parse({"--config", file.path().c_str(), "--health-address=none"});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->health_address, "");
}

TEST(Config, HelpListsEveryFlagAndEnvName) {
  const std::string help = FlagsHelp();
  for (const char* s : {"--runtime-dir", "--arena-size", "--chunk-size", "--metrics-address",
                        "--health-address", "--prefault-threads", "--hugepages", "--no-mlock",
                        "--config", "--print-config", "--session-max-bytes", "--job-max-bytes",
                        "--node-reserve-bytes", "--drain-timeout", "--state-share=FRACTION",
                        "MEMOFFLOAD_STATE_SHARE", "MEMOFFLOAD_ARENA_SIZE", "[quotas] max_wait"}) {
    EXPECT_NE(help.find(s), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace memoffload::daemon

namespace memoffload::daemon {
namespace {

Result<DaemonConfig> Resolved(std::vector<const char*> args) {
  args.insert(args.begin(), "memoffloadd");
  Result<DaemonConfig> c = LoadConfig(static_cast<int>(args.size()), args.data(), {});
  if (!c.ok()) return c;
  MEMOFFLOAD_RETURN_IF_ERROR(ResolveAndValidate(&*c));
  return c;
}

TEST(Config, RegionLimitsDefaultToHalfTheArenaAndAnExplicitZeroDisablesThem) {
  auto c = Resolved({"--arena-size=1GiB", "--chunk-size=256MiB", "--runtime-dir=/tmp/x"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->policy.region_max_bytes, 512u << 20);
  // At least one chunk: a region pins its whole chunk.
  auto one = Resolved({"--arena-size=1GiB", "--chunk-size=1GiB", "--runtime-dir=/tmp/x"});
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->policy.region_max_bytes, 1u << 30);
  EXPECT_EQ(c->policy.region_ttl_ms, 24u * 3600 * 1000);
  auto off = Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-max-bytes=0"});
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  EXPECT_EQ(off->policy.region_max_bytes, 0u);
  auto set =
      Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-max-bytes=256MiB",
                "--regions-job-max-bytes=64MiB", "--regions-ttl=90s", "--regions-max-per-job=8",
                "--regions-uid-max-bytes=128MiB", "--regions-max-per-uid=16"});
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->policy.region_max_bytes, 256u << 20);
  EXPECT_EQ(set->policy.region_job_max_bytes, 64u << 20);
  EXPECT_EQ(set->policy.region_ttl_ms, 90000u);
  EXPECT_EQ(set->policy.max_regions_per_job, 8u);
  EXPECT_EQ(set->policy.region_uid_max_bytes, 128u << 20);
  EXPECT_EQ(set->policy.max_regions_per_uid, 16u);
  auto zero = Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-max-per-uid=0"});
  ASSERT_TRUE(zero.ok()) << zero.status().ToString();
  auto big = Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-max-bytes=2GiB"});
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("regions.max_bytes"), std::string::npos);
  auto ttl = Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-ttl=0s"});
  ASSERT_FALSE(ttl.ok());
  EXPECT_NE(ttl.status().message().find("regions.ttl"), std::string::npos);
}

// Issue 29: with the per-uid region limits off, one uid filled every region
// slot of the node. They are on by default: an eighth of regions.max_count
// and half of regions.max_bytes, following those two; an explicit 0 turns
// them off, and a value set is kept.
TEST(Config, PerUidRegionLimitsDefaultToAnEighthOfTheCountAndHalfTheBytes) {
  auto c = Resolved({"--arena-size=1GiB", "--chunk-size=256MiB", "--runtime-dir=/tmp/x"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->policy.max_regions_per_uid, 65536u / 8);
  EXPECT_EQ(c->policy.region_uid_max_bytes, c->policy.region_max_bytes / 2);
  EXPECT_EQ(c->policy.region_uid_max_bytes, 256u << 20);
  EXPECT_EQ(c->sources.at("regions.max_per_uid"), "default");
  // They follow the node's limits they are shares of.
  auto small = Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-max-count=20",
                         "--regions-max-bytes=100MiB"});
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_EQ(small->policy.max_regions_per_uid, 2u);
  EXPECT_EQ(small->policy.region_uid_max_bytes, 50u << 20);
  // At least one region: a count under 8 leaves each uid one.
  auto tiny = Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-max-count=3"});
  ASSERT_TRUE(tiny.ok()) << tiny.status().ToString();
  EXPECT_EQ(tiny->policy.max_regions_per_uid, 1u);
  // An explicit 0 is "no per-uid limit", as before; a value set is kept.
  auto off = Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-max-per-uid=0",
                       "--regions-uid-max-bytes=0"});
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  EXPECT_EQ(off->policy.max_regions_per_uid, 0u);
  EXPECT_EQ(off->policy.region_uid_max_bytes, 0u);
  auto set = Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-max-per-uid=5",
                       "--regions-uid-max-bytes=300MiB"});
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->policy.max_regions_per_uid, 5u);
  EXPECT_EQ(set->policy.region_uid_max_bytes, 300u << 20);
  // Regions disabled: nothing to share.
  auto disabled = Resolved({"--arena-size=1GiB", "--runtime-dir=/tmp/x", "--regions-max-bytes=0"});
  ASSERT_TRUE(disabled.ok()) << disabled.status().ToString();
  EXPECT_EQ(disabled->policy.region_uid_max_bytes, 0u);
}

}  // namespace
}  // namespace memoffload::daemon
