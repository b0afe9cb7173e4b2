// memoffload-bench streams: the baselines of the link between nodes
// (bench/node_safe_bench.py): plain streams of the same bytes between the
// same addresses as a replication, without our frames, checksums or
// daemons. One "rank" per stream pair, as the link's: each rank listens on
// its address, accepts one stream from its source and sends one to its
// buddy (the same local rank on the other address), both at once on one
// io_context, from memory into memory. `tls`: TLS 1.3 with a pre-shared key
// and TLS_AES_128_GCM_SHA256, the link's own context (link_tls.h); `tcp`:
// the same over plain TCP. Each round's time runs from the first connect
// (every listener up) to the last byte of the slowest rank, handshakes
// included, as the link's exchange is timed.
//
//   memoffload-bench streams --kind tls|tcp --addresses A,B --per-address 2
//       --bytes N [--piece 32MiB] [--rounds 3]
// prints one JSON object: {"kind", "bytes_per_stream", "streams", "seconds": [...]}.
#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "benches.h"
#include "link_tls.h"
#include "memoffload/common/units.h"

namespace memoffload::bench {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using ErrorCode = boost::system::error_code;

struct Options {
  std::string kind = "tls";
  std::vector<std::string> addresses;
  int per_address = 2;
  uint64_t bytes = 64ull << 20;
  uint64_t piece = 32ull << 20;
  int rounds = 3;
};

// One rank: its listener, what it sends and where it receives.
struct Rank {
  std::string address;
  std::unique_ptr<asio::io_context> io;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::vector<uint8_t> out, in;
  uint16_t port = 0;
  std::string error;
};

template <typename Stream>
void SendAll(Stream* s, const std::vector<uint8_t>& out, uint64_t piece, uint64_t at,
             std::function<void(const ErrorCode&)> done) {
  if (at >= out.size()) return done({});
  const uint64_t n = std::min<uint64_t>(piece, out.size() - at);
  asio::async_write(*s, asio::buffer(out.data() + at, n),
                    [s, &out, piece, at, n, done](const ErrorCode& ec, size_t) {
                      if (ec) return done(ec);
                      SendAll(s, out, piece, at + n, done);
                    });
}

template <typename Stream>
void ReceiveAll(Stream* s, std::vector<uint8_t>* in, uint64_t piece, uint64_t at,
                std::function<void(const ErrorCode&)> done) {
  if (at >= in->size()) return done({});
  const uint64_t n = std::min<uint64_t>(piece, in->size() - at);
  asio::async_read(*s, asio::buffer(in->data() + at, n),
                   [s, in, piece, at, n, done](const ErrorCode& ec, size_t) {
                     if (ec) return done(ec);
                     ReceiveAll(s, in, piece, at + n, done);
                   });
}

// One round of rank `me`: accept from anyone, send to `to`.
void RunRank(Rank* me, const Rank& to, const Options& o, client::LinkTlsContext* server,
             client::LinkTlsContext* client) {
  asio::io_context& io = *me->io;
  io.restart();
  auto fail = [me](const std::string& what, const ErrorCode& ec) {
    if (ec && me->error.empty()) me->error = what + ": " + ec.message();
  };
  const tcp::endpoint local(asio::ip::make_address(me->address), 0);
  const tcp::endpoint remote(asio::ip::make_address(to.address), to.port);
  if (o.kind == "tls") {
    auto in = std::make_shared<asio::ssl::stream<tcp::socket>>(tcp::socket(io), server->context());
    auto out = std::make_shared<asio::ssl::stream<tcp::socket>>(tcp::socket(io), client->context());
    me->acceptor->async_accept(in->lowest_layer(), [=](const ErrorCode& ec) {
      if (ec) return fail("accept", ec);
      in->async_handshake(asio::ssl::stream_base::server, [=](const ErrorCode& e) {
        if (e) return fail("server handshake", e);
        ReceiveAll(in.get(), &me->in, o.piece, 0, [=](const ErrorCode& e2) { fail("read", e2); });
      });
    });
    out->lowest_layer().open(tcp::v4());
    out->lowest_layer().bind(local);
    out->lowest_layer().async_connect(remote, [=](const ErrorCode& ec) {
      if (ec) return fail("connect", ec);
      out->async_handshake(asio::ssl::stream_base::client, [=](const ErrorCode& e) {
        if (e) return fail("client handshake", e);
        SendAll(out.get(), me->out, o.piece, 0, [=](const ErrorCode& e2) {
          fail("write", e2);
          ErrorCode ignored;
          out->lowest_layer().shutdown(tcp::socket::shutdown_send, ignored);
        });
      });
    });
    io.run();
  } else {
    auto in = std::make_shared<tcp::socket>(io);
    auto out = std::make_shared<tcp::socket>(io);
    me->acceptor->async_accept(*in, [=](const ErrorCode& ec) {
      if (ec) return fail("accept", ec);
      ReceiveAll(in.get(), &me->in, o.piece, 0, [=](const ErrorCode& e2) { fail("read", e2); });
    });
    out->open(tcp::v4());
    out->bind(local);
    out->async_connect(remote, [=](const ErrorCode& ec) {
      if (ec) return fail("connect", ec);
      SendAll(out.get(), me->out, o.piece, 0, [=](const ErrorCode& e2) { fail("write", e2); });
    });
    io.run();
  }
}

bool Parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--kind" && has) {
      o->kind = argv[++i];
    } else if (a == "--addresses" && has) {
      std::string list = argv[++i];
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        o->addresses.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    } else if (a == "--per-address" && has) {
      o->per_address = std::stoi(argv[++i]);
    } else if ((a == "--bytes" || a == "--piece") && has) {
      Result<uint64_t> n = ParseSize(argv[++i]);
      if (!n.ok()) return false;
      (a == "--bytes" ? o->bytes : o->piece) = *n;
    } else if (a == "--rounds" && has) {
      o->rounds = std::stoi(argv[++i]);
    } else {
      return false;
    }
  }
  return (o->kind == "tls" || o->kind == "tcp") && o->addresses.size() >= 2 && o->per_address > 0 &&
         o->bytes > 0 && o->piece > 0 && o->rounds > 0;
}

}  // namespace

int RunStreamBench(int argc, char** argv) {
  Options o;
  if (!Parse(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: memoffload-bench streams --kind tls|tcp --addresses A,B "
                 "[--per-address 2] [--bytes 64MiB] [--piece 32MiB] [--rounds 3]\n");
    return 2;
  }
  const client::LinkKey key{"bench", std::string(32, 'k')};
  auto server = client::LinkTlsContext::Make(client::LinkTlsContext::Role::kServer, {key});
  auto client = client::LinkTlsContext::Make(client::LinkTlsContext::Role::kClient, {key});
  if (!server.ok() || !client.ok()) {
    std::fprintf(stderr, "streams: %s\n",
                 (server.ok() ? client.status() : server.status()).ToString().c_str());
    return 1;
  }
  std::vector<Rank> ranks(o.addresses.size() * static_cast<size_t>(o.per_address));
  std::mt19937_64 rng(7);
  for (size_t r = 0; r < ranks.size(); ++r) {
    Rank& k = ranks[r];
    k.address = o.addresses[r / static_cast<size_t>(o.per_address)];
    k.io = std::make_unique<asio::io_context>();
    k.acceptor =
        std::make_unique<tcp::acceptor>(*k.io, tcp::endpoint(asio::ip::make_address(k.address), 0));
    k.port = k.acceptor->local_endpoint().port();
    k.out.resize(o.bytes);
    for (size_t i = 0; i + 8 <= k.out.size(); i += 8) {
      const uint64_t v = rng();
      std::memcpy(&k.out[i], &v, 8);
    }
    k.in.assign(o.bytes, 1);  // faulted in before timing
  }
  std::vector<double> seconds;
  for (int round = 0; round < o.rounds; ++round) {
    const auto start = Clock::now();
    std::vector<std::thread> threads;
    for (size_t r = 0; r < ranks.size(); ++r) {
      // The buddy: the same local index on the next address.
      const size_t to = (r + static_cast<size_t>(o.per_address)) % ranks.size();
      threads.emplace_back(RunRank, &ranks[r], std::cref(ranks[to]), std::cref(o), server->get(),
                           client->get());
    }
    for (auto& t : threads) t.join();
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    for (size_t r = 0; r < ranks.size(); ++r) {
      const size_t from = (r + ranks.size() - static_cast<size_t>(o.per_address)) % ranks.size();
      if (!ranks[r].error.empty() || ranks[r].in != ranks[from].out) {
        std::fprintf(stderr, "streams: rank %zu: %s\n", r,
                     ranks[r].error.empty() ? "received bytes differ" : ranks[r].error.c_str());
        return 1;
      }
    }
  }
  std::printf("{\"kind\": \"%s\", \"bytes_per_stream\": %llu, \"streams\": %zu, \"seconds\": [",
              o.kind.c_str(), static_cast<unsigned long long>(o.bytes), ranks.size());
  for (size_t i = 0; i < seconds.size(); ++i) std::printf("%s%.6f", i ? ", " : "", seconds[i]);
  std::printf("]}\n");
  return 0;
}

}  // namespace memoffload::bench
