// TLS 1.3 with an external pre-shared key for the link between nodes
// (internal to the client library; link.h says what it is for).
//
// Both contexts speak TLS 1.3 only, with TLS_AES_128_GCM_SHA256, no
// certificates and no session tickets. The client offers the PSK of
// keys[0] under the identity "memoffload-link-v1/<key id>"; the server
// accepts an identity naming any of its keys and has nothing else to offer
// (no certificate), so a peer without a key cannot complete a handshake.
// OpenSSL's psk_dhe_ke mode adds an ECDHE exchange (forward secrecy).
#ifndef MEMOFFLOAD_CLIENT_SRC_LINK_TLS_H_
#define MEMOFFLOAD_CLIENT_SRC_LINK_TLS_H_

#include <boost/asio/ssl/context.hpp>
#include <memory>
#include <string>
#include <vector>

#include "memoffload/client/link.h"
#include "memoffload/common/status.h"

namespace memoffload::client {

inline constexpr char kLinkPskIdentityPrefix[] = "memoffload-link-v1/";

class LinkTlsContext {
 public:
  enum class Role { kClient, kServer };
  static Result<std::unique_ptr<LinkTlsContext>> Make(Role role, std::vector<LinkKey> keys);
  ~LinkTlsContext();
  LinkTlsContext(const LinkTlsContext&) = delete;
  LinkTlsContext& operator=(const LinkTlsContext&) = delete;

  boost::asio::ssl::context& context() { return *context_; }
  // The key whose identity is `identity` (any of this context's keys), or null.
  const LinkKey* Find(const std::string& identity) const;
  const LinkKey& first() const { return keys_.front(); }
  // The identity the client offers (keys[0]'s).
  const std::string& identity() const { return identity_; }

 private:
  LinkTlsContext() = default;
  std::unique_ptr<boost::asio::ssl::context> context_;
  std::vector<LinkKey> keys_;
  std::string identity_;
};

// "memoffload-link-v1/<id>".
std::string LinkPskIdentity(const LinkKey& key);
// OpenSSL's error queue as text (emptied), for messages.
std::string TakeOpenSslErrors();

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_SRC_LINK_TLS_H_
