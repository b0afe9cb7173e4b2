// The broker's attach protocol: what a client sends and what it gets back.
//
// Versioned binary encoding (little-endian integers, u32-length-prefixed
// strings), carried in frames (fd_passing.h). Exchange:
//   client -> daemon: Hello
//   daemon -> client: AttachReply (status; on success the session and the
//                     chunk table), then reply.fd_frames ChunkFdBatch frames,
//                     each carrying the fds of the chunks it lists.
// The connection then stays open as the session's lifeline: when it closes,
// the daemon reclaims everything the session holds.
//
// A session a take-over handed to a new daemon is resumed instead: the
// client, whose lifeline closed, connects again and sends a Resume (its
// session id and token) in place of the Hello; the daemon answers as for an
// attach when the connection's peer is the session's own process (uid and
// pid, SO_PEERCRED), never on the token alone.
//
// Decoders accept arbitrary bytes: anything malformed is INVALID_ARGUMENT,
// never a crash. Unknown trailing bytes are rejected.
#ifndef MEMOFFLOAD_SHARED_MEM_ATTACH_WIRE_H_
#define MEMOFFLOAD_SHARED_MEM_ATTACH_WIRE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload {

inline constexpr uint32_t kAttachMagic = 0x4c464f4d;  // "MOFL"
// Version 2: chunk fds carry the generation of their backing, and the
// attach reply the daemon's instance id. Version 3: the hello says what the
// session is for (SessionKind), and the daemon may send a Notice on the
// lifeline between replies.
inline constexpr uint16_t kAttachProtocolVersion = 3;
inline constexpr size_t kMaxJobIdBytes = 128;

// What a session is for: shown by `memoffloadctl sessions`, counted apart in
// status and metrics, and the state kind has its own share of a job's limit
// (quotas.state_share) and is asked to leave when the daemon drains.
enum class SessionKind : uint8_t {
  kOther = 0,        // a client that does not say (tools, benches)
  kActivations = 1,  // groups offloaded and fetched back (memoffload.torch offload)
  kState = 2,        // long-lived placed blocks (place_state)
  kCheckpoints = 3,  // checkpoint regions (memoffload.torch.checkpoint)
};
inline constexpr uint8_t kSessionKindCount = 4;
// "other", "activations", "state", "checkpoints".
const char* SessionKindName(SessionKind kind);

struct Hello {
  uint16_t version = kAttachProtocolVersion;
  std::string job_id;          // free text, <= kMaxJobIdBytes, printable ASCII
  int32_t rank = -1;           // global rank, -1 when unknown
  int32_t local_rank = -1;     // rank on this node, -1 when unknown
  uint64_t max_bytes = 0;      // session asks for a lower byte limit; 0: default
  uint64_t job_max_bytes = 0;  // job asks for a lower byte limit; 0: default
  SessionKind kind = SessionKind::kOther;
};

// Sent in place of a Hello, to resume a session a take-over handed on.
struct Resume {
  uint64_t session_id = 0;
  std::string session_token;
};

// The start of every UNAVAILABLE a daemon answers while it hands the node to
// a new daemon (memoffloadd --take-over), and of the new daemon's answer to a
// session not resumed yet: the client waits, resumes its session once its
// lifeline closes, and sends the call again (nothing was done).
inline constexpr char kTakeoverPause[] = "memoffloadd is handing the node to a new daemon";
// How long a serving daemon stays frozen for a take-over at most (the new
// daemon builds its arena meanwhile; past it the old one serves on), and so
// how long a client's call waits through one.
inline constexpr int kTakeoverPauseMaxMs = 300000;

struct ChunkInfo {
  uint32_t index = 0;
  uint64_t size_bytes = 0;
};

struct AttachReply {
  uint16_t version = kAttachProtocolVersion;
  StatusCode code = StatusCode::kOk;
  std::string message;  // why the attach was refused, or a notice
  uint64_t session_id = 0;
  std::string session_token;  // secret; sent with every gRPC request
  std::string grpc_socket;    // absolute path of the gRPC Unix socket
  uint64_t page_bytes = 0;    // allocation granularity
  uint64_t session_limit_bytes = 0;
  std::vector<ChunkInfo> chunks;
  uint32_t fd_frames = 0;  // ChunkFdBatch frames that follow
  // Random at each daemon start: a client that attaches again can tell a
  // restarted daemon (new instance id) from a reclaimed session (same one).
  uint64_t instance_id = 0;
};

// A chunk's backing (its memfd) is replaced when the chunk changes tenant;
// each backing of a chunk has its own generation within one daemon instance.
// A mapping is the current one for a chunk only when (instance_id, chunk,
// generation) all match: a client never uses a mapping of another generation
// for a new grant.

struct ChunkFdBatch {
  std::vector<uint32_t> chunk_indexes;  // one per fd, in order
  std::vector<uint64_t> generations;    // one per fd: generation of its backing
};

// After attach, a client asks for the fds of chunks its reservations landed
// in (chunks are handed out per tenant, on demand). The daemon answers with
// a ChunkReply carrying the fds, or a refusal and none.
struct ChunkRequest {
  std::vector<uint32_t> chunk_indexes;
};

struct ChunkReply {
  StatusCode code = StatusCode::kOk;
  std::string message;
  std::vector<uint32_t> chunk_indexes;  // one per fd, in order
  std::vector<uint64_t> generations;    // one per fd: generation of its backing
};

// A session asks for its job's replication keys (checkpoints across nodes):
// the daemon derives them from its secret for the connection's uid
// (SO_PEERCRED) and the hello's job id. Never sent over gRPC.
struct LinkKeyRequest {};

struct LinkKeyReply {
  StatusCode code = StatusCode::kOk;
  std::string message;
  std::vector<std::string> key_ids;  // the first is the one to connect with
  std::vector<std::string> keys;     // raw bytes, one per id
};
inline constexpr size_t kMaxLinkKeys = 8;

// The daemon -> client message that may come on the lifeline at any time
// after attach, between replies (a client that reads a reply skips and
// keeps the notices before it). kLeave: the daemon is draining and asks a
// session that holds long-lived blocks to give them back (the client moves
// them out of the arena and ends the session); `message` says why.
// kResume: the daemon exits keeping this session for the next one (a
// restart with a state store): its process resumes it there (a "Resume"),
// and its calls wait for that rather than fail when the lifeline closes.
enum class NoticeKind : uint8_t { kLeave = 1, kResume = 2 };
struct Notice {
  NoticeKind kind = NoticeKind::kLeave;
  std::string message;
};

std::string EncodeHello(const Hello& hello);
Result<Hello> DecodeHello(const std::string& bytes);

std::string EncodeResume(const Resume& resume);
Result<Resume> DecodeResume(const std::string& bytes);
// Whether a first frame is a Resume rather than a Hello (its type byte).
bool IsResume(const std::string& bytes);

std::string EncodeAttachReply(const AttachReply& reply);
Result<AttachReply> DecodeAttachReply(const std::string& bytes);

std::string EncodeChunkFdBatch(const ChunkFdBatch& batch);
Result<ChunkFdBatch> DecodeChunkFdBatch(const std::string& bytes);

std::string EncodeChunkRequest(const ChunkRequest& request);
Result<ChunkRequest> DecodeChunkRequest(const std::string& bytes);

std::string EncodeChunkReply(const ChunkReply& reply);
Result<ChunkReply> DecodeChunkReply(const std::string& bytes);

std::string EncodeLinkKeyRequest(const LinkKeyRequest& request);
Result<LinkKeyRequest> DecodeLinkKeyRequest(const std::string& bytes);

std::string EncodeLinkKeyReply(const LinkKeyReply& reply);
Result<LinkKeyReply> DecodeLinkKeyReply(const std::string& bytes);

std::string EncodeNotice(const Notice& notice);
Result<Notice> DecodeNotice(const std::string& bytes);
// Whether a frame the daemon sent after attach is a Notice (the type byte of
// its header; the decoder checks the rest).
bool IsNotice(const std::string& bytes);

// Whether a frame sent after attach (on the lifeline) is a LinkKeyRequest
// rather than a ChunkRequest (the type byte of its header; the decoder
// checks the rest).
bool IsLinkKeyRequest(const std::string& bytes);

}  // namespace memoffload

#endif  // MEMOFFLOAD_SHARED_MEM_ATTACH_WIRE_H_
