// Fuzzes the broker's hello: the first bytes any local process sends the
// daemon. Follows the broker's path (DecodeHello, then SessionTable::Open
// with the decoded hello) and checks:
//   - a decoded hello is within its documented bounds and re-encodes to the
//     exact input (the encoding is canonical: nothing is silently dropped);
//   - a session opened with it honours the limits the hello asked for, and
//     closing it gives every byte back (table invariants hold throughout).
// Chunk fd requests, which the broker reads after attach, are decoded too.
#include <cstdint>
#include <string>

#include "core/session_table.h"
#include "fuzz_common.h"
#include "memoffload/shared_mem/attach_wire.h"

namespace memoffload::fuzz {
namespace {

void ExerciseSession(const Hello& hello) {
  daemon::Arena* arena = SharedArena();
  daemon::SessionTable table(arena, daemon::Policy{});
  const daemon::PeerCredentials peer{4242, 1000, 1000};
  Result<daemon::SessionGrant> a = table.Open(hello, peer);
  Result<daemon::SessionGrant> b = table.Open(hello, peer);
  CheckOk(a.status(), "Open with a decoded hello");
  CheckOk(b.status(), "second Open with a decoded hello");
  Check(a->token != b->token, "two sessions got the same token");
  Check(hello.max_bytes == 0 || a->limit_bytes <= hello.max_bytes,
        "session limit above what the hello asked for");

  // Fill both sessions in 256 KiB steps until refused; the limits must hold.
  const uint64_t step = 256 * 1024;
  uint64_t held_a = 0, held_b = 0;
  for (uint64_t group = 1; group <= 16; ++group) {
    const bool on_a = group % 2 == 1;
    const daemon::SessionGrant& g = on_a ? *a : *b;
    Result<daemon::ReserveResult> r = table.Reserve(g.session_id, g.token, group, step, false);
    if (r.ok()) {
      (on_a ? held_a : held_b) += r->reserved_bytes;
    } else {
      Check(r.status().code() == StatusCode::kResourceExhausted,
            "unexpected Reserve refusal: " + r.status().ToString());
    }
    CheckOk(table.CheckInvariants(), "invariants after Reserve");
  }
  if (hello.max_bytes != 0) {
    Check(held_a <= hello.max_bytes && held_b <= hello.max_bytes,
          "a session holds more than its hello's max_bytes");
  }
  if (hello.job_max_bytes != 0) {
    Check(held_a + held_b <= hello.job_max_bytes, "a job holds more than its job_max_bytes");
  }
  for (const daemon::SessionSnapshot& s : table.ListSessions()) {
    Check(s.job_id == hello.job_id && s.rank == hello.rank && s.local_rank == hello.local_rank,
          "ListSessions does not report the hello's identity");
  }
  auto closed_a = table.Close(a->session_id, daemon::CloseReason::kLifelineClosed);
  auto closed_b = table.Close(b->session_id, daemon::CloseReason::kShutdown);
  CheckOk(closed_a.status(), "Close a");
  CheckOk(closed_b.status(), "Close b");
  Check(closed_a->group_bytes == held_a && closed_b->group_bytes == held_b,
        "Close reclaimed a different byte count");
  CheckOk(table.CheckInvariants(), "invariants after Close");
  Check(arena->allocator().free_bytes() == arena->capacity_bytes(),
        "bytes left allocated after both sessions closed");
}

}  // namespace
}  // namespace memoffload::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memoffload;
  const std::string input(reinterpret_cast<const char*>(data), size);
  // After attach the broker also reads chunk fd requests from the client.
  Result<ChunkRequest> chunk_request = DecodeChunkRequest(input);
  if (chunk_request.ok()) {
    fuzz::Check(chunk_request->chunk_indexes.size() <= (1u << 16), "chunk request too long");
    fuzz::Check(EncodeChunkRequest(*chunk_request) == input,
                "chunk request does not re-encode to its input");
  } else {
    fuzz::Check(chunk_request.status().code() == StatusCode::kInvalidArgument,
                "DecodeChunkRequest failed with " + chunk_request.status().ToString());
  }
  Result<Resume> resume = DecodeResume(input);
  if (resume.ok()) {
    fuzz::Check(IsResume(input), "a resume of another type accepted");
    fuzz::Check(EncodeResume(*resume) == input, "resume does not re-encode to its input");
  } else {
    fuzz::Check(resume.status().code() == StatusCode::kInvalidArgument,
                "DecodeResume failed with " + resume.status().ToString());
  }
  Result<Hello> hello = DecodeHello(input);
  if (!hello.ok()) {
    fuzz::Check(hello.status().code() == StatusCode::kInvalidArgument,
                "DecodeHello failed with " + hello.status().ToString());
    return 0;
  }
  fuzz::Check(hello->version == kAttachProtocolVersion, "hello of another version accepted");
  fuzz::Check(hello->job_id.size() <= kMaxJobIdBytes, "job id over kMaxJobIdBytes accepted");
  for (unsigned char c : hello->job_id) {
    fuzz::Check(c >= 0x20 && c <= 0x7e, "job id with a non-printable byte accepted");
  }
  fuzz::Check(hello->rank >= -1 && hello->local_rank >= -1, "rank below -1 accepted");
  fuzz::Check(static_cast<uint8_t>(hello->kind) < kSessionKindCount,
              "unknown session kind accepted");
  fuzz::Check(EncodeHello(*hello) == input, "hello does not re-encode to its input");
  fuzz::ExerciseSession(*hello);
  return 0;
}
