// The receiving half of a link exchange (link_exchange.h): connections are
// accepted from expected peers' addresses only, at most
// max_pending_handshakes at once, each with a deadline for its TLS handshake
// and hello; an admitted stream's frames are checked as they come and its
// regions are committed only when whole and intact.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>

#include "link_exchange.h"
#include "memoffload/common/crc32c.h"

namespace memoffload::client::link_internal {

Status Exchange::StartAccepting() {
  const int fd = fcntl(listener_->fd(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("dup of the link's listening socket", errno);
  ErrorCode ec;
  const asio::ip::address a = asio::ip::make_address(listener_->address(), ec);
  acceptor_.assign(a.is_v6() ? tcp::v6() : tcp::v4(), fd, ec);
  if (ec) {
    close(fd);
    return Internal("cannot take the link's listening socket: " + Why(ec));
  }
  Accept();
  return Status::Ok();
}

void Exchange::Accept() {
  auto pending = std::make_shared<Pending>(io_, server_->context());
  acceptor_.async_accept(pending->stream->lowest_layer(), [this, pending](const ErrorCode& ec) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (ec) {
      if (ec == asio::error::no_descriptors || ec.value() == ENFILE) {
        ++listener_->mutable_dropped()->fd_shortage;
        accept_retry_ = std::make_unique<asio::steady_timer>(io_, kRetryDelay);
        accept_retry_->async_wait([this](const ErrorCode& e) {
          if (!e && acceptor_.is_open()) Accept();
        });
        return;
      }
      Accept();
      return;
    }
    Admit(pending);
    Accept();
  });
}

void Exchange::Admit(const std::shared_ptr<Pending>& pending) {
  ErrorCode ec;
  const tcp::endpoint from = pending->stream->lowest_layer().remote_endpoint(ec);
  if (ec || allowed_.count(from.address()) == 0) {
    ++listener_->mutable_dropped()->not_a_peer;
    pending->stream->lowest_layer().close(ec);
    return;
  }
  if (pending_ >= options_.max_pending_handshakes) {
    ++listener_->mutable_dropped()->busy;
    pending->stream->lowest_layer().close(ec);
    return;
  }
  ++pending_;
  pending->timer.expires_after(std::chrono::milliseconds(options_.handshake_timeout_ms));
  pending->timer.async_wait([this, pending](const ErrorCode& e) {
    if (e || pending->settled) return;
    ++listener_->mutable_dropped()->bad_hello;  // no handshake and hello in time
    Settle(pending, nullptr);
  });
  pending->stream->async_handshake(asio::ssl::stream_base::server, [this,
                                                                    pending](const ErrorCode& e) {
    if (pending->settled) return;
    if (e) {
      ++listener_->mutable_dropped()->handshake;
      return Settle(pending, nullptr);
    }
    asio::async_read(*pending->stream, asio::buffer(pending->header),
                     [this, pending](const ErrorCode& e2, size_t) {
                       if (pending->settled) return;
                       LinkFrameType type;
                       Result<uint32_t> length =
                           e2 ? Result<uint32_t>(Unavailable(Why(e2)))
                              : CheckLinkFrameHeader(pending->header, options_.piece_bytes, &type);
                       if (!length.ok() || type != LinkFrameType::kHello) {
                         ++listener_->mutable_dropped()->bad_hello;
                         return Settle(pending, nullptr);
                       }
                       pending->payload.resize(*length);
                       asio::async_read(*pending->stream, asio::buffer(pending->payload),
                                        [this, pending](const ErrorCode& e3, size_t) {
                                          if (pending->settled) return;
                                          OnHello(pending, e3);
                                        });
                     });
  });
}

void Exchange::OnHello(const std::shared_ptr<Pending>& pending, const ErrorCode& ec) {
  Result<LinkHello> hello =
      ec ? Result<LinkHello>(Unavailable(Why(ec))) : DecodeLinkHello(pending->payload);
  InStream* in = nullptr;
  if (hello.ok() && hello->call == options_.call && hello->seq == seq_) {
    auto it = ins_.find(hello->rank);
    if (it != ins_.end() && !it->second->connected) in = it->second.get();
  }
  if (in != nullptr) {
    std::vector<LinkItem> expected;
    for (const LinkRegion& r : in->spec->regions) {
      expected.push_back({LinkItemKind::kRegion, r.size_bytes, r.name});
    }
    for (uint64_t max : in->spec->blob_max_bytes) {
      expected.push_back({LinkItemKind::kBlob, max, ""});
    }
    in->check = std::make_unique<LinkStreamCheck>(std::move(expected), options_.piece_bytes);
    if (!in->check->Hello(*hello).ok()) in = nullptr;
  }
  if (in == nullptr) {
    ++listener_->mutable_dropped()->bad_hello;
    return Settle(pending, nullptr);
  }
  Settle(pending, in);
}

// Ends a pending connection's handshake phase: hands its stream to `in`,
// or closes it.
void Exchange::Settle(const std::shared_ptr<Pending>& pending, InStream* in) {
  pending->settled = true;
  --pending_;
  pending->timer.cancel();
  if (in == nullptr) {
    ErrorCode ignored;
    pending->stream->lowest_layer().close(ignored);
    return;
  }
  in->stream = std::move(pending->stream);
  in->connected = true;
  ReadFrame(in);
  if (std::all_of(ins_.begin(), ins_.end(), [](const auto& p) { return p.second->connected; })) {
    ErrorCode ignored;
    acceptor_.close(ignored);  // every peer is here: nobody else gets in
    if (accept_retry_) accept_retry_->cancel();
  }
}

void Exchange::ReadFrame(InStream* in) {
  asio::async_read(*in->stream, asio::buffer(in->header), [this, in](const ErrorCode& ec, size_t) {
    if (ec) return FailIn(in, "the connection ended: " + Why(ec));
    LinkFrameType type;
    Result<uint32_t> length = CheckLinkFrameHeader(in->header, options_.piece_bytes, &type);
    if (!length.ok()) return FailIn(in, length.status().message());
    switch (type) {
      case LinkFrameType::kItem:
      case LinkFrameType::kFail:
        return ReadPayload(in, *length, type);
      case LinkFrameType::kPiece:
        return ReadPiece(in, *length - kLinkPieceHeaderBytes);
      case LinkFrameType::kBlob:
        return ReadBlob(in, *length);
      case LinkFrameType::kEnd:
        return OnEnd(in);
      default:
        return FailIn(in, "an unexpected hello");
    }
  });
}

void Exchange::ReadPayload(InStream* in, uint32_t length, LinkFrameType type) {
  in->payload.resize(length);
  asio::async_read(*in->stream, asio::buffer(in->payload),
                   [this, in, type](const ErrorCode& ec, size_t) {
                     if (ec) return FailIn(in, "the connection ended: " + Why(ec));
                     if (type == LinkFrameType::kItem) return OnItem(in);
                     Status st = in->check->Fail();
                     if (!st.ok()) return FailIn(in, st.message());
                     if (in->item_problem.empty()) {
                       in->item_problem = "the sender could not read it: " + in->payload;
                     }
                     ReadFrame(in);
                   });
}

void Exchange::OnItem(InStream* in) {
  CloseItem(in);
  Result<LinkItem> item = DecodeLinkItem(in->payload);
  Status st = item.ok() ? in->check->Item(*item) : item.status();
  if (!st.ok()) return FailIn(in, st.message());
  in->item_open = true;
  in->item_problem.clear();
  in->blob.clear();
  const LinkItem& current = in->check->current();
  if (current.kind == LinkItemKind::kRegion) {
    result_.regions[current.name] = "not received";
    if (sink_.memory) {
      in->memory = sink_.memory(current.name);
      if (in->memory == nullptr) in->item_problem = "no memory to receive it into";
    } else if (sink_.store != nullptr) {
      Result<std::unique_ptr<RegionWriter>> writer =
          sink_.store->Create(current.name, current.size_bytes, sink_.ttl_seconds);
      if (writer.ok()) {
        in->writer = std::move(writer).value();
      } else {
        in->item_problem = writer.status().ToString();
      }
    } else {
      in->item_problem = "nowhere to keep it";
    }
  }
  ReadFrame(in);
}

void Exchange::ReadPiece(InStream* in, uint64_t length) {
  asio::async_read(
      *in->stream, asio::buffer(in->piece_header), [this, in, length](const ErrorCode& ec, size_t) {
        if (ec) return FailIn(in, "the connection ended: " + Why(ec));
        uint64_t offset = 0;
        uint32_t crc = 0;
        DecodeLinkPieceHeader(in->piece_header, &offset, &crc);
        Status st = in->check->Piece(offset, length);
        if (!st.ok()) return FailIn(in, st.message());
        // Straight into the region being written (its arena pages) or the
        // caller's memory; into a scratch buffer only what will not be kept.
        std::vector<asio::mutable_buffer> parts;
        bool into_region = false;
        if (in->memory != nullptr && in->item_problem.empty()) {
          parts.push_back(asio::buffer(in->memory + offset, length));
        } else if (in->writer != nullptr && in->item_problem.empty()) {
          Status exposed = in->writer->Expose(length, &in->spans);
          if (exposed.ok()) {
            into_region = true;
            for (const ArenaSpan& s : in->spans) parts.push_back(asio::buffer(s.data, s.length));
          } else {
            in->item_problem = exposed.ToString();
          }
        }
        if (parts.empty()) {
          in->buf.resize(length);
          parts.push_back(asio::buffer(in->buf.data(), length));
        }
        asio::async_read(*in->stream, parts,
                         [this, in, offset, length, crc, into_region](const ErrorCode& e2, size_t) {
                           if (e2) return FailIn(in, "the connection ended: " + Why(e2));
                           result_.bytes_received += length;
                           if (!in->item_problem.empty()) return ReadFrame(in);
                           Result<uint32_t> got =
                               into_region ? in->writer->Filled(length)
                                           : Result<uint32_t>(Crc32c(in->memory + offset, length));
                           if (!got.ok()) {
                             in->item_problem = got.status().ToString();
                           } else if (*got != crc) {
                             in->item_problem =
                                 "it arrived damaged (a piece's CRC32C differs from what was sent)";
                           }
                           ReadFrame(in);
                         });
      });
}

void Exchange::ReadBlob(InStream* in, uint32_t length) {
  Status st = in->check->Blob(length);
  if (!st.ok()) return FailIn(in, st.message());
  const size_t at = in->blob.size();
  in->blob.resize(at + length);
  asio::async_read(*in->stream, asio::buffer(in->blob.data() + at, length),
                   [this, in, length](const ErrorCode& ec, size_t) {
                     if (ec) return FailIn(in, "the connection ended: " + Why(ec));
                     result_.bytes_received += length;
                     ReadFrame(in);
                   });
}

void Exchange::OnEnd(InStream* in) {
  CloseItem(in);
  Status st = in->check->End();
  if (!st.ok()) return FailIn(in, st.message());
  in->done = true;
  ErrorCode ignored;
  in->stream->lowest_layer().close(ignored);
  MaybeFinished();
}

// The current item is whole (or failed): keep it or say why not.
void Exchange::CloseItem(InStream* in) {
  if (!in->item_open) return;
  in->item_open = false;
  const LinkItem& item = in->check->current();
  const bool whole = in->check->done_bytes() == item.size_bytes;
  if (in->item_problem.empty() && !whole) in->item_problem = "it did not arrive whole";
  if (item.kind == LinkItemKind::kBlob) {
    if (in->item_problem.empty()) result_.blobs[in->spec->peer.rank].push_back(in->blob);
    in->blob.clear();
    return;
  }
  if (in->item_problem.empty() && in->writer != nullptr) {
    Result<uint64_t> committed = in->writer->Commit();
    if (committed.ok()) {
      result_.regions_committed.push_back(item.name);
    } else {
      in->item_problem = committed.status().ToString();
    }
  }
  if (!in->item_problem.empty() && in->writer != nullptr) {
    Status ignored = in->writer->Abort();
    (void)ignored;  // the problem said is the item's; the daemon reclaims an unaborted region
  }
  in->writer.reset();
  in->memory = nullptr;
  result_.regions[item.name] = in->item_problem;
}

void Exchange::FailIn(InStream* in, const std::string& why) {
  if (in->done) return;
  if (in->item_open && in->item_problem.empty()) in->item_problem = why;
  CloseItem(in);
  for (const LinkRegion& r : in->spec->regions) {
    auto it = result_.regions.find(r.name);
    if (it == result_.regions.end() || it->second == "not received") {
      result_.regions[r.name] =
          "its stream from rank " + std::to_string(in->spec->peer.rank) + " failed: " + why;
    }
  }
  result_.receive_failures[in->spec->peer.rank] = why;
  in->done = true;
  if (in->stream) {
    ErrorCode ignored;
    in->stream->lowest_layer().close(ignored);
  }
  MaybeFinished();
}

}  // namespace memoffload::client::link_internal
