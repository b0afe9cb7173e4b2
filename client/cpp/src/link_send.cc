// The sending half of a link exchange (link_exchange.h): each stream
// connects from this rank's replication address, retries until the
// deadline, and writes its items in pieces, each with the CRC32C of the
// bytes read.
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

void Exchange::Connect(OutStream* out) {
  ++out->attempts;
  out->stream = std::make_unique<SslStream>(tcp::socket(io_), client_->context());
  ErrorCode ec;
  Result<asio::ip::address> to = ParseAddress(out->spec->peer.host);
  if (!to.ok()) return FailOut(out, to.status().message());
  auto& socket = out->stream->lowest_layer();
  socket.open(local_.is_v6() ? tcp::v6() : tcp::v4(), ec);
  if (!ec) socket.bind(tcp::endpoint(local_, 0), ec);  // peers admit our address only
  if (ec)
    return FailOut(out, "cannot open a connection from " + local_.to_string() + ": " + Why(ec));
  socket.async_connect(tcp::endpoint(*to, out->spec->peer.port), [this, out](const ErrorCode& e) {
    if (finished_) return;
    if (e) return RetryOut(out, "cannot connect: " + Why(e));
    out->stream->async_handshake(asio::ssl::stream_base::client, [this, out](const ErrorCode& e2) {
      if (finished_) return;
      if (e2) return RetryOut(out, "the TLS handshake failed: " + Why(e2));
      LinkHello hello;
      hello.rank = options_.rank;
      hello.call = options_.call;
      hello.seq = seq_;
      hello.items = static_cast<uint32_t>(out->spec->regions.size() + out->spec->blobs.size());
      out->head = EncodeLinkHello(hello);
      asio::async_write(*out->stream, asio::buffer(out->head),
                        [this, out](const ErrorCode& e3, size_t) {
                          if (e3) return FailOut(out, "the connection ended: " + Why(e3));
                          NextItem(out);
                        });
    });
  });
}

// A peer that refused or dropped us (it may be busy with strangers' or
// not listening yet) is tried again until the deadline.
void Exchange::RetryOut(OutStream* out, const std::string& why) {
  ErrorCode ignored;
  out->stream->lowest_layer().close(ignored);
  out->failure = why;
  out->retry = std::make_unique<asio::steady_timer>(io_, kRetryDelay);
  out->retry->async_wait([this, out](const ErrorCode& ec) {
    if (!ec && !finished_) Connect(out);
  });
}

void Exchange::NextItem(OutStream* out) {
  out->failure.clear();
  const size_t regions = out->spec->regions.size();
  if (out->item >= regions + out->spec->blobs.size()) {
    out->head = EncodeLinkEnd();
    asio::async_write(*out->stream, asio::buffer(out->head),
                      [this, out](const ErrorCode& ec, size_t) {
                        if (ec) return FailOut(out, "the connection ended: " + Why(ec));
                        out->done = true;
                        ErrorCode ignored;
                        out->stream->lowest_layer().shutdown(tcp::socket::shutdown_send, ignored);
                        out->stream->lowest_layer().close(ignored);
                        MaybeFinished();
                      });
    return;
  }
  LinkItem item;
  if (out->item < regions) {
    const LinkRegion& r = out->spec->regions[out->item];
    item = {LinkItemKind::kRegion, r.size_bytes, r.name};
  } else {
    item = {LinkItemKind::kBlob, out->spec->blobs[out->item - regions].size(), ""};
  }
  out->offset = 0;
  out->head = EncodeLinkItem(item);
  asio::async_write(
      *out->stream, asio::buffer(out->head), [this, out](const ErrorCode& ec, size_t) {
        if (ec) return FailOut(out, "the connection ended: " + Why(ec));
        const size_t regions = out->spec->regions.size();
        if (out->item < regions) {
          const LinkRegion& r = out->spec->regions[out->item];
          out->reader.reset();
          Result<std::unique_ptr<RegionReader>> reader =
              source_ == nullptr ? Result<std::unique_ptr<RegionReader>>(
                                       FailedPrecondition("no store to read regions from"))
                                 : source_->Open(r.name, /*verify=*/true, /*verify_as_read=*/true);
          if (!reader.ok())
            return SendFail(out, "reading " + r.name + ": " + reader.status().ToString());
          if ((*reader)->size_bytes() != r.size_bytes) {
            return SendFail(out, r.name + " has " + std::to_string((*reader)->size_bytes()) +
                                     " bytes, not the " + std::to_string(r.size_bytes) + " agreed");
          }
          out->reader = std::move(reader).value();
          return NextPiece(out);
        }
        NextBlobPart(out);
      });
}

void Exchange::NextPiece(OutStream* out) {
  const LinkRegion& r = out->spec->regions[out->item];
  if (out->offset >= r.size_bytes) {
    Status rest = out->reader->VerifyRest();
    Status closed = out->reader->Close();
    out->reader.reset();
    if (!rest.ok()) return SendFail(out, "reading " + r.name + ": " + rest.ToString());
    if (!closed.ok()) return SendFail(out, "reading " + r.name + ": " + closed.ToString());
    ++out->item;
    return NextItem(out);
  }
  const uint64_t length = std::min(options_.piece_bytes, r.size_bytes - out->offset);
  // Straight from the arena: checked against the region's checksums and
  // summed for the piece in one pass, encrypted from where it lies.
  uint32_t crc = 0;
  Status read = out->reader->View(out->offset, length, &out->spans, &crc);
  if (!read.ok()) return SendFail(out, "reading " + r.name + ": " + read.ToString());
  out->head = EncodeLinkPieceHeader(out->offset, crc, static_cast<uint32_t>(length));
  std::vector<asio::const_buffer> parts = {asio::buffer(out->head)};
  if (options_.test_corrupt_every != 0 && ++pieces_sent_ % options_.test_corrupt_every == 0) {
    out->buf.clear();  // a copy changed "on the way", never the region itself
    for (const ArenaSpan& s : out->spans)
      out->buf.insert(out->buf.end(), s.data, s.data + s.length);
    out->buf[0] ^= 0x5a;
    parts.push_back(asio::buffer(out->buf.data(), length));
  } else {
    for (const ArenaSpan& s : out->spans) parts.push_back(asio::buffer(s.data, s.length));
  }
  asio::async_write(*out->stream, parts, [this, out, length](const ErrorCode& ec, size_t) {
    if (ec) return FailOut(out, "the connection ended: " + Why(ec));
    out->offset += length;
    result_.bytes_sent += length;
    NextPiece(out);
  });
}

void Exchange::NextBlobPart(OutStream* out) {
  const std::string& blob = out->spec->blobs[out->item - out->spec->regions.size()];
  if (out->offset >= blob.size()) {
    ++out->item;
    return NextItem(out);
  }
  const uint64_t length = std::min<uint64_t>(options_.piece_bytes, blob.size() - out->offset);
  out->head = EncodeLinkFrameHeader(LinkFrameType::kBlob, static_cast<uint32_t>(length));
  std::array<asio::const_buffer, 2> parts = {asio::buffer(out->head),
                                             asio::buffer(blob.data() + out->offset, length)};
  asio::async_write(*out->stream, parts, [this, out, length](const ErrorCode& ec, size_t) {
    if (ec) return FailOut(out, "the connection ended: " + Why(ec));
    out->offset += length;
    result_.bytes_sent += length;
    NextBlobPart(out);
  });
}

// The current item could not be read: the peer is told, and the stream
// goes on with the next item.
void Exchange::SendFail(OutStream* out, const std::string& why) {
  out->reader.reset();
  result_.send_failures.emplace(out->spec->peer.rank, why);
  out->head = EncodeLinkFail(why);
  asio::async_write(*out->stream, asio::buffer(out->head),
                    [this, out](const ErrorCode& ec, size_t) {
                      if (ec) return FailOut(out, "the connection ended: " + Why(ec));
                      ++out->item;
                      NextItem(out);
                    });
}

void Exchange::FailOut(OutStream* out, const std::string& why) {
  if (out->done) return;
  out->done = true;
  result_.send_failures[out->spec->peer.rank] = why;
  if (out->stream) {
    ErrorCode ignored;
    out->stream->lowest_layer().close(ignored);
  }
  MaybeFinished();
}

}  // namespace memoffload::client::link_internal
