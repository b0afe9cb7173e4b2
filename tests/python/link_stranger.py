"""A stranger on the job's nodes (run as another uid by test_link_security.py):
all it has is /proc/net/tcp and TCP sockets, as any local user has.

It watches /proc/net/tcp for sockets listening on the nodes' replication
addresses and, for each new one, from the *other* node's address (so that
it passes the listener's filter of peer addresses): holds 8 connections
open without a word for a second, sends what a gloo peer sends first (8
bytes), random bytes, a TLS 1.3 ClientHello of its own (no key), and makes
``--flood`` connect-send-close cycles. It never reads a reply. It stops
when ``stop`` exists (or after 300 s) and writes what it did to ``out``.

With ``--store HOST:PORT`` it is also a stranger who can reach the job's
c10d store (anyone who can reach its port): it reads the key ranks publish
there when no daemon has a key file, and offers it in a TLS 1.3 PSK
handshake of the link's own (memoffload._C) to each listener, claiming to
be rank 99 of another call.

usage: link_stranger.py OUT STOP ADDRESS[,ADDRESS...] [--flood N] [--store HOST:PORT]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import threading
import time
from typing import Dict, List, Set, Tuple

# Where the ranks publish the store-mode key (PrefixStores of the default
# process group over the job's TCPStore, then memoffload's own name).
STORE_KEY = "default_pg/0//memoffload/link/store-key"
IP_BIND_ADDRESS_NO_PORT = 24  # linux/in.h: the port is picked at connect
LISTEN = "0A"


def listening(addresses: List[str]) -> Set[Tuple[str, int]]:
    """(address, port) of every IPv4 socket listening on one of ``addresses``."""
    wanted = {socket.inet_aton(a)[::-1].hex().upper(): a for a in addresses}
    found = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state = fields[1], fields[3]
            host, port = local.split(":")
            if state == LISTEN and host in wanted:
                found.add((wanted[host], int(port, 16)))
    return found


class Stranger:
    def __init__(self, addresses: List[str], flood: int, store: str = "") -> None:
        self.addresses = addresses
        self.flood = flood
        self.store = store
        self.key = b""
        self.errors: List[str] = []
        self.own: Set[Tuple[str, int]] = set()  # its own listeners (store mode)
        self.lock = threading.Lock()
        self.counts: Dict[str, int] = {"listeners": 0, "connected": 0, "refused": 0,
                                       "tls_handshakes_completed": 0, "tls_refused": 0}

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def connect(self, src: str, dst: Tuple[str, int]) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        s.bind((src, 0))
        s.settimeout(2)
        s.connect(dst)
        return s

    def once(self, src: str, dst: Tuple[str, int], first: bytes) -> None:
        try:
            s = self.connect(src, dst)
        except OSError:
            self.count("refused")
            return
        self.count("connected")
        try:
            s.sendall(first)
        except OSError:
            pass
        s.close()

    def tls_hello(self, src: str, dst: Tuple[str, int]) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        try:
            raw = self.connect(src, dst)
        except OSError:
            self.count("refused")
            return
        self.count("connected")
        try:
            with ctx.wrap_socket(raw, server_hostname="peer") as s:
                s.do_handshake()
                self.count("tls_handshakes_completed")
        except (OSError, ssl.SSLError):
            self.count("tls_refused")

    def stolen_key(self) -> bytes:
        """The store-mode key, read from the job's store (b"": none there)."""
        if not self.key:
            from datetime import timedelta

            import torch.distributed as dist

            host, port = self.store.rsplit(":", 1)
            c10d = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
            if c10d.check([STORE_KEY]):
                said = c10d.get(STORE_KEY).decode()
                try:
                    self.key = bytes.fromhex(said)
                except ValueError:  # secure mode says there is none to take
                    self.key = b""
        return self.key

    def psk_handshake(self, src: str, dst: Tuple[str, int]) -> None:
        """Offers the stolen key to the listener: the handshake completes
        when it is the job's (the hello that follows is refused)."""
        import torch  # noqa: F401 - memoffload._C needs libtorch loaded

        from memoffload import _C

        key = self.stolen_key()
        if not key:
            self.count("no_key_in_store")
            return
        me = _C.LinkListener(address=src, rank=99, call=1, keys=[("store", key)],
                             io_timeout_ms=1500)
        with self.lock:
            self.own.add((me.address, me.port))
        out = _C.link_exchange(me, 1, None, [{"rank": 0, "host": dst[0], "port": dst[1],
                                              "blobs": [b"x" * 64]}], [])
        why = str(out["send_failures"].get(0, ""))
        if not why or why.startswith("the connection ended"):
            self.count("psk_handshakes_completed")  # then its hello was refused
        elif "TLS handshake failed" in why:
            self.count("psk_refused")
        else:
            self.count("psk_unreachable")

    def attack(self, dst: Tuple[str, int]) -> None:
        src = next(a for a in self.addresses if a != dst[0]) if len(self.addresses) > 1 else dst[0]
        for _ in range(20):  # first, a peer's first bytes, racing the real peers
            self.once(src, dst, bytes(8))
        if self.store:
            self.psk_handshake(src, dst)
        held = []
        for _ in range(8):  # every handshake slot, for a second
            try:
                held.append(self.connect(src, dst))
                self.count("connected")
            except OSError:
                self.count("refused")
        time.sleep(1.0)
        for s in held:
            s.close()
        for i in range(10):
            self.once(src, dst, bytes(8))  # a gloo peer's first bytes
            self.once(src, dst, os.urandom(64))
            self.tls_hello(src, dst)
        for i in range(self.flood):
            self.once(src, dst, bytes(8))

    def attack_or_say(self, dst: Tuple[str, int]) -> None:
        if self.store:  # a listener of its own, just made, is known after this
            time.sleep(0.02)
        with self.lock:
            if dst in self.own:
                return
        try:
            self.attack(dst)
        except Exception as exc:  # noqa: BLE001 - said in the report, which the test shows
            with self.lock:
                self.errors.append(f"{dst}: {exc!r}")

    def run(self, stop: str, deadline: float) -> None:
        seen: Set[Tuple[str, int]] = set()
        threads = []
        while not os.path.exists(stop) and time.monotonic() < deadline:
            for dst in listening(self.addresses) - seen - self.own:
                seen.add(dst)
                self.count("listeners")
                t = threading.Thread(target=self.attack_or_say, args=(dst,), daemon=True)
                t.start()
                threads.append(t)
            time.sleep(0.001)
        for t in threads:
            t.join(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("stop")
    ap.add_argument("addresses")
    ap.add_argument("--flood", type=int, default=300)
    ap.add_argument("--store", default="")
    args = ap.parse_args()
    stranger = Stranger(args.addresses.split(","), args.flood, args.store)
    with open(args.out + ".ready", "w"):
        pass
    stranger.run(args.stop, time.monotonic() + 300)
    with open(args.out, "w") as f:
        json.dump({**stranger.counts, "uid": os.getuid(), "errors": stranger.errors[:5]}, f)


if __name__ == "__main__":
    main()
