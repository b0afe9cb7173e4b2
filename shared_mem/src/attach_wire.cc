#include "memoffload/shared_mem/attach_wire.h"

#include <algorithm>
#include <cstring>

namespace memoffload {
namespace {

enum class MessageType : uint8_t {
  kHello = 1,
  kAttachReply = 2,
  kChunkFdBatch = 3,
  kChunkRequest = 4,
  kChunkReply = 5,
  kLinkKeyRequest = 6,
  kLinkKeyReply = 7,
  kNotice = 8,
  kResume = 9,
};
// Header: magic (4), version (2), type (1).
constexpr size_t kTypeOffset = 6;

constexpr size_t kMaxChunks = 1 << 16;
constexpr size_t kMaxStringBytes = 4096;

class Writer {
 public:
  Writer(MessageType type, uint16_t version) {
    U32(kAttachMagic);
    U16(version);
    U8(static_cast<uint8_t>(type));
  }
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  std::string Take() { return std::move(out_); }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}

  // Reads and checks the header; returns the sender's version.
  Status Header(MessageType type, uint16_t* version) {
    uint32_t magic = 0;
    uint8_t t = 0;
    if (!U32(&magic) || magic != kAttachMagic) {
      return InvalidArgument("not a memoffload attach message (bad magic)");
    }
    if (!U16(version)) return Truncated();
    if (*version != kAttachProtocolVersion) {
      return InvalidArgument("attach protocol version " + std::to_string(*version) +
                             " is not supported; this side speaks version " +
                             std::to_string(kAttachProtocolVersion));
    }
    if (!U8(&t)) return Truncated();
    if (t != static_cast<uint8_t>(type)) {
      return InvalidArgument("unexpected attach message type " + std::to_string(t));
    }
    return Status::Ok();
  }
  bool U8(uint8_t* v) { return Le(v, 1); }
  bool U16(uint16_t* v) { return Le(v, 2); }
  bool U32(uint32_t* v) { return Le(v, 4); }
  bool U64(uint64_t* v) { return Le(v, 8); }
  bool I32(int32_t* v) {
    uint32_t u;
    if (!U32(&u)) return false;
    std::memcpy(v, &u, 4);
    return true;
  }
  bool Str(std::string* s, size_t max_bytes) {
    uint32_t n = 0;
    if (!U32(&n) || n > max_bytes || n > in_.size() - pos_) return false;
    s->assign(in_, pos_, n);
    pos_ += n;
    return true;
  }
  Status Finish() const {
    if (pos_ != in_.size()) return InvalidArgument("trailing bytes in attach message");
    return Status::Ok();
  }
  static Status Truncated() { return InvalidArgument("truncated or malformed attach message"); }

 private:
  template <typename T>
  bool Le(T* v, int n) {
    if (in_.size() - pos_ < static_cast<size_t>(n)) return false;
    uint64_t acc = 0;
    for (int i = 0; i < n; ++i) {
      acc |= static_cast<uint64_t>(static_cast<unsigned char>(in_[pos_ + i])) << (8 * i);
    }
    pos_ += n;
    *v = static_cast<T>(acc);
    return true;
  }
  const std::string& in_;
  size_t pos_ = 0;
};

bool PrintableAscii(const std::string& s) {
  for (unsigned char c : s) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

}  // namespace

const char* SessionKindName(SessionKind kind) {
  switch (kind) {
    case SessionKind::kOther:
      return "other";
    case SessionKind::kActivations:
      return "activations";
    case SessionKind::kState:
      return "state";
    case SessionKind::kCheckpoints:
      return "checkpoints";
  }
  return "unknown";
}

std::string EncodeHello(const Hello& hello) {
  Writer w(MessageType::kHello, hello.version);
  w.Str(hello.job_id);
  w.U32(static_cast<uint32_t>(hello.rank));
  w.U32(static_cast<uint32_t>(hello.local_rank));
  w.U64(hello.max_bytes);
  w.U64(hello.job_max_bytes);
  w.U8(static_cast<uint8_t>(hello.kind));
  return w.Take();
}

Result<Hello> DecodeHello(const std::string& bytes) {
  Reader r(bytes);
  Hello h;
  MEMOFFLOAD_RETURN_IF_ERROR(r.Header(MessageType::kHello, &h.version));
  if (!r.Str(&h.job_id, kMaxJobIdBytes)) {
    return InvalidArgument("hello: job id missing or longer than " +
                           std::to_string(kMaxJobIdBytes) + " bytes");
  }
  if (!PrintableAscii(h.job_id)) {
    return InvalidArgument("hello: job id must be printable ASCII");
  }
  uint8_t kind = 0;
  if (!r.I32(&h.rank) || !r.I32(&h.local_rank) || !r.U64(&h.max_bytes) ||
      !r.U64(&h.job_max_bytes) || !r.U8(&kind)) {
    return Reader::Truncated();
  }
  if (kind >= kSessionKindCount) {
    return InvalidArgument("hello: unknown session kind " + std::to_string(kind));
  }
  h.kind = static_cast<SessionKind>(kind);
  if (h.rank < -1 || h.local_rank < -1) {
    return InvalidArgument("hello: rank and local rank must be >= -1");
  }
  MEMOFFLOAD_RETURN_IF_ERROR(r.Finish());
  return h;
}

std::string EncodeResume(const Resume& resume) {
  Writer w(MessageType::kResume, kAttachProtocolVersion);
  w.U64(resume.session_id);
  w.Str(resume.session_token);
  return w.Take();
}

Result<Resume> DecodeResume(const std::string& bytes) {
  Reader r(bytes);
  uint16_t version = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(r.Header(MessageType::kResume, &version));
  Resume out;
  if (!r.U64(&out.session_id) || !r.Str(&out.session_token, kMaxStringBytes)) {
    return Reader::Truncated();
  }
  MEMOFFLOAD_RETURN_IF_ERROR(r.Finish());
  return out;
}

bool IsResume(const std::string& bytes) {
  return bytes.size() > kTypeOffset &&
         static_cast<uint8_t>(bytes[kTypeOffset]) == static_cast<uint8_t>(MessageType::kResume);
}

std::string EncodeAttachReply(const AttachReply& reply) {
  Writer w(MessageType::kAttachReply, reply.version);
  w.U32(static_cast<uint32_t>(reply.code));
  w.Str(reply.message);
  w.U64(reply.session_id);
  w.Str(reply.session_token);
  w.Str(reply.grpc_socket);
  w.U64(reply.page_bytes);
  w.U64(reply.session_limit_bytes);
  w.U32(static_cast<uint32_t>(reply.chunks.size()));
  for (const ChunkInfo& c : reply.chunks) {
    w.U32(c.index);
    w.U64(c.size_bytes);
  }
  w.U32(reply.fd_frames);
  w.U64(reply.instance_id);
  return w.Take();
}

Result<AttachReply> DecodeAttachReply(const std::string& bytes) {
  Reader r(bytes);
  AttachReply a;
  MEMOFFLOAD_RETURN_IF_ERROR(r.Header(MessageType::kAttachReply, &a.version));
  uint32_t code = 0, chunks = 0;
  if (!r.U32(&code) || code > static_cast<uint32_t>(StatusCode::kUnauthenticated) ||
      !r.Str(&a.message, kMaxStringBytes) || !r.U64(&a.session_id) ||
      !r.Str(&a.session_token, kMaxStringBytes) || !r.Str(&a.grpc_socket, kMaxStringBytes) ||
      !r.U64(&a.page_bytes) || !r.U64(&a.session_limit_bytes) || !r.U32(&chunks) ||
      chunks > kMaxChunks) {
    return Reader::Truncated();
  }
  a.code = static_cast<StatusCode>(code);
  a.chunks.resize(chunks);
  for (ChunkInfo& c : a.chunks) {
    if (!r.U32(&c.index) || !r.U64(&c.size_bytes)) return Reader::Truncated();
  }
  if (!r.U32(&a.fd_frames) || !r.U64(&a.instance_id)) return Reader::Truncated();
  MEMOFFLOAD_RETURN_IF_ERROR(r.Finish());
  return a;
}

std::string EncodeChunkFdBatch(const ChunkFdBatch& batch) {
  Writer w(MessageType::kChunkFdBatch, kAttachProtocolVersion);
  w.U32(static_cast<uint32_t>(batch.chunk_indexes.size()));
  for (size_t i = 0; i < batch.chunk_indexes.size(); ++i) {
    w.U32(batch.chunk_indexes[i]);
    w.U64(i < batch.generations.size() ? batch.generations[i] : 0);
  }
  return w.Take();
}

Result<ChunkFdBatch> DecodeChunkFdBatch(const std::string& bytes) {
  Reader r(bytes);
  ChunkFdBatch b;
  uint16_t version = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(r.Header(MessageType::kChunkFdBatch, &version));
  uint32_t n = 0;
  if (!r.U32(&n) || n > kMaxChunks) return Reader::Truncated();
  b.chunk_indexes.resize(n);
  b.generations.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    if (!r.U32(&b.chunk_indexes[i]) || !r.U64(&b.generations[i])) return Reader::Truncated();
  }
  MEMOFFLOAD_RETURN_IF_ERROR(r.Finish());
  return b;
}

namespace {

void WriteIndexes(Writer* w, const std::vector<uint32_t>& indexes) {
  w->U32(static_cast<uint32_t>(indexes.size()));
  for (uint32_t i : indexes) w->U32(i);
}

bool ReadIndexes(Reader* r, std::vector<uint32_t>* indexes) {
  uint32_t n = 0;
  if (!r->U32(&n) || n > kMaxChunks) return false;
  indexes->resize(n);
  for (uint32_t& i : *indexes) {
    if (!r->U32(&i)) return false;
  }
  return true;
}

}  // namespace

std::string EncodeChunkRequest(const ChunkRequest& request) {
  Writer w(MessageType::kChunkRequest, kAttachProtocolVersion);
  WriteIndexes(&w, request.chunk_indexes);
  return w.Take();
}

Result<ChunkRequest> DecodeChunkRequest(const std::string& bytes) {
  Reader r(bytes);
  ChunkRequest req;
  uint16_t version = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(r.Header(MessageType::kChunkRequest, &version));
  if (!ReadIndexes(&r, &req.chunk_indexes)) return Reader::Truncated();
  MEMOFFLOAD_RETURN_IF_ERROR(r.Finish());
  return req;
}

std::string EncodeChunkReply(const ChunkReply& reply) {
  Writer w(MessageType::kChunkReply, kAttachProtocolVersion);
  w.U32(static_cast<uint32_t>(reply.code));
  w.Str(reply.message);
  WriteIndexes(&w, reply.chunk_indexes);
  for (size_t i = 0; i < reply.chunk_indexes.size(); ++i) {
    w.U64(i < reply.generations.size() ? reply.generations[i] : 0);
  }
  return w.Take();
}

Result<ChunkReply> DecodeChunkReply(const std::string& bytes) {
  Reader r(bytes);
  ChunkReply reply;
  uint16_t version = 0;
  uint32_t code = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(r.Header(MessageType::kChunkReply, &version));
  if (!r.U32(&code) || code > static_cast<uint32_t>(StatusCode::kUnauthenticated) ||
      !r.Str(&reply.message, kMaxStringBytes) || !ReadIndexes(&r, &reply.chunk_indexes)) {
    return Reader::Truncated();
  }
  reply.generations.resize(reply.chunk_indexes.size());
  for (uint64_t& g : reply.generations) {
    if (!r.U64(&g)) return Reader::Truncated();
  }
  reply.code = static_cast<StatusCode>(code);
  MEMOFFLOAD_RETURN_IF_ERROR(r.Finish());
  return reply;
}

std::string EncodeLinkKeyRequest(const LinkKeyRequest&) {
  Writer w(MessageType::kLinkKeyRequest, kAttachProtocolVersion);
  return w.Take();
}

Result<LinkKeyRequest> DecodeLinkKeyRequest(const std::string& bytes) {
  Reader r(bytes);
  uint16_t version = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(r.Header(MessageType::kLinkKeyRequest, &version));
  MEMOFFLOAD_RETURN_IF_ERROR(r.Finish());
  return LinkKeyRequest{};
}

std::string EncodeLinkKeyReply(const LinkKeyReply& reply) {
  Writer w(MessageType::kLinkKeyReply, kAttachProtocolVersion);
  w.U32(static_cast<uint32_t>(reply.code));
  w.Str(reply.message);
  const size_t n = std::min(reply.key_ids.size(), reply.keys.size());
  w.U32(static_cast<uint32_t>(n));
  for (size_t i = 0; i < n; ++i) {
    w.Str(reply.key_ids[i]);
    w.Str(reply.keys[i]);
  }
  return w.Take();
}

Result<LinkKeyReply> DecodeLinkKeyReply(const std::string& bytes) {
  Reader r(bytes);
  LinkKeyReply reply;
  uint16_t version = 0;
  uint32_t code = 0;
  uint32_t n = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(r.Header(MessageType::kLinkKeyReply, &version));
  if (!r.U32(&code) || code > static_cast<uint32_t>(StatusCode::kUnauthenticated) ||
      !r.Str(&reply.message, kMaxStringBytes) || !r.U32(&n) || n > kMaxLinkKeys) {
    return Reader::Truncated();
  }
  reply.key_ids.resize(n);
  reply.keys.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    if (!r.Str(&reply.key_ids[i], 64) || !r.Str(&reply.keys[i], 64)) return Reader::Truncated();
  }
  reply.code = static_cast<StatusCode>(code);
  MEMOFFLOAD_RETURN_IF_ERROR(r.Finish());
  return reply;
}

std::string EncodeNotice(const Notice& notice) {
  Writer w(MessageType::kNotice, kAttachProtocolVersion);
  w.U8(static_cast<uint8_t>(notice.kind));
  w.Str(notice.message);
  return w.Take();
}

Result<Notice> DecodeNotice(const std::string& bytes) {
  Reader r(bytes);
  Notice notice;
  uint16_t version = 0;
  uint8_t kind = 0;
  MEMOFFLOAD_RETURN_IF_ERROR(r.Header(MessageType::kNotice, &version));
  if (!r.U8(&kind) || !r.Str(&notice.message, kMaxStringBytes)) return Reader::Truncated();
  if (kind != static_cast<uint8_t>(NoticeKind::kLeave) &&
      kind != static_cast<uint8_t>(NoticeKind::kResume)) {
    return InvalidArgument("unknown notice kind " + std::to_string(kind));
  }
  notice.kind = static_cast<NoticeKind>(kind);
  MEMOFFLOAD_RETURN_IF_ERROR(r.Finish());
  return notice;
}

bool IsNotice(const std::string& bytes) {
  return bytes.size() > kTypeOffset &&
         static_cast<uint8_t>(bytes[kTypeOffset]) == static_cast<uint8_t>(MessageType::kNotice);
}

bool IsLinkKeyRequest(const std::string& bytes) {
  return bytes.size() > kTypeOffset && static_cast<uint8_t>(bytes[kTypeOffset]) ==
                                           static_cast<uint8_t>(MessageType::kLinkKeyRequest);
}

}  // namespace memoffload
