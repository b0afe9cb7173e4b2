"""Loading a checkpoint of a job that spans nodes (issue 33): each region
from the local daemon when it is there and intact, else from a rank whose
node holds a copy, streamed over the link (:mod:`.link`); and the
newest checkpoint every rank can load. Every function here is a collective
of the job's link: every rank calls it at the same point, as DCP's load
steps are."""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .... import errors, logs
from .. import store as _store
from .link import Link
from .save import LAYOUT_NAME, LOCAL
from .session import Session

ROUNDS = 3  # holders tried per region, at most


class BytesReader:
    """A region fetched from another node, in this process's memory (its
    checksums were verified where it was read), read like a RegionReader."""

    def __init__(self, name: str, data: torch.Tensor) -> None:
        self.name, self.data = name, data
        self.size_bytes = data.numel()

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        flat = out.view(-1).view(torch.uint8)
        flat.copy_(self.data[offset: offset + flat.numel()])

    def read_bytes(self, offset: int, length: int) -> bytes:
        return self.data[offset: offset + length].numpy().tobytes()

    def verify_rest(self) -> None:
        pass

    def close(self) -> None:
        pass


def metadata(link: Link, store: Optional[Any], local: Optional[bytes]) -> Optional[bytes]:
    """The checkpoint's .metadata blob on every rank: this node's, else the
    lowest rank's that has one, over the link (None when no node has it)."""
    def job(session: Session) -> Optional[bytes]:
        has = session.all_gather(local is not None)
        if all(has) or not any(has):
            return local
        src = has.index(True)
        lacking = [r for r, h in enumerate(has) if not h]
        _, blob = session.broadcast(local if session.rank == src else None, src, to=lacking)
        return local if local is not None else blob
    return link.submit(job, "a load's metadata", store).result()


def fetch(link: Link, store: Optional[Any], checkpoint_id: str, needed: List[str],
          verify: bool = True) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Readers for ``needed`` regions and where each came from. A region
    missing or damaged (DataLoss) in this node's daemon is streamed from a
    rank whose node holds it; NotFound names what no node had intact."""
    return link.submit(lambda session: _fetch(session, store, checkpoint_id, needed, verify),
                       f"the load of {checkpoint_id!r}", store).result()


def _closed_on_error(readers: Dict[str, Any]) -> None:
    for reader in readers.values():
        try:
            reader.close()
        except errors.Error:
            pass  # the fetch's own error is the one to raise


def _fetch(session: Session, store: Optional[Any], checkpoint_id: str, needed: List[str],
           verify: bool) -> Tuple[Dict[str, Any], Dict[str, str]]:
    readers: Dict[str, Any] = {}
    try:
        return _fetch_into(session, store, checkpoint_id, needed, verify, readers)
    except BaseException:
        _closed_on_error(readers)
        raise


def _fetch_into(session: Session, store: Optional[Any], checkpoint_id: str, needed: List[str],
                verify: bool, readers: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    topo = session.topo
    sources: Dict[str, str] = {}
    missing: List[str] = []
    bad: Set[str] = set()
    for name in needed:
        if store is None:
            missing.append(name)
            continue
        try:
            readers[name] = store.open(name, verify)  # verified whole: a bad copy is skipped
            sources[name] = LOCAL
        except (errors.NotFound, errors.Unavailable):
            missing.append(name)
        except errors.DataLoss as exc:
            logs.log(logging.WARNING, f"checkpoint {checkpoint_id!r}: this node's copy of {name} "
                     f"is damaged ({exc}); reading it from another node", exc.code)
            missing.append(name)
            bad.add(name)
    have: Dict[str, int] = {}
    if store is not None:
        try:
            for region in store.list(_store.region_name(checkpoint_id, "")):
                if region["name"] not in bad:
                    have[region["name"]] = int(region["size_bytes"])
        except errors.Error:
            have = {}
    tried: Set[Tuple[int, str]] = set()
    lost: List[str] = []  # copies tried that could not be used, and why
    asks: List[Dict[str, Any]] = []
    for _ in range(ROUNDS):
        asks = session.all_gather({"missing": missing, "have": have, "damaged": sorted(bad)})
        plan = _assign(asks, tried, topo.node_of)
        if not plan:
            break
        tried |= {(src, name) for _, name, src in plan}
        fetched, unusable = _round(session, store, plan, asks)
        for name, src, why in unusable:
            lost.append(f"{name} from rank {src}: {why}")
            logs.log(logging.WARNING, f"checkpoint {checkpoint_id!r}: the copy of {name} on rank "
                     f"{src}'s node could not be used ({why}); trying another",
                     errors.StatusCode.DATA_LOSS)
        for name, (src, data) in fetched.items():
            readers[name] = BytesReader(name, data)
            sources[name] = f"the daemon of rank {src}'s node ({topo.node_of[src]})"
            missing.remove(name)
    if missing:
        what = (f"checkpoint {checkpoint_id!r}: no node of the job holds an intact copy of "
                f"{', '.join(sorted(missing))} (looked in this node's daemon and every rank's")
        # A copy another rank found damaged in its own node's daemon is data
        # lost on every rank that needs it, not "not found" on some.
        elsewhere = sorted({f"{name} on rank {r}'s node ({topo.node_of[r]})"
                            for r, ask in enumerate(asks) if r != session.rank
                            for name in ask.get("damaged", ()) if name in missing})
        if bad or lost or elsewhere:
            raise errors.DataLoss(what + "; damaged: " + "; ".join(sorted(bad) + lost + elsewhere)
                                  + ")")
        raise errors.NotFound(what + ")")
    return readers, sources


def _round(session: Session, store: Optional[Any], plan: List[Tuple[int, str, int]],
           asks: List[Dict[str, Any]]) -> Tuple[Dict[str, Tuple[int, torch.Tensor]],
                                                 List[Tuple[str, int, str]]]:
    """One round of a fetch: every rank serves what ``plan`` asks of it and
    receives what it asked for, straight into memory. Returns, for this
    rank, {region: (server, bytes)} of the copies that arrived whole and
    intact, and (region, server, why) of those that did not."""
    me = session.rank
    outgoing: Dict[int, List[Tuple[str, int]]] = {}
    wanted: Dict[int, List[Tuple[str, int]]] = {}
    buffers: Dict[str, torch.Tensor] = {}
    server: Dict[str, int] = {}
    for r, name, src in plan:
        if src == me:
            outgoing.setdefault(r, []).append((name, int(asks[me]["have"][name])))
        if r == me:
            size = int(asks[src]["have"][name])
            buffers[name] = torch.empty(size, dtype=torch.uint8)
            wanted.setdefault(src, []).append((name, size))
            server[name] = src
    out = session.exchange(outgoing, wanted, source=store, into=buffers)
    fetched: Dict[str, Tuple[int, torch.Tensor]] = {}
    unusable: List[Tuple[str, int, str]] = []
    for name, src in server.items():
        why = out["regions"].get(name, "it was not received")
        if why:
            unusable.append((name, src, why))
        else:
            fetched[name] = (src, buffers[name])
    return fetched, unusable


def _assign(asks: List[Dict[str, Any]], tried: Set[Tuple[int, str]],
            node_of: Tuple[str, ...]) -> List[Tuple[int, str, int]]:
    """(requester, region, server) for every missing region that some rank
    of another node, not yet tried, holds (a rank of the requester's node
    has the copy the requester found missing or damaged), spreading the
    serving over holders; the same on every rank."""
    load: Dict[int, int] = {}
    plan = []
    for r, ask in enumerate(asks):
        for name in ask["missing"]:
            holders = [s for s, a in enumerate(asks) if name in a["have"] and (s, name) not in tried
                       and node_of[s] != node_of[r]]
            if not holders:
                continue
            src = min(holders, key=lambda s: (load.get(s, 0), s))
            load[src] = load.get(src, 0) + 1
            plan.append((r, name, src))
    return plan


# ---- the newest checkpoint every rank can load -------------------------------


def local_summary(store: Optional[Any], fallback: Dict[str, float]) -> Dict[str, Any]:
    """What this rank's node has: {"daemon": {id: {...}}, "files": {id: mtime}}."""
    daemon: Dict[str, Dict[str, Any]] = {}
    if store is not None:
        try:
            found = _store.stored_checkpoints(store)
        except errors.Unavailable:
            _store.forget(store)
            found = {}
        for info in found.values():
            entry = {"files": sorted(_store.split_region_name(n)[1] for n in info.regions),
                     "committed": info.committed_unix if info.complete else None,
                     "node_safe": info.node_safe, "layout": None}
            if info.complete and LAYOUT_NAME in entry["files"]:
                entry["layout"] = _read_layout(store, info.checkpoint_id)
            daemon[info.checkpoint_id] = entry
    return {"daemon": daemon, "files": fallback}


def _read_layout(store: Any, checkpoint_id: str) -> Optional[List[str]]:
    try:
        reader = store.open(_store.region_name(checkpoint_id, LAYOUT_NAME), True)
        try:
            return list(json.loads(reader.read_bytes(0, reader.size_bytes))["files"])
        finally:
            reader.close()
    except (errors.Error, ValueError, KeyError):
        return None


def newest_loadable(link: Link, store: Optional[Any], summary: Dict[str, Any],
                    node_safe: bool) -> Optional[str]:
    """The newest checkpoint that every rank can load: in the daemons, one
    whose .metadata some node has and whose data regions (its .layout) are
    each on some node (without a .layout, one every rank's node has whole);
    with ``node_safe``, only those some node marked node-safe. In the
    fallback dirs, one every rank sees. The same answer on every rank."""
    everyone = link.submit(lambda session: session.all_gather(summary), "latest_checkpoint", store,
                           listen=False).result()
    return choose(everyone, node_safe)


def choose(everyone: List[Dict[str, Any]], node_safe: bool) -> Optional[str]:
    """:func:`newest_loadable`'s rule over every rank's :func:`local_summary`."""
    best: Optional[Tuple[float, str]] = None
    ids = {c for s in everyone for c in s["daemon"]}
    for ckpt in ids:
        entries = [s["daemon"].get(ckpt) for s in everyone]
        complete = [e for e in entries if e is not None and e["committed"] is not None]
        if not complete:
            continue
        layout = next((e["layout"] for e in complete if e["layout"] is not None), None)
        if layout is None:
            if len(complete) != len(entries):
                continue
        else:
            present = {f for e in entries if e is not None for f in e["files"]}
            if not set(layout) <= present:
                continue
        if node_safe and not any(e["node_safe"] for e in complete):
            continue
        when = max(e["committed"] for e in complete)
        if best is None or (when, ckpt) > best:
            best = (when, ckpt)
    if not node_safe:
        shared = set.intersection(*(set(s["files"]) for s in everyone))
        for ckpt in shared:
            when = max(s["files"][ckpt] for s in everyone)
            if best is None or (when, ckpt) > best:
                best = (when, ckpt)
    return None if best is None else best[1]
