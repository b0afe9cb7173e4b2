// The state of one LinkExchange (link.h), internal to the client library:
// one io_context run on the calling thread, with every stream of the
// exchange on it (the sends, the accepts and the receives), so that a rank
// sends and receives at once without threads of its own. A stream is one
// TLS connection used in one direction: the connecting side writes, the
// accepting side reads. link.cc runs the whole, link_receive.cc accepts and
// reads, link_send.cc connects and writes.
#ifndef MEMOFFLOAD_CLIENT_SRC_LINK_EXCHANGE_H_
#define MEMOFFLOAD_CLIENT_SRC_LINK_EXCHANGE_H_

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "link_tls.h"
#include "memoffload/client/link.h"
#include "memoffload/client/link_frames.h"
#include "memoffload/client/region_io.h"

namespace memoffload::client::link_internal {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using SslStream = asio::ssl::stream<tcp::socket>;
using ErrorCode = boost::system::error_code;

// A peer not yet connected is tried again this often until the deadline.
constexpr std::chrono::milliseconds kRetryDelay{200};

// `host` as an address: itself when numeric, else its first resolution.
Result<asio::ip::address> ParseAddress(const std::string& host);
std::string Why(const ErrorCode& ec);

// One stream this rank sends on.
struct OutStream {
  const LinkSend* spec = nullptr;
  std::unique_ptr<SslStream> stream;
  std::unique_ptr<asio::steady_timer> retry;
  size_t item = 0;      // regions first, then blobs
  uint64_t offset = 0;  // within the current item
  bool item_open = false;
  std::unique_ptr<RegionReader> reader;
  std::vector<ArenaSpan> spans;  // the piece being written, where it lies in the arena
  std::string head;              // a frame header (and piece header) being written
  std::vector<uint8_t> buf;
  std::string failure;
  bool done = false;
  int attempts = 0;
};

// One stream this rank receives on, once its peer connected and said hello.
struct InStream {
  const LinkReceive* spec = nullptr;
  std::unique_ptr<SslStream> stream;
  std::unique_ptr<LinkStreamCheck> check;
  unsigned char header[kLinkFrameHeaderBytes] = {};
  unsigned char piece_header[kLinkPieceHeaderBytes] = {};
  std::string payload;
  std::vector<uint8_t> buf;
  // The current item's sink and state.
  std::unique_ptr<RegionWriter> writer;
  std::vector<ArenaSpan> spans;  // where the piece being read lands in the region
  uint8_t* memory = nullptr;
  std::string blob;
  std::string item_problem;  // why the current item will not be kept ("" while fine)
  bool item_open = false;
  bool connected = false;
  bool done = false;
  std::string failure;
};

// A connection accepted and not yet known to be an expected peer's.
struct Pending {
  explicit Pending(asio::io_context& io, asio::ssl::context& ctx)
      : stream(std::make_unique<SslStream>(tcp::socket(io), ctx)), timer(io) {}
  std::unique_ptr<SslStream> stream;
  asio::steady_timer timer;
  unsigned char header[kLinkFrameHeaderBytes] = {};
  std::string payload;
  bool settled = false;
};
class Exchange {
 public:
  Exchange(LinkListener* listener, uint32_t seq, RegionStore* source,
           const std::vector<LinkSend>& sends, const std::vector<LinkReceive>& receives,
           const LinkSink& sink)
      : listener_(listener),
        options_(listener->options()),
        seq_(seq),
        source_(source),
        sink_(sink),
        acceptor_(io_),
        deadline_(io_) {
    for (const LinkSend& s : sends) {
      auto out = std::make_unique<OutStream>();
      out->spec = &s;
      outs_.push_back(std::move(out));
    }
    for (const LinkReceive& r : receives) {
      auto in = std::make_unique<InStream>();
      in->spec = &r;
      ins_[r.peer.rank] = std::move(in);
    }
  }

  Result<LinkResult> Run();

 private:
  // accepting (link_receive.cc)
  Status StartAccepting();
  void Accept();
  void Admit(const std::shared_ptr<Pending>& pending);
  void OnHello(const std::shared_ptr<Pending>& pending, const ErrorCode& ec);
  void Settle(const std::shared_ptr<Pending>& pending, InStream* in);
  // receiving (link_receive.cc)
  void ReadFrame(InStream* in);
  void ReadPayload(InStream* in, uint32_t length, LinkFrameType type);
  void OnItem(InStream* in);
  void ReadPiece(InStream* in, uint64_t length);
  void ReadBlob(InStream* in, uint32_t length);
  void OnEnd(InStream* in);
  void CloseItem(InStream* in);
  void FailIn(InStream* in, const std::string& why);
  // sending (link_send.cc)
  void Connect(OutStream* out);
  void RetryOut(OutStream* out, const std::string& why);
  void NextItem(OutStream* out);
  void NextPiece(OutStream* out);
  void NextBlobPart(OutStream* out);
  void SendFail(OutStream* out, const std::string& why);
  void FailOut(OutStream* out, const std::string& why);
  // the whole (link.cc)
  void TimedOut();
  void MaybeFinished();
  void Finish();

  LinkListener* listener_;
  const LinkOptions options_;
  const uint32_t seq_;
  RegionStore* source_;
  const LinkSink sink_;
  asio::io_context io_;
  std::unique_ptr<LinkTlsContext> client_;
  std::unique_ptr<LinkTlsContext> server_;
  tcp::acceptor acceptor_;
  asio::steady_timer deadline_;
  std::unique_ptr<asio::steady_timer> accept_retry_;
  std::set<asio::ip::address> allowed_;
  asio::ip::address local_;
  size_t pending_ = 0;
  uint64_t pieces_sent_ = 0;
  bool finished_ = false;
  std::vector<std::unique_ptr<OutStream>> outs_;
  std::map<int32_t, std::unique_ptr<InStream>> ins_;
  LinkResult result_;
};

}  // namespace memoffload::client::link_internal

#endif  // MEMOFFLOAD_CLIENT_SRC_LINK_EXCHANGE_H_
