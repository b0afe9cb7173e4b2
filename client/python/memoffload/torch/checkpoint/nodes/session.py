"""One collective job on the link between nodes (link.py): its agreement,
its rounds of small values through the job's store, and its streams.

- **Open.** Each rank makes a listener on its replication address (when the
  job streams bytes), then tells the others through the job's c10d store,
  sealed with the job's key: which call it is making, its key's mode, its
  node, and its address and port. Every rank checks what every other said:
  the same call, the same mode, a seal it can verify. The listener exists
  only until the job closes.
- **Rounds.** :meth:`Session.all_gather` is one round of JSON values through
  the store, each sealed (HMAC-SHA256 under the key) and checked: nothing
  received is unpickled.
- **Streams.** :meth:`Session.exchange` and :meth:`Session.broadcast` run one
  exchange of ``memoffload._C.link_exchange``: regions and blobs over TLS
  1.3 with the job's key, straight from the sender's daemon and, for
  replicas, straight into the receiver's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from .... import _C, errors, logs
from .topology import address

IN_STEP = ("call latest_checkpoint, the saves and the loads of a job on several nodes on every "
           "rank, in the same order")
SECURE = "key file"
STORE = "store"
_STORE_KEY_ID = "store"
# Bytes of one piece of a region on the wire.
PIECE_BYTES = 32 << 20
# The connection limits of each listener (link.h).
HANDSHAKE_TIMEOUT_MS = 2000
MAX_PENDING_HANDSHAKES = 8
# Tests only: every N-th piece sent is changed after its checksum was taken,
# as a fault on the way would change it (0: never).
TEST_CORRUPT_EVERY = 0


def seal(key: Tuple[str, bytes], name: str, value: Any) -> bytes:
    """``value`` as JSON with an HMAC-SHA256 under ``key`` over the store key
    ``name`` and the JSON: what one rank tells the others through the store."""
    payload = json.dumps(value, separators=(",", ":"), sort_keys=True)
    mac = hmac.new(key[1], f"{name}\n{payload}".encode(), hashlib.sha256).hexdigest()
    return json.dumps({"k": key[0], "m": mac, "v": payload}).encode()


def refusal(why: str) -> bytes:
    """What a rank whose node refuses the link (it has no key it may use)
    says in place of a sealed value, so that the others stop at once."""
    return json.dumps({"refused": why}).encode()


def unseal(keys: List[Tuple[str, bytes]], name: str, blob: bytes, rank: int) -> Any:
    """The value of :func:`seal`, checked; FailedPrecondition when it was not
    sealed under one of ``keys``, or when ``rank`` said its node refuses.
    (A refusal is not sealed: whoever can write the store can stop the
    job's replication anyway, never join it.)"""
    try:
        outer = json.loads(blob.decode())
        if isinstance(outer, dict) and isinstance(outer.get("refused"), str):
            raise errors.FailedPrecondition(
                f"rank {rank}'s node refuses checkpoint replication: {outer['refused'][:500]}")
        kid, mac, payload = str(outer["k"]), str(outer["m"]), str(outer["v"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise errors.FailedPrecondition(
            f"the job's store holds a value for rank {rank} ({name}) that is not memoffload's: "
            "something else wrote it") from None
    key = next((k for kid_, k in keys if kid_ == kid), None)
    if key is None and (kid == _STORE_KEY_ID) != (keys[0][0] == _STORE_KEY_ID):
        raise errors.FailedPrecondition(
            f"rank {rank}'s node has {'no' if kid == _STORE_KEY_ID else 'a'} replication key file "
            f"and this rank's node has {'one' if kid == _STORE_KEY_ID else 'none'}: give every "
            "node's memoffloadd the same replication.key_file (docs/checkpoints.md)")
    want = None if key is None else hmac.new(key, f"{name}\n{payload}".encode(),
                                             hashlib.sha256).hexdigest()
    if want is None or not hmac.compare_digest(want, mac):
        raise errors.FailedPrecondition(
            f"the job's store holds a value for rank {rank} ({name}) not sealed with this job's "
            f"replication key ({'key ' + kid + ' is not known here' if key is None else 'a bad MAC'}"
            "): another job or another uid wrote it, or the nodes' key files differ")
    return json.loads(payload)


class Session:
    """One collective job (see the module docstring)."""

    def __init__(self, link: Any, call: str, name: str, mode: str,
                 keys: List[Tuple[str, bytes]], listener: Optional[Any]) -> None:
        self.link, self.call, self.name, self.mode = link, call, name, mode
        self.keys = keys
        self.listener = listener
        self.topo = link.topo
        self.rank = link.rank
        self.timeout = link._timeout
        self.peers: List[Dict[str, Any]] = []
        self._round = 0
        self._exchanges = 0
        self._c10d = dist.distributed_c10d._get_default_store()
        self._mine: List[str] = []  # store keys this rank set, deleted once read by all

    @classmethod
    def open(cls, link: Any, call: str, store: Optional[Any], listen: bool,
             save_id: str) -> "Session":
        number, name = link.next_call(save_id)
        try:
            mode, keys = link.keys(store)
        except errors.FailedPrecondition as exc:
            # This node refuses (replication.require_key without a key file):
            # the others learn it now, not at their deadline.
            dist.distributed_c10d._get_default_store().set(
                f"{name}/{link.rank}", refusal(str(exc)))
            raise
        listener = None
        if listen:
            # The connections' hello names the agreement (the same on every
            # rank that makes this call), not a per-process count.
            call_id = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
            listener = _C.LinkListener(
                address=link.topo.addresses[link.rank] or address(), rank=link.rank,
                call=call_id, keys=keys, handshake_timeout_ms=HANDSHAKE_TIMEOUT_MS,
                max_pending_handshakes=MAX_PENDING_HANDSHAKES,
                io_timeout_ms=int(link._timeout.total_seconds() * 1000),
                piece_bytes=PIECE_BYTES, test_corrupt_every=TEST_CORRUPT_EVERY)
        session = cls(link, call, name, mode, keys, listener)
        try:
            session._agree(number)
        except BaseException:
            session.close()
            raise
        return session

    def close(self) -> None:
        """Closes the listener: nothing listens once the job is done. What
        it dropped is said (at most every few minutes)."""
        if self.listener is not None:
            report_dropped(self.listener.dropped(), self.call, self.listener.address,
                           self.listener.port)
        self.listener = None

    # ---- the agreement -----------------------------------------------------------

    def _agree(self, number: int) -> None:
        me = self.rank
        mine = {"call": self.call, "mode": self.mode, "number": number,
                "node": self.topo.node_of[me],
                "host": self.listener.address if self.listener is not None else "",
                "port": self.listener.port if self.listener is not None else 0}
        said = self._exchange_values(self.name, mine, "makes this call")
        modes = {s["mode"] for s in said}
        if len(modes) > 1:
            secure = [r for r, s in enumerate(said) if s["mode"] == SECURE]
            other = [r for r, s in enumerate(said) if s["mode"] != SECURE]
            raise errors.FailedPrecondition(
                f"rank {secure[0]}'s node has a replication key file and rank {other[0]}'s has "
                "none: give every node's memoffloadd the same replication.key_file, or none")
        calls = {s["call"] for s in said}
        if len(calls) > 1:
            others = "; ".join(f"rank {r}: {s['call']}" for r, s in enumerate(said)
                               if s["call"] != self.call)
            raise errors.FailedPrecondition(
                f"the ranks are out of step across the job's nodes (rank {me} makes "
                f"{self.call}, but {others}): {IN_STEP}")
        for r, s in enumerate(said):
            if s["node"] != self.topo.node_of[r]:
                raise errors.FailedPrecondition(
                    f"rank {r} says it is on {s['node']!r}, the job learned "
                    f"{self.topo.node_of[r]!r}: restart the job")
        # A save is where the ranks meet again, whatever came before.
        self.link._calls = max(int(s["number"]) for s in said)
        self.peers = said

    def _exchange_values(self, name: str, value: Any, what: str) -> List[Any]:
        me = self.rank
        key = f"{name}/{me}"
        self._c10d.set(key, seal(self.keys[0], key, value))
        self._mine.append(key)
        names = [f"{name}/{r}" for r in range(self.topo.world)]
        try:
            self._c10d.wait(names, self.timeout)
        except Exception as exc:  # noqa: BLE001 - the store's timeout, reworded
            wait = self.timeout.total_seconds()
            raise errors.DeadlineExceeded(
                f"rank {me}: {self.call} is a collective across the job's nodes, and not every "
                f"rank {what} within {wait:.0f} s; {IN_STEP}") from exc
        return [unseal(self.keys, n, self._c10d.get(n), r) for r, n in enumerate(names)]

    # ---- rounds ------------------------------------------------------------------

    def all_gather(self, value: Any) -> List[Any]:
        """Every rank's ``value`` (JSON: dicts with string keys, lists,
        strings, numbers, booleans, None), through the store, sealed."""
        self._round += 1
        done = list(self._mine)
        said = self._exchange_values(f"{self.name}/r{self._round}", value, "reached this step")
        for key in done:  # every rank has read them: they got this far
            try:
                self._c10d.delete_key(key)
            except Exception:  # noqa: BLE001 - a store without delete: the keys stay
                pass
            self._mine.remove(key)
        return said

    # ---- streams -----------------------------------------------------------------

    def exchange(self, sends: Dict[int, List[Tuple[str, int]]],
                 receives: Dict[int, List[Tuple[str, int]]], *, source: Optional[Any] = None,
                 store: Optional[Any] = None, ttl: float = 0.0,
                 into: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Streams ``sends`` ({peer: [(region, size)]}, read from ``source``)
        and receives ``receives`` ({peer: [(region, size)]}) into ``store``
        (committed with ``ttl`` once whole and intact) or ``into`` ({region:
        uint8 tensor}). Every rank calls it, with or without streams.
        Returns link_exchange's result (per peer failures, per region
        outcome)."""
        return self._run(
            [{**self._peer(d), "regions": [list(r) for r in regions]} for d, regions in sends.items()],
            [{**self._peer(s), "regions": [list(r) for r in regions]}
             for s, regions in receives.items()],
            source=source, store=store, ttl=ttl, into=into)

    def broadcast(self, blob: Optional[bytes], src: int,
                  to: Optional[List[int]] = None) -> Tuple[bool, Optional[bytes]]:
        """(whether ``src`` has a blob, the blob): sent over the link to the
        ranks of ``to`` (default every other rank); the others learn only
        whether there is one."""
        sizes = self.all_gather(len(blob) if self.rank == src and blob is not None else None)
        size = sizes[src]
        targets = [r for r in (to if to is not None else range(self.topo.world)) if r != src]
        if size is None:
            self._run([], [])  # every rank makes the same exchanges
            return False, None
        if self.rank == src:
            result = self._run([{**self._peer(r), "blobs": [blob]} for r in targets], [])
            failed = result["send_failures"]
            if failed:
                r, why = next(iter(failed.items()))
                raise errors.Unavailable(f"sending to rank {r} over the link failed: {why}")
            return True, blob
        if self.rank in targets:
            result = self._run([], [{**self._peer(src), "blobs": [int(size)]}])
            got = result["blobs"].get(src, [])
            if not got:
                why = result["receive_failures"].get(src, "nothing arrived")
                raise errors.Unavailable(f"receiving from rank {src} over the link failed: {why}")
            return True, bytes(got[0])
        self._run([], [])
        return True, None

    def _peer(self, rank: int) -> Dict[str, Any]:
        p = self.peers[rank]
        if not p["host"]:
            raise errors.Internal(f"rank {rank} does not listen in {self.call}")
        return {"rank": rank, "host": str(p["host"]), "port": int(p["port"])}

    def _run(self, sends: List[Dict[str, Any]], receives: List[Dict[str, Any]], *,
             source: Optional[Any] = None, store: Optional[Any] = None, ttl: float = 0.0,
             into: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        self._exchanges += 1
        if self.listener is None:
            raise errors.Internal(f"{self.call} streams without a listener")
        return _C.link_exchange(self.listener, self._exchanges, source, sends, receives,
                                store, ttl, into)


def report_dropped(dropped: Dict[str, int], call: str, host: str, port: int) -> None:
    """Says what a listener dropped: a WARNING when it refused connections
    for want of descriptors, else an INFO line for connections that were
    not the job's peers (a scanner, another uid on a node, a rank of
    another job); nothing when it dropped nothing."""
    where = f"the link's listener {host}:{port} ({call})"
    if dropped.get("fd_shortage", 0):
        logs.log_limited(
            "link fd shortage", logging.WARNING,
            f"{where} refused {dropped['fd_shortage']} connection(s) for want of file "
            "descriptors (raise the trainer's RLIMIT_NOFILE); the job's peers try again until "
            "the deadline", errors.StatusCode.RESOURCE_EXHAUSTED)
    strangers = {k: v for k, v in dropped.items() if k != "fd_shortage" and v}
    if strangers:
        what = {"not_a_peer": "from an address that is not a peer's",
                "busy": f"while {MAX_PENDING_HANDSHAKES} others were in their handshake",
                "handshake": "without the job's key",
                "bad_hello": "without the hello expected"}
        logs.log_limited(
            "link strangers", logging.INFO,
            f"{where} dropped {sum(strangers.values())} connection(s): " +
            ", ".join(f"{n} {what[k]}" for k, n in strangers.items()))
