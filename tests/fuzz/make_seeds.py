#!/usr/bin/env python3
"""Writes the binary seed corpora of the attach-wire fuzz targets.

The text corpora (units, config, service) are written by hand; the attach
messages are binary, so they are generated here from the layout documented in
shared_mem/include/memoffload/shared_mem/attach_wire.h. Re-run after a wire
change: python3 tests/fuzz/make_seeds.py
"""
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MAGIC, VERSION = 0x4C464F4D, 3
HELLO, ATTACH_REPLY, CHUNK_FD_BATCH, NOTICE, RESUME = 1, 2, 3, 8, 9
# SessionKind: other, activations, state, checkpoints.
KIND_OTHER, KIND_ACTIVATIONS, KIND_STATE, KIND_CHECKPOINTS = 0, 1, 2, 3


def header(kind, version=VERSION):
    return struct.pack("<IHB", MAGIC, version, kind)


def s(text):
    raw = text.encode()
    return struct.pack("<I", len(raw)) + raw


def hello(job="", rank=-1, local_rank=-1, max_bytes=0, job_max_bytes=0, kind=KIND_OTHER):
    return header(HELLO) + s(job) + struct.pack("<iiQQB", rank, local_rank, max_bytes,
                                                  job_max_bytes, kind)


def attach_reply(code=0, message="", session_id=0, token="", socket="", page=4096,
                 limit=0, chunks=(), fd_frames=0, instance_id=0x1234):
    out = header(ATTACH_REPLY) + struct.pack("<I", code) + s(message)
    out += struct.pack("<Q", session_id) + s(token) + s(socket)
    out += struct.pack("<QQI", page, limit, len(chunks))
    for index, size in chunks:
        out += struct.pack("<IQ", index, size)
    return out + struct.pack("<IQ", fd_frames, instance_id)


def batch(indexes):
    return header(CHUNK_FD_BATCH) + struct.pack("<I", len(indexes)) + b"".join(
        struct.pack("<IQ", i, 1) for i in indexes)


def notice(message, kind=1):
    return header(NOTICE) + struct.pack("<B", kind) + s(message)


def write(target, name, data):
    folder = os.path.join(HERE, "corpus", target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


MIB = 1 << 20
write("fuzz_hello", "minimal", hello())
write("fuzz_hello", "job_rank", hello("train-42", 3, 1))
write("fuzz_hello", "session_limit", hello("job", 0, 0, max_bytes=MIB))
write("fuzz_hello", "job_limit", hello("job", 7, 7, job_max_bytes=3 * MIB // 2))
write("fuzz_hello", "both_limits", hello("llama 70b/run#1", 1023, 7, 512 * 1024, MIB))
write("fuzz_hello", "max_job_id", hello("j" * 128, 0, 0))
write("fuzz_hello", "odd_limit", hello("x", 2, 2, max_bytes=4097))
write("fuzz_hello", "state_kind", hello("job", 0, 0, max_bytes=MIB, kind=KIND_STATE))
write("fuzz_hello", "activations_kind", hello("job", 1, 1, kind=KIND_ACTIVATIONS))
write("fuzz_hello", "checkpoints_kind", hello("job", 2, 0, kind=KIND_CHECKPOINTS))
write("fuzz_hello", "bad_kind", hello("job", 2, 0, kind=4))
write("fuzz_hello", "bad_version", header(HELLO, 2) + hello()[7:])
write("fuzz_hello", "truncated", hello("job", 1, 1)[:-3])
write("fuzz_hello", "resume", header(RESUME) + struct.pack("<Q", 7) + s("x" * 43))
write("fuzz_hello", "resume_cut", (header(RESUME) + struct.pack("<Q", 7) + s("tok"))[:-2])

token = "0123456789abcdef0123456789abcdef"
write("fuzz_attach_reply", "granted", attach_reply(
    0, "", 1, token, "/run/memoffload/memoffload.sock", 4096, 0,
    [(0, MIB), (1, MIB), (2, MIB), (3, MIB)], 1))
write("fuzz_attach_reply", "granted_limit", attach_reply(
    0, "notice: mlock failed", 9, token, "/tmp/memoffload-1000/memoffload.sock", 4096,
    2 * MIB, [(0, 1 << 30)], 1))
write("fuzz_attach_reply", "no_chunks", attach_reply(0, "", 2, token, "/s", 4096))
write("fuzz_attach_reply", "refused", attach_reply(
    7, "uid 1001 is not allowed to attach (access.allowed_uids)"))
write("fuzz_attach_reply", "draining", attach_reply(14, "memoffloadd is draining"))
write("fuzz_attach_reply", "batch", batch([0, 1, 2, 3]))
write("fuzz_attach_reply", "batch_empty", batch([]))
write("fuzz_attach_reply", "batch_big_index", batch([0xFFFFFFFF, 65535]))
write("fuzz_attach_reply", "notice_leave", notice("memoffloadd is draining (SIGTERM)"))
write("fuzz_attach_reply", "notice_unknown", notice("?", kind=2))

# The link between nodes (client/cpp link_frames.h): the first byte picks
# the items agreed (low 2 bits: regions, bit 7: a blob; regions of
# 1 + (byte >> 2) * 997 % 20000 bytes), the rest is the stream.
LINK_HELLO, LINK_ITEM, LINK_PIECE, LINK_BLOB, LINK_FAIL, LINK_END = 1, 2, 3, 4, 5, 6


def frame(kind, payload=b""):
    return struct.pack("<BI", kind, len(payload)) + payload


def link_hello(rank, call, seq, items):
    return frame(LINK_HELLO, struct.pack("<IHiQII", 0x4B4C4F4D, 1, rank, call, seq, items))


def link_item(kind, size, name):
    raw = name.encode()
    return frame(LINK_ITEM, struct.pack("<BQH", kind, size, len(raw)) + raw)


def link_piece(offset, data):
    return frame(LINK_PIECE, struct.pack("<QI", offset, 0) + data)


region = 1 + (0x05 >> 2) * 997 % 20000  # shape 0x05: one region
pieces = b"".join(link_piece(o, b"x" * min(4096, region - o)) for o in range(0, region, 4096))
write("fuzz_link_frames", "one_region", bytes([0x05]) + link_hello(0, 42, 1, 1) +
      link_item(1, region, "r0") + pieces + frame(LINK_END))
write("fuzz_link_frames", "region_failed", bytes([0x05]) + link_hello(0, 42, 1, 1) +
      link_item(1, region, "r0") + link_piece(0, b"y" * 100) + frame(LINK_FAIL, b"read error") +
      frame(LINK_END))
write("fuzz_link_frames", "blob", bytes([0x80]) + link_hello(3, 7, 2, 1) + link_item(2, 3000, "") +
      frame(LINK_BLOB, b"z" * 3000) + frame(LINK_END))
write("fuzz_link_frames", "gloo_first", bytes([0x05]) + b"\0" * 8)
write("fuzz_link_frames", "too_long_piece", bytes([0x05]) + struct.pack("<BI", LINK_PIECE, 1 << 30))

# fuzz_state: the kept state (daemon/core/state_format.h): the v1 snapshot
# fixture, and a journal with a commit, a delete and a torn third record.


sys.path.insert(0, os.path.join(HERE, "..", "daemon", "core", "data"))
from make_state_v1 import crc32c  # noqa: E402  (the fixture's, one definition)


def journal_record(seq, kind, payload):
    tail = struct.pack("<QH", seq, kind) + b"\0" * 6 + payload
    rec = struct.pack("<II", len(payload), crc32c(tail)) + tail
    return rec + b"\0" * (-len(rec) % 8)


def region_payload(uid, job, name, extents, crcs):
    out = struct.pack("<I", uid) + s(job) + s("uid:%d" % uid) + s(name)
    out += struct.pack("<QQd", 4096, 60000, 1795000000.0) + struct.pack("<I", len(extents))
    out += b"".join(struct.pack("<IQQ", *e) for e in extents)
    return out + struct.pack("<I", len(crcs)) + b"".join(struct.pack("<I", c) for c in crcs)


head = b"MOJOURNL" + struct.pack("<IQQQQI", 1, 1, 0x1234, 4 << 20, 1 << 20, 4096)
head += b"\0" * (60 - len(head))
head += struct.pack("<I", crc32c(head))
records = journal_record(1, 1, region_payload(1000, "job", "a", [(0, 0, 4096)], [7]))
records += journal_record(2, 1, region_payload(1000, "job", "b", [(1, 8192, 8192)], []))
records += journal_record(3, 2, struct.pack("<I", 1000) + s("job") + s("a"))
torn = journal_record(4, 1, region_payload(1001, "job2", "c", [(2, 0, 4096)], []))[:40]
write("fuzz_state", "journal", head + records + torn + b"\0" * 64)
with open(os.path.join(HERE, "..", "daemon", "core", "data", "state_v1.snapshot"), "rb") as f:
    write("fuzz_state", "snapshot_v1", f.read())


# A take-over's v2 snapshot: a region and a session (groups, a region it
# writes, one it has open, one deleted while it had it open).
def extents_crcs(extents, crcs):
    return (struct.pack("<I", len(extents)) + b"".join(struct.pack("<IQQ", *e) for e in extents)
            + struct.pack("<I", len(crcs)) + b"".join(struct.pack("<I", c) for c in crcs))


session = struct.pack("<Q", 3) + s("t" * 43) + struct.pack("<IIi", 1000, 1000, 4242) + s("job")
session += struct.pack("<iiQQHQ", 0, 0, 0, 0, KIND_STATE, 1 << 30)
session += struct.pack("<I", 2)
session += struct.pack("<QHQ", 1, 1, 4000) + extents_crcs([(0, 16384, 4096)], [9])
session += struct.pack("<QHQ", 2, 0, 0) + extents_crcs([(1, 0, 8192), (2, 0, 4096)], [])
session += struct.pack("<I", 1) + region_payload(1000, "job", "half", [(3, 0, 4096)], [])
session += struct.pack("<I", 1) + s("b")
session += struct.pack("<I", 1) + region_payload(1000, "job", "gone", [(3, 8192, 4096)], [])
snap = b"MOSNAPSH" + struct.pack("<IQQ", 2, 2, 0x1234) + struct.pack("<QQI", 4 << 20, 1 << 20, 4096)
snap += struct.pack("<I", 1) + region_payload(1000, "job", "b", [(1, 8192, 8192)], [])
snap += struct.pack("<I", 1) + session
# The chunks' owners (a restart's snapshot names them): two of uid 1000's.
snap += struct.pack("<I", 2) + struct.pack("<I", 0) + s("uid:1000") + struct.pack("<I", 1000)
snap += struct.pack("<I", 3) + s("uid:1000") + struct.pack("<I", 1000)
write("fuzz_state", "snapshot_v2_sessions", snap + struct.pack("<I", crc32c(snap)))
