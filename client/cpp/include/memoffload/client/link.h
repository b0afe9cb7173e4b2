// The link between the ranks of a job on several nodes: checkpoint bytes
// (replicas, fetched regions, a .metadata) from one rank to another, over
// TLS 1.3 (Boost.Asio's ssl::stream on OpenSSL 3) authenticated by the
// job's pre-shared key (an external PSK; AES-128-GCM with ECDHE): both
// sides prove the key, every byte is encrypted and authenticated, and
// there is no certificate, no home-made handshake and no cipher of ours.
// Inside, frames are typed and bounded (link_frames.h).
//
// One collective job (a save's replication, a load's fetch) is:
//   1. LinkListener::Listen on the rank's replication address (port 0): a
//      socket that accepts nothing yet;
//   2. the ranks tell each other (through the job's store, with a MAC under
//      the key) their address and port;
//   3. LinkExchange once or more: each rank connects to the peers it sends
//      to (from its replication address) and accepts the peers it expects,
//      and streams;
//   4. the listener is closed: it exists only while the job runs.
//
// What a stranger meets (docs/checkpoints.md): a connection from an address
// that is not one of the expected peers' is closed at accept; at most
// max_pending_handshakes connections may be in their handshake at once,
// each for handshake_timeout_ms (the TLS handshake and the peer's hello);
// a connection that does not prove the key fails the handshake; a hello
// that names a rank not expected now, another job's call or a second
// stream of a rank is dropped; a descriptor shortage at accept is counted
// and waited out, never fatal. Each is counted in LinkDropped.
#ifndef MEMOFFLOAD_CLIENT_LINK_H_
#define MEMOFFLOAD_CLIENT_LINK_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "memoffload/client/region_io.h"
#include "memoffload/common/status.h"

namespace memoffload::client {

struct LinkKey {
  std::string id;   // names the key in the TLS handshake (key rotation)
  std::string key;  // 32 bytes
};

struct LinkOptions {
  int32_t rank = -1;
  uint64_t call = 0;          // this collective's number: a peer's hello must name it
  std::vector<LinkKey> keys;  // keys[0] to connect with; every one accepted
  int handshake_timeout_ms = 2000;
  size_t max_pending_handshakes = 8;
  int io_timeout_ms = 600000;  // one exchange, at most
  uint64_t piece_bytes = 32ull << 20;
  // Tests only: every N-th piece sent is changed after its CRC32C was taken,
  // as a fault on the way would change it (0: never).
  uint32_t test_corrupt_every = 0;
};

struct LinkDropped {
  uint64_t not_a_peer = 0;   // from an address that is not an expected peer's
  uint64_t busy = 0;         // max_pending_handshakes were in their handshake
  uint64_t handshake = 0;    // failed or timed out in the TLS handshake
  uint64_t bad_hello = 0;    // no hello in time, or one not expected now
  uint64_t fd_shortage = 0;  // accept failed for want of descriptors
};

class LinkListener {
 public:
  // Binds a TCP socket to `address` (an IPv4 or IPv6 address, or a host
  // name resolving to one) on an ephemeral port and listens.
  static Result<std::unique_ptr<LinkListener>> Listen(const std::string& address,
                                                      const LinkOptions& options);
  ~LinkListener();
  LinkListener(const LinkListener&) = delete;
  LinkListener& operator=(const LinkListener&) = delete;

  uint16_t port() const { return port_; }
  const std::string& address() const { return address_; }  // numeric
  const LinkOptions& options() const { return options_; }
  LinkDropped dropped() const { return dropped_; }
  int fd() const { return fd_; }
  LinkDropped* mutable_dropped() { return &dropped_; }

 private:
  LinkListener() = default;
  int fd_ = -1;
  uint16_t port_ = 0;
  std::string address_;
  LinkOptions options_;
  LinkDropped dropped_;
};

struct LinkPeer {
  int32_t rank = -1;
  std::string host;  // numeric address
  uint16_t port = 0;
};

// A region to send or receive, by name, of size_bytes.
struct LinkRegion {
  std::string name;
  uint64_t size_bytes = 0;
};

// To one peer: these regions of the sending store (read with their checksums
// verified as they are read), then these blobs.
struct LinkSend {
  LinkPeer peer;
  std::vector<LinkRegion> regions;
  std::vector<std::string> blobs;
};

// From one peer: these regions, then blobs of at most these sizes.
struct LinkReceive {
  LinkPeer peer;
  std::vector<LinkRegion> regions;
  std::vector<uint64_t> blob_max_bytes;
};

// Where received regions go: into `store` (created with ttl_seconds, and
// committed once every piece arrived intact) or, when `memory` is set, into
// the memory it names for each region (size_bytes bytes, the caller's).
struct LinkSink {
  RegionStore* store = nullptr;
  double ttl_seconds = 0;
  std::function<uint8_t*(const std::string& name)> memory;
};

struct LinkResult {
  std::map<int32_t, std::string> send_failures;     // by peer rank: why its stream failed
  std::map<int32_t, std::string> receive_failures;  // likewise, for streams received
  // Every region received: "" when it arrived whole and intact (committed
  // into the store, or in memory), else why not.
  std::map<std::string, std::string> regions;
  std::map<int32_t, std::vector<std::string>> blobs;  // received, by peer rank
  std::vector<std::string> regions_committed;         // into the sink's store
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
};

// One exchange of `listener`'s job (see the top of the file): `seq` numbers
// the exchanges of the job (a connection of an earlier one is dropped).
// `source` is the store the sent regions are read from (null when none are
// sent). A failed stream is reported in the result, not as an error; the
// error is for what stops the whole exchange (bad arguments).
Result<LinkResult> LinkExchange(LinkListener* listener, uint32_t seq, RegionStore* source,
                                const std::vector<LinkSend>& sends,
                                const std::vector<LinkReceive>& receives, const LinkSink& sink);

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_LINK_H_
