"""The keeper's side of a test: start `memoffloadd keeper`, and speak its
wire (daemon/app/fd_store.h) as a process of the same uid would, to look
at what it holds or to plant what a hostile or newer daemon could have
left there. Frames: a 4-byte little-endian length, the payload, fds as
SCM_RIGHTS with the first byte."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

from conftest import bin_dir


def start_keeper(runtime_dir: str, log: Path, sock: Optional[Path] = None) -> subprocess.Popen:
    """`memoffloadd keeper` on the runtime dir, at `sock` (lifecycle.keeper_socket)
    or the default DIR/keeper.sock; returns once it listens."""
    args = [str(bin_dir() / "memoffloadd"), "keeper", f"--runtime-dir={runtime_dir}"]
    if sock is not None:
        args.append(f"--keeper-socket={sock}")
    proc = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    sock = sock or Path(runtime_dir) / "keeper.sock"
    deadline = time.monotonic() + 10
    while not sock.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the keeper did not listen within 10 s"
        time.sleep(0.02)
    return proc


def connect(runtime_dir: str, sock: Optional[Path] = None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(sock or Path(runtime_dir) / "keeper.sock"))
    return s


def send(s: socket.socket, payload: bytes, fds: List[int] = ()) -> None:
    data = struct.pack("<I", len(payload)) + payload
    if fds:
        socket.send_fds(s, [data[:1]], list(fds))
        s.sendall(data[1:])
    else:
        s.sendall(data)


def recv(s: socket.socket) -> tuple[Optional[bytes], List[int]]:
    """One frame; (None, []) when the keeper closed the connection."""
    buf, fds = b"", []
    while len(buf) < 4 or len(buf) < 4 + struct.unpack("<I", buf[:4])[0]:
        want = 4 - len(buf) if len(buf) < 4 else 4 + struct.unpack("<I", buf[:4])[0] - len(buf)
        data, got, _, _ = socket.recv_fds(s, want, 4)
        if not data:
            for fd in got:
                os.close(fd)
            return None, fds
        buf += data
        fds += got
    return buf[4:], fds


def take(runtime_dir: str, sock: Optional[Path] = None) -> Dict[str, int]:
    """Everything the keeper holds, by name (the caller closes the fds)."""
    s = connect(runtime_dir, sock)
    try:
        send(s, b"take")
        out: Dict[str, int] = {}
        while True:
            payload, fds = recv(s)
            assert payload is not None, "the keeper hung up during take"
            if payload == b"end":
                return out
            assert payload.startswith(b"fd ") and len(fds) == 1, payload
            out[payload[3:].decode()] = fds[0]
    finally:
        s.close()


def take_names(runtime_dir: str, sock: Optional[Path] = None) -> List[str]:
    """The names the keeper holds (the fds closed)."""
    held = take(runtime_dir, sock)
    for fd in held.values():
        os.close(fd)
    return sorted(held)


def put(runtime_dir: str, name: str, fd: int, sock: Optional[Path] = None) -> None:
    s = connect(runtime_dir, sock)
    try:
        send(s, b"put " + name.encode(), [fd])
        send(s, b"take")  # answered once the put is done
        while recv(s)[0] not in (b"end", None):
            pass
    finally:
        s.close()


def sealed_memfd(data: bytes) -> int:
    """A memfd holding `data`, sealed as the daemon seals a snapshot."""
    import fcntl

    fd = os.memfd_create("planted", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    return fd


def probe_as(uid: int, socket_path: Path, payload: bytes) -> str:
    """Connects to `socket_path` as `uid` (a child that drops to it), sends
    one frame and says what came back: "b''" or "closed" when the other end
    hung up without answering."""
    import subprocess
    import sys

    probe = (
        "import os, socket, struct\n"
        f"os.setgid({uid}); os.setuid({uid})\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(5)\n"
        f"s.connect({str(socket_path)!r})\n"
        "try:\n"
        f"    s.sendall(struct.pack('<I', {len(payload)}) + {payload!r})\n"
        "    print(repr(s.recv(64)))\n"
        "except (ConnectionResetError, BrokenPipeError):\n"
        "    print('closed')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out
    return out.stdout.strip()
