// Client's checkpoint-region calls (see client.h).
#include "client_impl.h"
#include "grpc_util.h"

namespace memoffload::client {

Result<Reservation> Client::CreateRegion(const std::string& name, uint64_t size_bytes,
                                         double ttl_seconds) {
  v1::CreateRegionRequest req;
  req.set_name(name);
  req.set_size_bytes(size_bytes);
  req.set_ttl_seconds(ttl_seconds);
  v1::CreateRegionResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::CreateRegion, &req, &resp);
  if (!st.ok()) return impl_->SessionGoneOr(st);
  Reservation reservation{FromProto(resp.extents()), resp.reserved_bytes()};
  if (Status mapped = impl_->EnsureMapped(Impl::ChunksOf(reservation.extents)); !mapped.ok()) {
    // The mapping error is the answer; an uncommitted region is freed with
    // the session anyway, so a failed abort only delays that.
    if (Result<uint64_t> aborted = DeleteRegion(name); !aborted.ok()) {
      return Status(mapped.code(), mapped.message() + " (and aborting region " + name +
                                       " failed: " + aborted.status().ToString() + ")");
    }
    return mapped;
  }
  impl_->PopulateAhead(reservation.extents);  // the writer is about to fill it front to back
  return reservation;
}

Result<CommitInfo> Client::CommitRegion(const std::string& name, uint64_t used_bytes,
                                        const std::vector<uint32_t>& extent_crc32c,
                                        const std::string& rename_to) {
  v1::CommitRegionRequest req;
  req.set_name(name);
  req.set_rename_to(rename_to);
  req.set_used_bytes(used_bytes);
  for (uint32_t crc : extent_crc32c) req.add_extent_crc32c(crc);
  v1::CommitRegionResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::CommitRegion, &req, &resp);
  if (!st.ok()) return impl_->SessionGoneOr(st);
  return CommitInfo{resp.committed_bytes(), resp.returned_bytes()};
}

Result<Placement> Client::OpenRegion(const std::string& name, bool verify) {
  v1::OpenRegionRequest req;
  req.set_name(name);
  v1::OpenRegionResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::OpenRegion, &req, &resp);
  if (!st.ok()) return impl_->SessionGoneOr(st);
  Placement placement{FromProto(resp.extents()),
                      resp.used_bytes(),
                      {resp.extent_crc32c().begin(), resp.extent_crc32c().end()}};
  st = impl_->EnsureMapped(Impl::ChunksOf(placement.extents));
  if (st.ok() && verify && !placement.extent_crc32c.empty()) {
    // The check reads it all now: fill the page tables first, in large steps.
    for (const Extent& e : placement.extents) impl_->PopulateRange(e.chunk, e.offset, e.length);
    st = impl_->Verify(placement, "region " + name);
  } else if (st.ok()) {
    impl_->PopulateAhead(placement.extents);  // the reader is about to read it all
  }
  if (!st.ok()) {
    if (Status closed = CloseRegion(name); !closed.ok()) {
      return Status(st.code(), st.message() + " (and closing region " + name +
                                   " failed: " + closed.ToString() + ")");
    }
    return st;
  }
  return placement;
}

Status Client::CloseRegion(const std::string& name) {
  v1::CloseRegionRequest req;
  req.set_name(name);
  v1::CloseRegionResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::CloseRegion, &req, &resp);
  // A session that is gone has nothing open.
  if (!st.ok() && impl_->SessionGone()) return Status::Ok();
  return st;
}

Result<uint64_t> Client::DeleteRegion(const std::string& name) {
  v1::DeleteRegionRequest req;
  req.set_name(name);
  v1::DeleteRegionResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::DeleteRegion, &req, &resp);
  if (!st.ok()) return impl_->SessionGoneOr(st);
  return resp.freed_bytes();
}

Result<std::vector<RegionInfo>> Client::ListRegions(const std::string& prefix) {
  v1::ListRegionsRequest req;
  req.set_prefix(prefix);
  v1::ListRegionsResponse resp;
  Status st = impl_->Call(&v1::Offload::Stub::ListRegions, &req, &resp);
  if (!st.ok()) return impl_->SessionGoneOr(st);
  std::vector<RegionInfo> out;
  out.reserve(resp.regions_size());
  for (const v1::RegionInfo& r : resp.regions()) {
    out.push_back(RegionInfo{r.name(), r.uid(), r.job_id(), r.state(), r.used_bytes(),
                             r.held_bytes(), r.committed_unix(), r.expires_in_seconds(),
                             r.ttl_seconds(), r.checksummed(), r.readers()});
  }
  return out;
}

Result<std::vector<uint32_t>> Client::ExtentChecksums(const std::vector<Extent>& extents,
                                                      uint64_t used) const {
  return impl_->ExtentChecksums(extents, used);
}

}  // namespace memoffload::client
