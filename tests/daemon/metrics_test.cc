// Metrics driven directly (no HTTP): the registry is serialised with
// prometheus-cpp's TextSerializer, as /metrics would print it.
#include "memoffload/daemon/metrics.h"

#include <gtest/gtest.h>
#include <prometheus/text_serializer.h>

#include <cmath>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include "memoffload/shared_mem/units.h"
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

  uint64_t Open(const std::string& job, int32_t rank) {
    Hello hello;
    hello.job_id = job;
    hello.rank = rank;
    auto grant = table_->Open(hello, PeerCredentials{1234, 1000, 1000});
    EXPECT_TRUE(grant.ok()) << grant.status().ToString();
    return grant.ok() ? grant->session_id : 0;
  }
  void Close(uint64_t session_id) {
    ASSERT_TRUE(table_->Close(session_id, CloseReason::kLifelineClosed).ok());
  }

  std::string Text() const {
    return prometheus::TextSerializer().Serialize(metrics_->registry()->Collect());
  }
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
};

TEST_F(MetricsTest, RankSeriesIsCreatedOnceAndSharedByTheSameJobAndRank) {
  const uint64_t a = Open("train", 2);
  const uint64_t b = Open("train", 2);  // a restarted rank: same labels
  for (int i = 0; i < 1000; ++i) {
    metrics_->RecordOffload(a, 10);
    metrics_->RecordPrefetch(b, 3);
  }
  metrics_->RecordOffload(b, 5);
  const auto offload = Samples("memoffload_rank_offload_bytes_total");
  ASSERT_EQ(offload.size(), 1u) << Text();
  EXPECT_EQ(offload[0], "memoffload_rank_offload_bytes_total{job_id=\"train\",rank=\"2\"} 10005");
  EXPECT_EQ(Samples("memoffload_rank_prefetch_bytes_total").size(), 1u);
  EXPECT_EQ(Value("memoffload_rank_prefetch_bytes_total{job_id=\"train\",rank=\"2\"}"), 3000);
  EXPECT_EQ(Value("memoffload_offload_bytes_total"), 10005);
  // A session that is gone is counted in the node totals only.
  metrics_->RecordOffload(999999, 7);
  EXPECT_EQ(Value("memoffload_offload_bytes_total"), 10012);
  EXPECT_EQ(Samples("memoffload_rank_offload_bytes_total").size(), 1u);
}

TEST_F(MetricsTest, RankSeriesCapHoldsAndKeepsLiveSessions) {
  std::vector<uint64_t> live;
  for (int r = 0; r < 8; ++r) live.push_back(Open("live", r));
  constexpr int kSessions = 3 * static_cast<int>(kMaxRankSeries);
  size_t most = 0;
  for (int i = 0; i < kSessions; ++i) {
    const uint64_t s = Open("job-" + std::to_string(i), i % 8);
    metrics_->RecordOffload(s, 1);
    for (uint64_t l : live) metrics_->RecordOffload(l, 1);
    Close(s);
    if (i % 97 == 0 || i == kSessions - 1) {
      most = std::max(most, Samples("memoffload_rank_offload_bytes_total").size());
    }
  }
  // Pruning runs every few dozen sessions: the cap may be passed by that many.
  EXPECT_LE(most, kMaxRankSeries + 2 * 64 + live.size());
  EXPECT_GT(most, kMaxRankSeries / 2) << "series of closed sessions were never kept";
  EXPECT_EQ(Value("memoffload_offload_bytes_total"), kSessions * (1.0 + live.size()));
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(Value("memoffload_rank_offload_bytes_total{job_id=\"live\",rank=\"" +
                    std::to_string(r) + "\"}"),
              kSessions)
        << "a live session's series was pruned";
  }
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
  const uint64_t s = Open(std::string(5000, 'j'), 0);
  metrics_->RecordOffload(s, 1);
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
