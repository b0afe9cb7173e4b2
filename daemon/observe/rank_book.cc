#include "observe/rank_book.h"

#include <openssl/evp.h>

#include <algorithm>

namespace memoffload::daemon {

Result<JobLabels> ParseJobLabels(const std::string& text) {
  if (text == "plain") return JobLabels::kPlain;
  if (text == "hash") return JobLabels::kHash;
  if (text == "none") return JobLabels::kNone;
  return InvalidArgument("'" + text + "' is not a metrics.job_labels mode: plain, hash or none");
}

std::string HashedJobId(const std::string& job_id) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(job_id.data(), job_id.size(), digest, &length, EVP_sha256(), nullptr) != 1 ||
      length < 6) {
    return "unhashed";  // never the job id itself
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < 6; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 0xf];
  }
  return out;
}

std::shared_ptr<RankSeries> RankBook::SeriesFor(const std::shared_ptr<RankBook>& self,
                                                const std::string& job_id, int32_t rank) {
  absl::MutexLock lock(&mu_);
  Key key(job_id, rank);
  auto it = slots_.find(key);
  if (it == slots_.end()) {
    if (slots_.size() >= prune_at_) Prune();
    // The broker admits job ids of at most kMaxJobIdBytes printable bytes;
    // cut here too, so that no label value is ever unbounded.
    const prometheus::Labels labels = {
        {"job_id",
         labels_ == JobLabels::kHash ? HashedJobId(job_id) : job_id.substr(0, kMaxLabelValueBytes)},
        {"rank", std::to_string(rank)}};
    Slot slot;
    slot.offload_bytes = &offload_->Add(labels);
    slot.prefetch_bytes = &prefetch_->Add(labels);
    it = slots_.emplace(key, slot).first;
  }
  Slot& slot = it->second;
  std::shared_ptr<RankSeries> series = slot.series.lock();
  if (!series) {
    // None yet, or the last one is dying (its Unused waits for mu_ and will
    // see that `alive` is not itself any more).
    series =
        std::make_shared<RankSeries>(self, std::move(key), slot.offload_bytes, slot.prefetch_bytes);
    slot.series = series;
    slot.alive = series.get();
  }
  return series;
}

void RankBook::Unused(const Key& key, const RankSeries* series) {
  absl::MutexLock lock(&mu_);
  auto it = slots_.find(key);
  if (it != slots_.end() && it->second.alive == series) it->second.alive = nullptr;
}

void RankBook::Prune() {
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (it->second.alive != nullptr) {
      ++it;
      continue;
    }
    offload_->Remove(it->second.offload_bytes);
    prefetch_->Remove(it->second.prefetch_bytes);
    it = slots_.erase(it);
  }
  // Amortised: with many live pairs, the next sweep waits for as many new ones.
  prune_at_ = std::max(kMaxRankSeries, 2 * slots_.size());
}

}  // namespace memoffload::daemon
