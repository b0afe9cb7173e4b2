"""Writes state_v1.snapshot: a v1 state snapshot (daemon/core/state_format.h)
made from the format's description, not from the daemon's encoder, so the
fixture checks the two agree. Run once per format version; the file is
checked in and every later daemon must read it (state_format_test.cc)."""

import struct
from pathlib import Path


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def region(uid, job, tenant, name, used, ttl_ms, committed_unix, extents, crcs) -> bytes:
    out = struct.pack("<I", uid) + string(job) + string(tenant) + string(name)
    out += struct.pack("<QQd", used, ttl_ms, committed_unix)
    out += struct.pack("<I", len(extents))
    for chunk, offset, length in extents:
        out += struct.pack("<IQQ", chunk, offset, length)
    out += struct.pack("<I", len(crcs)) + b"".join(struct.pack("<I", c) for c in crcs)
    return out


def main() -> None:
    # Regions in the order of their key (uid, job id, name), as the daemon writes them.
    regions = [
        region(1000, "job-a", "uid:1000", "dcp/step-100/__0_0.distcp", 4196, 86400000,
               1795000000.5, [(0, 0, 4096), (0, 8192, 4096)], [0x0BADF00D, 0xC0FFEE00]),
        region(1001, "job-b", "uid:1001", "scratch", 100, 3600000, 1795000100.0,
               [(1, 0, 4096)], []),
    ]
    body = b"MOSNAPSH" + struct.pack("<IQQ", 1, 17, 0x5EED5EED5EED5EED)
    body += struct.pack("<QQI", 64 << 20, 16 << 20, 4096)
    body += struct.pack("<I", len(regions)) + b"".join(regions)
    out = body + struct.pack("<I", crc32c(body))
    Path(__file__).with_name("state_v1.snapshot").write_bytes(out)


if __name__ == "__main__":
    main()
