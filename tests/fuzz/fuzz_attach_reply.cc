// Fuzzes what a client decodes from the broker: the attach reply, the chunk
// fd batches that follow it, the replies to later chunk requests and the
// notices between them (a client must survive a broken
// or hostile daemon, or something else listening on the broker socket).
//
// Checks: decoding never crashes; a failure is INVALID_ARGUMENT; a decoded
// message stays within the documented bounds (status code, chunk count) and
// re-encodes to the exact input.
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "memoffload/shared_mem/attach_wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memoffload;
  const std::string input(reinterpret_cast<const char*>(data), size);

  Result<AttachReply> reply = DecodeAttachReply(input);
  if (reply.ok()) {
    fuzz::Check(static_cast<int>(reply->code) >= 0 && reply->code <= StatusCode::kUnauthenticated,
                "attach reply with an unknown status code accepted");
    fuzz::Check(reply->chunks.size() <= (1u << 16), "attach reply with too many chunks accepted");
    fuzz::Check(EncodeAttachReply(*reply) == input, "attach reply does not re-encode to its input");
  } else {
    fuzz::Check(reply.status().code() == StatusCode::kInvalidArgument,
                "DecodeAttachReply failed with " + reply.status().ToString());
  }

  Result<ChunkFdBatch> batch = DecodeChunkFdBatch(input);
  if (batch.ok()) {
    fuzz::Check(batch->chunk_indexes.size() <= (1u << 16), "fd batch with too many chunks");
    fuzz::Check(EncodeChunkFdBatch(*batch) == input, "fd batch does not re-encode to its input");
  } else {
    fuzz::Check(batch.status().code() == StatusCode::kInvalidArgument,
                "DecodeChunkFdBatch failed with " + batch.status().ToString());
  }
  Result<ChunkReply> chunk_reply = DecodeChunkReply(input);
  if (chunk_reply.ok()) {
    fuzz::Check(chunk_reply->code <= StatusCode::kUnauthenticated, "chunk reply code unknown");
    fuzz::Check(chunk_reply->chunk_indexes.size() <= (1u << 16), "chunk reply too long");
    fuzz::Check(EncodeChunkReply(*chunk_reply) == input,
                "chunk reply does not re-encode to its input");
  } else {
    fuzz::Check(chunk_reply.status().code() == StatusCode::kInvalidArgument,
                "DecodeChunkReply failed with " + chunk_reply.status().ToString());
  }
  Result<Notice> notice = DecodeNotice(input);
  if (notice.ok()) {
    fuzz::Check(notice->kind == NoticeKind::kLeave || notice->kind == NoticeKind::kResume,
                "notice of an unknown kind accepted");
    fuzz::Check(IsNotice(input), "a decoded notice is not recognised as one");
    fuzz::Check(EncodeNotice(*notice) == input, "notice does not re-encode to its input");
  } else {
    fuzz::Check(notice.status().code() == StatusCode::kInvalidArgument,
                "DecodeNotice failed with " + notice.status().ToString());
  }
  fuzz::Check(reply.ok() + batch.ok() + chunk_reply.ok() + notice.ok() <= 1,
              "one message decoded as two types");
  return 0;
}
