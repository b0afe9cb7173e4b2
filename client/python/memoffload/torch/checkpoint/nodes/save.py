"""Checkpoints of a job that spans nodes, and their replicas (issue 33).

After each rank has committed its shard into its own node's daemon, every
rank's replication job (on the link's worker thread, :mod:`.link`):

1. tells every rank what it wrote (and whether it could);
2. the coordinator's ``.metadata`` (committed there by DCP's ``finish``)
   goes over the link to the lowest rank of every other node, which commits
   it, so that each node can find every piece; every node also gets
   ``.layout`` (the data regions the checkpoint has);
3. with ``replicas=k``, streams its shard to the rank with the same local
   index on each of the next k nodes, which commits it into its own daemon
   under the same region name once every piece arrived intact, and receives
   the shards it keeps for others (both in ``memoffload._C.link_exchange``:
   read from one daemon's arena, written into the other's);
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
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .... import errors, logs
from .. import store as _store
from .link import NO_DAEMON, Link, Topology
from .session import Session

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

    def run(self, session: Session) -> Replication:
        start = time.monotonic()
        topo = session.topo
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
        told = session.all_gather({"failure": failure, "regions": sized,
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
                blob = self.metadata.result(timeout=session.timeout.total_seconds())
            except concurrent.futures.TimeoutError:
                blob = None
        # The .metadata goes over the link to every other node's lowest rank.
        leaders = [r for r in range(topo.world)
                   if topo.leader(r) and topo.node_of[r] != topo.node_of[coordinator]]
        mine = ""
        try:
            has_blob, blob = session.broadcast(blob, coordinator, to=leaders)
        except errors.Error as exc:
            has_blob, mine = False, f"rank {me}: the .metadata over the link: {exc}"
        if not has_blob:
            if not failures and not mine:  # (a rank's failure is said already)
                mine = "the save did not commit its .metadata"
        elif topo.leader(me):
            mine = self._commit_node_records(topo, told, blob, coordinator)
        ends = session.all_gather(mine)
        why += [w for w in ends if w]
        if has_blob and self.replicas > 0:
            if SaveJob._before_replicas is not None:
                SaveJob._before_replicas()
            why += self._replicate(session, told, result)
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
        if has_blob and topo.leader(me):
            try:
                result.deleted = _store.retain(self.store, self.keep_last, self.checkpoint_id)
            except errors.Error as exc:
                logs.log(logging.WARNING, f"retention after checkpoint {self.checkpoint_id!r} on "
                         f"this node failed: {exc}", exc.code)
        result.seconds = time.monotonic() - start
        self._report(result)
        return result

    def _replicate(self, session: Session, told: List[Dict[str, Any]],
                   result: Replication) -> List[str]:
        """Streams this rank's shard to its buddies, which commit it into their
        daemons once every piece arrived intact; returns why not every
        replica committed (the same list on every rank)."""
        topo = session.topo
        me = topo.rank
        sends = {dst: told[me]["regions"] for dst in topo.buddies(me, self.replicas)}
        receives = {src: told[src]["regions"] for src in topo.sources(me, self.replicas)}
        out = session.exchange(sends, receives, source=self.store, store=self.store, ttl=self.ttl)
        result.bytes_sent = int(out["bytes_sent"])
        result.held_for_others = [str(n) for n in out["committed"]]
        problems = [f"rank {me}: sending to rank {r}: {w}" for r, w in out["send_failures"].items()]
        problems += [f"rank {me}: receiving from rank {r}: {w}"
                     for r, w in out["receive_failures"].items()]
        problems += [f"rank {me}: the replica of {name}: {w}"
                     for name, w in sorted(out["regions"].items()) if w]
        ends = session.all_gather(problems)
        return [p for e in ends for p in e]

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
