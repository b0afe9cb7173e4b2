// Metrics driven directly (no HTTP): the registry is serialised with
// prometheus-cpp's TextSerializer, as /metrics would print it.
#include "observe/metrics.h"

#include <gtest/gtest.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "memoffload/common/units.h"
#include "test_arena.h"

namespace memoffload::daemon {
namespace {

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    arena_ = MakeTestArena();
    ASSERT_NE(arena_, nullptr);
    table_ = std::make_unique<SessionTable>(arena_.get(), Policy{});
    metrics_ = std::make_unique<Metrics>(table_.get(), MetricsInfo{"test", 4, kMiB, false});
  }

  // Opens a session as the broker does, with the series of (job, rank).
  SessionGrant Open(const std::string& job, int32_t rank) {
    Hello hello;
    hello.job_id = job;
    hello.rank = rank;
    auto grant =
        table_->Open(hello, PeerCredentials{1234, 1000, 1000}, metrics_->SeriesFor(job, rank));
    EXPECT_TRUE(grant.ok()) << grant.status().ToString();
    return grant.ok() ? *grant : SessionGrant{};
  }
  void Close(const SessionGrant& s) {
    ASSERT_TRUE(table_->Close(s.session_id, CloseReason::kLifelineClosed).ok());
  }
  // Reserves and commits a group of `bytes`; returns the Commit's answer.
  CommitResult CommitGroup(const SessionGrant& s, uint64_t bytes) {
    const uint64_t group = ++next_group_;
    EXPECT_TRUE(
        table_->Reserve(s.session_id, s.token, group, std::max<uint64_t>(bytes, 1), false).ok());
    Result<CommitResult> r = table_->Commit(s.session_id, s.token, group, bytes);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(r).value() : CommitResult{};
  }
  void ReleaseLast(const SessionGrant& s) {
    EXPECT_TRUE(table_->Release(s.session_id, s.token, next_group_).ok());
  }
  // A Commit as OffloadService::Commit counts it.
  void Offload(const SessionGrant& s, uint64_t bytes) {
    metrics_->RecordOffload(CommitGroup(s, bytes).series.get(), bytes);
    ReleaseLast(s);
  }
  // A Prefetch (of a group committed uncounted) as OffloadService::Prefetch counts it.
  void Prefetch(const SessionGrant& s, uint64_t bytes) {
    CommitGroup(s, bytes);
    Result<PrefetchResult> r = table_->Prefetch(s.session_id, s.token, next_group_);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    metrics_->RecordPrefetch(r->series.get(), r->used_bytes);
    ReleaseLast(s);
  }

  std::string Text() const { return prometheus::TextSerializer().Serialize(metrics_->Collect()); }
  // Sample lines of `family` (no comments), e.g. `name{labels} value`.
  std::vector<std::string> Samples(const std::string& family) const {
    std::vector<std::string> out;
    const std::string text = Text();
    size_t pos = 0;
    while (pos < text.size()) {
      size_t end = text.find('\n', pos);
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(pos, end - pos);
      if (line.rfind(family + "{", 0) == 0 || line.rfind(family + " ", 0) == 0) {
        out.push_back(line);
      }
      pos = end + 1;
    }
    return out;
  }
  double Value(const std::string& series) const {
    for (const std::string& line : Samples(series.substr(0, series.find('{')))) {
      if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
    }
    return std::nan("");
  }

  std::unique_ptr<Arena> arena_;
  std::unique_ptr<SessionTable> table_;
  std::unique_ptr<Metrics> metrics_;
  uint64_t next_group_ = 0;
};

TEST_F(MetricsTest, RankSeriesIsCreatedOnceAndSharedByTheSameJobAndRank) {
  const SessionGrant a = Open("train", 2);
  const SessionGrant b = Open("train", 2);  // a restarted rank: same labels
  for (int i = 0; i < 1000; ++i) {
    Offload(a, 10);
    Prefetch(b, 3);
  }
  Offload(b, 5);
  const auto offload = Samples("memoffload_rank_offload_bytes_total");
  ASSERT_EQ(offload.size(), 1u) << Text();
  EXPECT_EQ(offload[0], "memoffload_rank_offload_bytes_total{job_id=\"train\",rank=\"2\"} 10005");
  EXPECT_EQ(Samples("memoffload_rank_prefetch_bytes_total").size(), 1u);
  EXPECT_EQ(Value("memoffload_rank_prefetch_bytes_total{job_id=\"train\",rank=\"2\"}"), 3000);
  EXPECT_EQ(Value("memoffload_offload_bytes_total"), 10005);
  // A session without series (Open without one) is counted in the node totals only.
  metrics_->RecordOffload(nullptr, 7);
  EXPECT_EQ(Value("memoffload_offload_bytes_total"), 10012);
  EXPECT_EQ(Samples("memoffload_rank_offload_bytes_total").size(), 1u);
}

TEST_F(MetricsTest, RankSeriesCapHoldsAndKeepsLiveSessions) {
  std::vector<SessionGrant> live;
  for (int r = 0; r < 8; ++r) live.push_back(Open("live", r));
  constexpr int kSessions = 3 * static_cast<int>(kMaxRankSeries);
  size_t most = 0;
  for (int i = 0; i < kSessions; ++i) {
    const SessionGrant s = Open("job-" + std::to_string(i), i % 8);
    Offload(s, 1);
    for (const SessionGrant& l : live) Offload(l, 1);
    Close(s);
    if (i % 97 == 0 || i == kSessions - 1) {
      most = std::max(most, Samples("memoffload_rank_offload_bytes_total").size());
    }
  }
  // A sweep runs when a new pair would pass the cap.
  EXPECT_LE(most, kMaxRankSeries);
  EXPECT_GT(most, kMaxRankSeries / 2) << "series of closed sessions were never kept";
  EXPECT_EQ(Value("memoffload_offload_bytes_total"), kSessions * (1.0 + live.size()));
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(Value("memoffload_rank_offload_bytes_total{job_id=\"live\",rank=\"" +
                    std::to_string(r) + "\"}"),
              kSessions)
        << "a live session's series was pruned";
  }
}

TEST_F(MetricsTest, RankSeriesFollowsTheSessionsOfItsJobAndRank) {
  const std::string series = "memoffload_rank_offload_bytes_total{job_id=\"train\",rank=\"1\"}";
  const SessionGrant a = Open("train", 1);
  EXPECT_EQ(Value(series), 0) << "the series appears when a session of the pair opens";
  Offload(a, 100);
  const SessionGrant b = Open("train", 1);
  Offload(b, 10);
  Close(a);  // b of the same job and rank is still live
  Offload(b, 1);
  EXPECT_EQ(Value(series), 111);
  Close(b);
  EXPECT_EQ(Value(series), 111) << "a finished rank's total stays";
  const SessionGrant c = Open("train", 1);  // the rank restarted
  Offload(c, 5);
  EXPECT_EQ(Value(series), 116);
  const SessionGrant other = Open("train", 3);
  Offload(other, 7);
  EXPECT_EQ(Value("memoffload_rank_offload_bytes_total{job_id=\"train\",rank=\"3\"}"), 7);
  EXPECT_EQ(Value(series), 116);
  EXPECT_EQ(Samples("memoffload_rank_offload_bytes_total").size(), 2u);
  EXPECT_EQ(Value("memoffload_offload_bytes_total"), 123);
}

TEST_F(MetricsTest, PruningRemovesOnlyPairsThatNoSessionOrRequestHolds) {
  auto series = [](const std::string& job) {
    return "memoffload_rank_offload_bytes_total{job_id=\"" + job + "\",rank=\"0\"}";
  };
  // Opens and closes sessions of `n` new pairs, each committing 1 byte.
  int filled = 0;
  size_t most = 0;
  auto fill = [&](int n) {
    for (int i = 0; i < n; ++i) {
      const SessionGrant s = Open("fill-" + std::to_string(filled++), 0);
      Offload(s, 1);
      Close(s);
      if (i % 32 == 31 || i == n - 1) {
        most = std::max(most, Samples("memoffload_rank_offload_bytes_total").size());
      }
    }
  };
  const SessionGrant live = Open("live", 0);
  Offload(live, 1);
  const SessionGrant gone = Open("gone", 0);
  Offload(gone, 2);
  Close(gone);
  // A request between the table's Commit and its count: its session closes
  // meanwhile, and it still holds the series.
  const SessionGrant held = Open("held", 0);
  CommitResult in_flight = CommitGroup(held, 3);
  Close(held);

  fill(static_cast<int>(kMaxRankSeries));
  EXPECT_TRUE(std::isnan(Value(series("gone")))) << "a pair without sessions was kept";
  EXPECT_TRUE(std::isnan(Value(series("fill-0"))));
  EXPECT_EQ(Value(series("live")), 1) << "a live session's series was removed";
  ASSERT_NE(in_flight.series, nullptr);
  metrics_->RecordOffload(in_flight.series.get(), 3);
  EXPECT_EQ(Value(series("held")), 3) << "a series was removed while a request held it";
  Offload(live, 1);
  EXPECT_EQ(Value(series("live")), 2);

  in_flight = CommitResult{};  // the request is done
  fill(static_cast<int>(kMaxRankSeries));
  EXPECT_TRUE(std::isnan(Value(series("held")))) << "a pair no one holds any more was kept";
  EXPECT_EQ(Value(series("live")), 2);
  EXPECT_LE(most, kMaxRankSeries);
  EXPECT_GT(most, kMaxRankSeries - 32) << "pairs were removed before the cap";

  // A pair that was removed starts again from 0 when a session of it opens.
  const SessionGrant again = Open("gone", 0);
  Offload(again, 4);
  EXPECT_EQ(Value(series("gone")), 4);
  EXPECT_EQ(Value("memoffload_offload_bytes_total"), 1 + 2 + 3 + 1 + 4 + 2.0 * kMaxRankSeries);
}

// Requests count through series they hold while sessions of their pair come
// and go (a keeper session keeps each hot pair live) and other pairs are
// pruned around them: the totals are exact. Under TSan this checks RankBook's
// own locking (the system's prometheus-cpp is not instrumented).
TEST_F(MetricsTest, ConcurrentRequestsCountExactlyWhilePairsArePruned) {
  constexpr int kThreads = 2, kRequests = 1500;
  std::vector<SessionGrant> keepers;  // one live session per hot pair
  for (int t = 0; t < kThreads; ++t) keepers.push_back(Open("hot", t));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t] {
      Hello hello;
      hello.job_id = "hot";
      hello.rank = t;
      for (int i = 0; i < kRequests; ++i) {
        // A session of the hot pair that ends while its request still counts.
        Result<SessionGrant> s =
            table_->Open(hello, PeerCredentials{1234, 1000, 1000}, metrics_->SeriesFor("hot", t));
        ASSERT_TRUE(s.ok());
        ASSERT_TRUE(table_->Reserve(s->session_id, s->token, 1, 4096, false).ok());
        Result<CommitResult> c = table_->Commit(s->session_id, s->token, 1, 10);
        ASSERT_TRUE(c.ok());
        ASSERT_TRUE(table_->Close(s->session_id, CloseReason::kLifelineClosed).ok());
        metrics_->RecordOffload(c->series.get(), 10);
      }
    });
  }
  threads.emplace_back([this] {
    Hello hello;
    for (int i = 0; i < 3 * static_cast<int>(kMaxRankSeries); ++i) {
      hello.job_id = "churn-" + std::to_string(i);
      Result<SessionGrant> s = table_->Open(hello, PeerCredentials{1234, 1000, 1000},
                                            metrics_->SeriesFor(hello.job_id, 0));
      ASSERT_TRUE(s.ok());
      ASSERT_TRUE(table_->Close(s->session_id, CloseReason::kLifelineClosed).ok());
    }
  });
  for (auto& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(Value("memoffload_rank_offload_bytes_total{job_id=\"hot\",rank=\"" +
                    std::to_string(t) + "\"}"),
              10.0 * kRequests);
  }
  EXPECT_EQ(Value("memoffload_offload_bytes_total"), 10.0 * kThreads * kRequests);
  EXPECT_LE(Samples("memoffload_rank_offload_bytes_total").size(), kMaxRankSeries);
}

TEST_F(MetricsTest, AFreeTheAllocatorRefusesIsCountedAsAnInternalError) {
  const std::string errors = "memoffload_internal_errors_total{where=\"session_table_free\"}";
  EXPECT_EQ(Value(errors), 0);
  const SessionGrant s = Open("train", 0);
  ASSERT_TRUE(table_->Reserve(s.session_id, s.token, 1, 64 * 1024, false).ok());
  Result<ReserveResult> two = table_->Reserve(s.session_id, s.token, 2, 64 * 1024, true);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  ASSERT_EQ(two->extents.size(), 1u);
  // Bookkeeping corruption: group 2's extent freed behind the table's back,
  // so the table's own Free of it is refused.
  ASSERT_TRUE(arena_->allocator().Free(two->extents[0]).ok());
  EXPECT_TRUE(table_->Release(s.session_id, s.token, 2).ok()) << "Release still answers";
  EXPECT_EQ(Value(errors), 1);
  EXPECT_EQ(table_->Snapshot().free_errors, 1u);
  Close(s);  // frees group 1: no error
  EXPECT_EQ(Value(errors), 1);
}

TEST_F(MetricsTest, ClientCopyRejectsNonsense) {
  using D = Metrics::CopyDirection;
  metrics_->RecordClientCopy(D::kOffload, 1 << 20, 0.001);
  metrics_->RecordClientCopy(D::kPrefetch, 2 << 20, 0.002);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double seconds : {-1.0, 0.0, nan, inf, -inf, kMaxClientCopySeconds * 2}) {
    metrics_->RecordClientCopy(D::kOffload, 4096, seconds);
  }
  metrics_->RecordClientCopy(D::kOffload, 0, 0.5);
  metrics_->RecordClientCopy(D::kOffload, 4 * kMiB + 1, 0.5);  // more than the arena
  metrics_->RecordClientCopy(D::kPrefetch, std::numeric_limits<uint64_t>::max(), 0.5);
  EXPECT_EQ(Value("memoffload_client_copy_bytes_total{direction=\"offload\"}"), 1 << 20);
  EXPECT_DOUBLE_EQ(Value("memoffload_client_copy_seconds_total{direction=\"offload\"}"), 0.001);
  EXPECT_EQ(Value("memoffload_client_copy_bytes_total{direction=\"prefetch\"}"), 2 << 20);
  EXPECT_DOUBLE_EQ(Value("memoffload_client_copy_seconds_total{direction=\"prefetch\"}"), 0.002);
}

TEST_F(MetricsTest, AttachRefusalsUseTheCachedReasonsOnly) {
  for (const char* reason : kAttachRefusalReasons) {
    EXPECT_EQ(Value(std::string("memoffload_attach_refusals_total{reason=\"") + reason + "\"}"), 0)
        << reason;
  }
  for (int i = 0; i < 3; ++i) metrics_->AttachRefused("access_denied");
  metrics_->AttachRefused("hello_timeout");
  metrics_->AttachRefused("made-up reason " + std::string(500, 'x'));
  EXPECT_EQ(Value("memoffload_attach_refusals_total{reason=\"access_denied\"}"), 3);
  EXPECT_EQ(Value("memoffload_attach_refusals_total{reason=\"hello_timeout\"}"), 1);
  EXPECT_EQ(Value("memoffload_attach_refusals_total{reason=\"session_error\"}"), 1);
  EXPECT_EQ(Samples("memoffload_attach_refusals_total").size(), kAttachRefusalReasons.size());
}

TEST_F(MetricsTest, LabelValuesAreBounded) {
  // The broker admits at most kMaxJobIdBytes; the table does not check.
  const SessionGrant s = Open(std::string(5000, 'j'), 0);
  Offload(s, 1);
  const auto lines = Samples("memoffload_rank_offload_bytes_total");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("job_id=\"" + std::string(kMaxLabelValueBytes, 'j') + "\""),
            std::string::npos);
  EXPECT_EQ(lines[0].find(std::string(kMaxLabelValueBytes + 1, 'j')), std::string::npos);
  // Every label value in the whole exposition is short.
  const std::regex label(R"re(="([^"]*)")re");
  const std::string text = Text();
  for (auto it = std::sregex_iterator(text.begin(), text.end(), label);
       it != std::sregex_iterator(); ++it) {
    EXPECT_LE((*it)[1].length(), kMaxLabelValueBytes) << (*it)[0];
  }
}

// metrics.job_labels (issue 29: /metrics is readable by any local user):
// hash names a job by the first 12 hex digits of its SHA-256, none gives no
// per-rank series; the node totals count in every mode.
TEST_F(MetricsTest, JobLabelsAreTheJobIdItsHashOrNothing) {
  // FIPS 180-2's test vector: SHA-256("abc") = ba7816bf 8f01cfea ...
  EXPECT_EQ(HashedJobId("abc"), "ba7816bf8f01");
  EXPECT_EQ(HashedJobId(std::string(5000, 'j')).size(), 12u);
  EXPECT_FALSE(ParseJobLabels("hashed").ok());
  for (const JobLabels mode : {JobLabels::kHash, JobLabels::kNone}) {
    metrics_ = std::make_unique<Metrics>(table_.get(), MetricsInfo{"test", 4, kMiB, false, mode});
    EXPECT_EQ(metrics_->SeriesFor("train", 1) == nullptr, mode == JobLabels::kNone);
    const SessionGrant s = Open("train", 1);
    Offload(s, 300);
    Close(s);
    EXPECT_EQ(Value("memoffload_offload_bytes_total"), 300);
    const std::string text = Text();
    EXPECT_EQ(text.find("train"), std::string::npos) << text;
    if (mode == JobLabels::kHash) {
      EXPECT_EQ(Value("memoffload_rank_offload_bytes_total{job_id=\"" + HashedJobId("train") +
                      "\",rank=\"1\"}"),
                300);
    } else {
      EXPECT_TRUE(Samples("memoffload_rank_offload_bytes_total").empty()) << text;
    }
  }
  EXPECT_TRUE(ParseJobLabels("plain").ok());
}

TEST_F(MetricsTest, FamiliesWithoutSeriesAreNotPrinted) {
  // Why tests/metrics derives the exported set from metrics.cc and not only
  // from # TYPE lines: prometheus-cpp prints nothing for a family without
  // series (here the per-rank and per-request families before any traffic).
  const std::string text = Text();
  EXPECT_EQ(text.find("memoffload_rank_offload_bytes_total"), std::string::npos) << text;
  EXPECT_EQ(text.find("memoffload_requests_total"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE memoffload_sessions_opened_total counter"), std::string::npos);
}

}  // namespace
}  // namespace memoffload::daemon
