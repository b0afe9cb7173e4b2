#include "link_tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>

namespace memoffload::client {
namespace {

constexpr char kCipherSuite[] = "TLS_AES_128_GCM_SHA256";
// TLS_AES_128_GCM_SHA256's id (RFC 8446, B.4).
constexpr unsigned char kCipherId[2] = {0x13, 0x01};
// Where a context's LinkTlsContext is kept (SSL_CTX ex data).
int ContextIndex() {
  static const int index = SSL_CTX_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

const LinkTlsContext* Owner(SSL* ssl) {
  return static_cast<const LinkTlsContext*>(
      SSL_CTX_get_ex_data(SSL_get_SSL_CTX(ssl), ContextIndex()));
}

// A session that carries `key` as its resumption secret: how OpenSSL takes
// an external PSK for TLS 1.3 (the session is the caller's to free).
SSL_SESSION* PskSession(SSL* ssl, const LinkKey& key) {
  const SSL_CIPHER* cipher = SSL_CIPHER_find(ssl, kCipherId);
  if (cipher == nullptr) return nullptr;
  SSL_SESSION* session = SSL_SESSION_new();
  if (session == nullptr) return nullptr;
  if (SSL_SESSION_set1_master_key(session, reinterpret_cast<const unsigned char*>(key.key.data()),
                                  key.key.size()) != 1 ||
      SSL_SESSION_set_cipher(session, cipher) != 1 ||
      SSL_SESSION_set_protocol_version(session, TLS1_3_VERSION) != 1) {
    SSL_SESSION_free(session);
    return nullptr;
  }
  return session;
}

// Client: offer keys[0].
int UsePsk(SSL* ssl, const EVP_MD* md, const unsigned char** id, size_t* id_len,
           SSL_SESSION** session) {
  const LinkTlsContext* owner = Owner(ssl);
  *session = nullptr;
  if (owner == nullptr) return 0;
  SSL_SESSION* s = PskSession(ssl, owner->first());
  if (s == nullptr) return 0;
  if (md != nullptr && md != SSL_CIPHER_get_handshake_digest(SSL_SESSION_get0_cipher(s))) {
    SSL_SESSION_free(s);  // a retry with another hash: we have none
    return 1;
  }
  // The identity outlives the handshake: the context's own.
  *id = reinterpret_cast<const unsigned char*>(owner->identity().data());
  *id_len = owner->identity().size();
  *session = s;
  return 1;
}

// Server: a key named by the client's identity, or none (the handshake then
// fails: the server has no certificate to fall back on).
int FindPsk(SSL* ssl, const unsigned char* identity, size_t identity_len, SSL_SESSION** session) {
  *session = nullptr;
  const LinkTlsContext* owner = Owner(ssl);
  if (owner == nullptr) return 0;
  const LinkKey* key =
      owner->Find(std::string(reinterpret_cast<const char*>(identity), identity_len));
  if (key == nullptr) return 1;
  *session = PskSession(ssl, *key);
  return *session != nullptr ? 1 : 0;
}

}  // namespace

std::string LinkPskIdentity(const LinkKey& key) { return kLinkPskIdentityPrefix + key.id; }

std::string TakeOpenSslErrors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    out += (out.empty() ? "" : "; ") + std::string(buf);
  }
  return out;
}

Result<std::unique_ptr<LinkTlsContext>> LinkTlsContext::Make(Role role, std::vector<LinkKey> keys) {
  if (keys.empty()) return InvalidArgument("the link needs a key");
  for (const LinkKey& k : keys) {
    if (k.key.size() != 32) return InvalidArgument("a link key must be 32 bytes");
  }
  std::unique_ptr<LinkTlsContext> out(new LinkTlsContext());
  out->keys_ = std::move(keys);
  out->identity_ = LinkPskIdentity(out->keys_.front());
  namespace ssl = boost::asio::ssl;
  out->context_ = std::make_unique<ssl::context>(role == Role::kClient ? ssl::context::tls_client
                                                                       : ssl::context::tls_server);
  SSL_CTX* ctx = out->context_->native_handle();
  if (SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_max_proto_version(ctx, TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_ciphersuites(ctx, kCipherSuite) != 1) {
    return Internal("cannot configure TLS 1.3 for the link: " + TakeOpenSslErrors());
  }
  SSL_CTX_set_options(ctx, SSL_OP_NO_TICKET);
  SSL_CTX_set_num_tickets(ctx, 0);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, nullptr);
  SSL_CTX_set_ex_data(ctx, ContextIndex(), out.get());
  if (role == Role::kClient) {
    SSL_CTX_set_psk_use_session_callback(ctx, UsePsk);
  } else {
    SSL_CTX_set_psk_find_session_callback(ctx, FindPsk);
  }
  return out;
}

LinkTlsContext::~LinkTlsContext() {
  if (context_ != nullptr) SSL_CTX_set_ex_data(context_->native_handle(), ContextIndex(), nullptr);
}

const LinkKey* LinkTlsContext::Find(const std::string& identity) const {
  for (const LinkKey& k : keys_) {
    if (identity == LinkPskIdentity(k)) return &k;
  }
  return nullptr;
}

}  // namespace memoffload::client
