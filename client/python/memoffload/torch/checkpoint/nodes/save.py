"""Checkpoints of a job that spans nodes, and their replicas (issue 33).

After each rank has committed its shard into its own node's daemon, every
rank's replication job (on the link's worker thread, :mod:`.link`):

1. tells every rank what it wrote (and whether it could);
2. receives the coordinator's ``.metadata`` (committed there by DCP's
   ``finish``), and the lowest rank of every other node commits it, so that
   each node can find every piece; every node also gets ``.layout`` (the
   data regions the checkpoint has);
3. with ``replicas=k``, streams its shard to the rank with the same local
   index on each of the next k nodes, which commits it into its own daemon
   under the same region name, and receives the shards it keeps for others;
4. when every shard, ``.metadata`` and ``.layout`` have their copies, the
   lowest rank of each node commits ``.node-safe``; then retention runs on
   each node (``keep_last``, never the newest node-safe checkpoint).

A load reads each region from the local daemon when it is there and intact,
else streams it from a rank whose node holds a copy (:func:`fetch`).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .... import errors, logs
from .. import store as _store
from . import link as _link
from .link import NO_DAEMON, Link, Topology, pieces

LAYOUT_NAME = ".layout"

LOCAL = "local daemon"


@dataclass
class Replication:
    """What became of one save across nodes (``MemoffloadWriter.wait_replication``)."""

    checkpoint_id: str
    node_safe: bool
    why: str = ""                 # why it is not node-safe ("" when it is)
    nodes: int = 1
    held_for_others: List[str] = field(default_factory=list)  # replicas this rank committed
    bytes_sent: int = 0
    seconds: float = 0.0
    deleted: List[str] = field(default_factory=list)  # retention on this rank's node


def _commit_small(store: Any, name: str, blob: bytes, ttl: float) -> None:
    writer = store.create(name, len(blob), ttl)
    try:
        writer.append(blob)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Outgoing:
    """One stream of this rank's regions to one peer: pieces read from the
    local daemon (checksums verified as read), zeros after a failure. Two
    buffers per stream: the next piece is read while one travels."""

    def __init__(self, store: Any, regions: List[Tuple[str, int]]) -> None:
        self.store, self.regions = store, regions
        self.failure = ""
        self.sent = 0
        self.crcs: Dict[str, List[int]] = {}  # per region, each piece's CRC-32 as sent

    def __iter__(self) -> Iterator[torch.Tensor]:
        count = 0
        for name, size in self.regions:
            reader = None
            try:
                reader = self.store.open(name, True, verify_as_read=True)
            except errors.Error as exc:
                self.failure = self.failure or f"reading {name}: {_why(exc)}"
            for offset, length in pieces(size):
                buf = _buffer(self, count, length)
                count += 1
                if reader is None or self.failure:
                    buf.zero_()
                else:
                    try:
                        reader.read_into(offset, buf)
                    except errors.Error as exc:
                        self.failure = f"reading {name}: {_why(exc)}"
                        buf.zero_()
                self.sent += length
                self.crcs.setdefault(name, []).append(_crc(buf))
                yield buf
            if reader is not None:
                try:
                    if not self.failure:
                        reader.verify_rest()
                    reader.close()
                except errors.Error as exc:
                    self.failure = self.failure or f"reading {name}: {_why(exc)}"


class _Incoming:
    """One stream of a peer's regions, as (buffer, what to do once it is
    filled): each piece is received into ``into(name)[offset:]`` when given,
    else into one of the stream's two buffers and then handed to
    ``take(name, offset, piece)``."""

    def __init__(self, regions: List[Tuple[str, int]], take: Any = None, into: Any = None) -> None:
        self.regions, self.take, self.into = regions, take, into
        self.crcs: Dict[str, List[int]] = {}  # per region, each piece's CRC-32 as received

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, Any]]:
        count = 0
        for name, size in self.regions:
            for offset, length in pieces(size):
                if self.into is not None:
                    buf = self.into(name)[offset: offset + length]
                else:
                    buf = _buffer(self, count, length)
                    count += 1
                yield buf, (lambda n=name, o=offset, b=buf: self._landed(n, o, b))

    def _landed(self, name: str, offset: int, buf: torch.Tensor) -> None:
        self.crcs.setdefault(name, []).append(_crc(buf))
        if self.take is not None:
            self.take(name, offset, buf)

    def damaged(self, sent: Dict[str, List[int]]) -> List[str]:
        """The regions whose pieces did not arrive as they were sent."""
        return [name for name, _ in self.regions if self.crcs.get(name) != sent.get(name)]


def _crc(buf: torch.Tensor) -> int:
    """CRC-32 of a piece, compared end to end: what a rank read from its
    daemon against what its peer received, before the peer commits or uses
    it (the daemon's own CRC32C covers each copy at rest)."""
    return zlib.crc32(memoryview(buf.numpy()))


def _buffer(stream: Any, count: int, length: int) -> torch.Tensor:
    """``length`` bytes of the stream's buffer for its ``count``-th piece:
    two, alternating (made once: a fresh one per piece would fault in its
    pages every time)."""
    bufs = getattr(stream, "_bufs", None)
    if bufs is None:
        bufs = stream._bufs = [torch.empty(_link.PIECE_BYTES, dtype=torch.uint8)
                              for _ in range(2)]
    return bufs[count % 2][:length]


class SaveJob:
    """One save's work across nodes, run on the link's worker."""

    # Test hook: called on the worker before the replicas are sent.
    _before_replicas: Optional[Any] = None

    def __init__(self, link: Link, store: Any, checkpoint_id: str, regions: List[str],
                 failure: str, is_coordinator: bool, replicas: int, ttl: float,
                 keep_last: Optional[int]) -> None:
        self.link, self.store, self.checkpoint_id = link, store, checkpoint_id
        self.regions, self.failure = regions, failure
        self.is_coordinator, self.replicas = is_coordinator, replicas
        self.ttl, self.keep_last = ttl, keep_last
        # The coordinator's .metadata blob (None: the save failed), from finish().
        self.metadata: "concurrent.futures.Future[Optional[bytes]]" = concurrent.futures.Future()

    def run(self) -> Replication:
        start = time.monotonic()
        topo = self.link.topo
        me = topo.rank
        sized: List[Tuple[str, int]] = []
        failure = self.failure
        if not failure:
            try:
                for name in self.regions:
                    reader = self.store.open(name, False)
                    sized.append((name, reader.size_bytes))
                    reader.close()
            except errors.Error as exc:
                failure = f"rank {me}: {_why(exc)}"
        told = self.link.all_gather({"failure": failure, "regions": sized,
                                     "coordinator": self.is_coordinator})
        failures = [t["failure"] for t in told if t["failure"]]
        coordinator = next((r for r, t in enumerate(told) if t["coordinator"]), 0)
        result = Replication(self.checkpoint_id, False, nodes=len(topo.nodes))
        why: List[str] = list(failures)
        homeless = [r for r, key in enumerate(topo.node_of) if key.startswith(NO_DAEMON)]
        if homeless and self.replicas > 0:
            # Its node is unknown: a copy sent "elsewhere" might land beside it.
            why.append(f"rank {homeless[0]} had no daemon when the job learned its nodes; "
                       "restart the job to have node-safe checkpoints")
        # The save's end first (the coordinator's finish), so that the
        # replicas' traffic starts once dcp.save has returned.
        blob: Optional[bytes] = None
        if self.is_coordinator and not failures:
            try:
                blob = self.metadata.result(timeout=self.link._timeout.total_seconds())
            except concurrent.futures.TimeoutError:
                blob = None
        blob = self.link.broadcast(blob, coordinator)
        mine = ""
        if blob is None:
            if not failures:  # (a rank's failure is said already)
                mine = "the save did not commit its .metadata"
        elif topo.leader(me):
            mine = self._commit_node_records(topo, told, blob, coordinator)
        ends = self.link.all_gather(mine)
        why += [w for w in ends if w]
        if blob is not None and self.replicas > 0:
            if SaveJob._before_replicas is not None:
                SaveJob._before_replicas()
            why += self._replicate(topo, told, result)
        if self.replicas > 0 and len(topo.nodes) > 1 and not why:
            result.node_safe = True
            if topo.leader(me):
                try:
                    _commit_small(self.store, _store.region_name(self.checkpoint_id, _store.NODE_SAFE_NAME),
                                  json.dumps({"replicas": self.replicas}).encode(), self.ttl)
                except errors.Error as exc:
                    result.node_safe = False
                    why.append(f"rank {me}: .node-safe: {_why(exc)}")
        if self.replicas > 0 and len(topo.nodes) < 2:
            why.append("the job runs on one node")
        result.why = "; ".join(dict.fromkeys(why))
        if blob is not None and topo.leader(me):
            try:
                result.deleted = _store.retain(self.store, self.keep_last, self.checkpoint_id)
            except errors.Error as exc:
                logs.log(logging.WARNING, f"retention after checkpoint {self.checkpoint_id!r} on "
                         f"this node failed: {exc}", exc.code)
        result.seconds = time.monotonic() - start
        self._report(result)
        return result

    def _replicate(self, topo: Topology, told: List[Dict[str, Any]], result: Replication) -> List[str]:
        """Streams this rank's shard to its buddies and commits the shards it
        receives; returns why not every replica committed (all ranks)."""
        me = topo.rank
        outgoing = {dst: _Outgoing(self.store, told[me]["regions"])
                    for dst in topo.buddies(me, self.replicas)}
        sources = topo.sources(me, self.replicas)
        sizes = {n: size for src in sources for n, size in told[src]["regions"]}
        writers: Dict[str, Any] = {}
        problems: List[str] = []

        def take(name: str, offset: int, piece: torch.Tensor) -> None:
            if problems:
                return
            try:
                writer = writers.get(name)
                if writer is None:
                    writer = writers[name] = self.store.create(name, sizes[name], self.ttl)
                writer.append(piece)
            except errors.Error as exc:
                problems.append(f"rank {me}: the replica of {name}: {_why(exc)}")

        incoming = {src: _Incoming(told[src]["regions"], take) for src in sources}
        self.link.exchange({d: iter(o) for d, o in outgoing.items()},
                           {s: iter(i) for s, i in incoming.items()})
        result.bytes_sent = sum(o.sent for o in outgoing.values())
        sent = self.link.all_gather({"failures": [o.failure for o in outgoing.values() if o.failure],
                                     "crcs": {dst: o.crcs for dst, o in outgoing.items()}})
        broken = {src for src in sources if sent[src]["failures"]}
        for src in sources:
            for name in incoming[src].damaged(sent[src]["crcs"].get(me, {})):
                problems.append(f"rank {me}: the replica of {name} arrived damaged (its pieces' "
                                "CRC-32 differ from what was sent)")
        for name, writer in writers.items():
            try:
                if problems or any(n == name for src in broken for n, _ in told[src]["regions"]):
                    writer.abort()
                else:
                    writer.commit()
                    result.held_for_others.append(name)
            except errors.Error as exc:
                problems.append(f"rank {me}: the replica of {name}: {_why(exc)}")
        ends = self.link.all_gather(problems)
        return ([f"rank {r}: {f}" for r, s in enumerate(sent) for f in s["failures"]] +
                [p for e in ends for p in e])

    def _commit_node_records(self, topo: Topology, told: List[Dict[str, Any]], blob: bytes,
                             coordinator: int) -> str:
        """On a node's lowest rank: .layout, and .metadata where finish did
        not commit it. Returns what failed ("" when nothing did)."""
        files = sorted({_store.split_region_name(n)[1] for t in told for n, _ in t["regions"]})
        layout = json.dumps({"files": files, "world": topo.world, "nodes": len(topo.nodes),
                             "replicas": self.replicas}).encode()
        try:
            _commit_small(self.store, _store.region_name(self.checkpoint_id, LAYOUT_NAME), layout, self.ttl)
            if topo.node_of[coordinator] != topo.node_of[topo.rank]:
                _commit_small(self.store, _store.region_name(self.checkpoint_id, _store.METADATA_NAME),
                              blob, self.ttl)
        except errors.Error as exc:
            return f"rank {topo.rank}: node records: {_why(exc)}"
        return ""

    def _report(self, result: Replication) -> None:
        if not self.is_coordinator:
            return
        if result.node_safe:
            logs.log(logging.INFO, f"checkpoint {self.checkpoint_id!r} is node-safe: every shard and "
                     f"its metadata have a copy on another of the job's {result.nodes} nodes "
                     f"({result.seconds:.2f} s after its write)", errors.StatusCode.OK)
        elif self.replicas > 0:
            logs.log(logging.WARNING, f"checkpoint {self.checkpoint_id!r} is not node-safe: "
                     f"{result.why}; the previous node-safe checkpoint is kept",
                     errors.StatusCode.UNAVAILABLE)
        elif result.why:
            logs.log(logging.WARNING, f"checkpoint {self.checkpoint_id!r} is not on every node: "
                     f"{result.why}", errors.StatusCode.UNAVAILABLE)
