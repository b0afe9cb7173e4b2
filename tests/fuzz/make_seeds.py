#!/usr/bin/env python3
"""Writes the binary seed corpora of the attach-wire fuzz targets.

The text corpora (units, config, service) are written by hand; the attach
messages are binary, so they are generated here from the layout documented in
shared_mem/include/memoffload/shared_mem/attach_wire.h. Re-run after a wire
change: python3 tests/fuzz/make_seeds.py
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
MAGIC, VERSION = 0x4C464F4D, 1
HELLO, ATTACH_REPLY, CHUNK_FD_BATCH = 1, 2, 3


def header(kind, version=VERSION):
    return struct.pack("<IHB", MAGIC, version, kind)


def s(text):
    raw = text.encode()
    return struct.pack("<I", len(raw)) + raw


def hello(job="", rank=-1, local_rank=-1, max_bytes=0, job_max_bytes=0):
    return header(HELLO) + s(job) + struct.pack("<iiQQ", rank, local_rank, max_bytes,
                                                  job_max_bytes)


def attach_reply(code=0, message="", session_id=0, token="", socket="", page=4096,
                 limit=0, chunks=(), fd_frames=0):
    out = header(ATTACH_REPLY) + struct.pack("<I", code) + s(message)
    out += struct.pack("<Q", session_id) + s(token) + s(socket)
    out += struct.pack("<QQI", page, limit, len(chunks))
    for index, size in chunks:
        out += struct.pack("<IQ", index, size)
    return out + struct.pack("<I", fd_frames)


def batch(indexes):
    return header(CHUNK_FD_BATCH) + struct.pack("<I", len(indexes)) + b"".join(
        struct.pack("<I", i) for i in indexes)


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
write("fuzz_hello", "bad_version", header(HELLO, 2) + hello()[7:])
write("fuzz_hello", "truncated", hello("job", 1, 1)[:-3])

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
