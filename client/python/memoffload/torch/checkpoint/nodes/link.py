"""The link between the ranks of a job that spans nodes: which rank is on
which node, and a gloo process group of its own for the checkpoints' traffic
between nodes (issue 33, docs/checkpoints.md "Several nodes").

A "node" is a daemon: ranks whose sessions are on the same daemon instance
are on the same node, whatever their host names (pods of one machine) or
paths, and tests give each simulated node a daemon of its own on one
machine. A rank without a daemon is a node of its own (its host name and
runtime dir); it holds nothing. Each rank publishes its node in the job's c10d
store (the default process group's), and reads everyone else's: no
collective, so it is safe from any thread.

The group is a ``ProcessGroupGloo`` made over a prefix of that store, not a
``dist.new_group``: it never takes a slot in c10d's group numbering (a group
made here, from a background thread, would shift every later
``new_group`` of the trainer), its traffic never races training's
collectives, and it can listen on an address of its own
(``$MEMOFFLOAD_REPLICATION_ADDRESS``, or the interface
``$MEMOFFLOAD_REPLICATION_IFNAME``; else gloo's default, which follows
``$GLOO_SOCKET_IFNAME``), so that replicas can use another network than
training's. Every use of the group runs on one worker thread, in the order
the ranks submitted it: each rank submits the same jobs in the same order
(the saves' replication and the loads' fetches), as DCP's own steps are.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import os
import pickle
import queue
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .... import errors, logs
from .. import store as _store

ADDRESS_ENV = "MEMOFFLOAD_REPLICATION_ADDRESS"
IFNAME_ENV = "MEMOFFLOAD_REPLICATION_IFNAME"
TIMEOUT_ENV = "MEMOFFLOAD_REPLICATION_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
IN_STEP = ("call latest_checkpoint, the saves and the loads of a job on several nodes on every "
           "rank, in the same order; this process's checkpoints are no longer replicated "
           "(restart the job)")
# At most this long, at exit, for the last save's replication.
EXIT_WAIT_S = 120.0
# Bytes in flight per stream: what each rank holds at once while sending.
PIECE_BYTES = 32 << 20
_PREFIX = "memoffload/link"
NO_DAEMON = "no daemon at "


def timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        return float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"${TIMEOUT_ENV}={value!r} is not a number of seconds") from None


def node_key(runtime_dir: str, store: Optional[Any]) -> str:
    """The daemon instance of ``store``'s session, or, without one, the
    host name and runtime dir."""
    if store is not None:
        try:
            return f"memoffloadd instance {store.instance_id:016x}"
        except errors.Error:
            pass  # the daemon went away: no node to share
    return f"{NO_DAEMON}{socket.gethostname()}:{os.path.realpath(_store.runtime_dir_of(runtime_dir))}"


@dataclass(frozen=True)
class Topology:
    """Which node (``node_of[rank]``, a node key) each rank of the job is on."""

    rank: int
    node_of: Tuple[str, ...]
    # Per rank: why its replication device cannot be made ("" when it can).
    problems: Tuple[str, ...] = ()

    @property
    def world(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> List[str]:
        """The nodes, in the order of their lowest rank."""
        return list(dict.fromkeys(self.node_of))

    def ranks_on(self, node: str) -> List[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def leader(self, rank: int) -> bool:
        """The lowest rank of its node: the one that writes what is the node's."""
        return self.ranks_on(self.node_of[rank])[0] == rank

    def buddies(self, rank: int, replicas: int) -> List[int]:
        """Where ``rank``'s shard has its replicas: the rank with the same
        local index on each of the next ``replicas`` nodes (ring order), so
        that no node holds two copies of a shard. Fewer when there are fewer
        other nodes."""
        nodes = self.nodes
        here = nodes.index(self.node_of[rank])
        local = self.ranks_on(nodes[here]).index(rank)
        out = []
        for shift in range(1, min(replicas, len(nodes) - 1) + 1):
            there = self.ranks_on(nodes[(here + shift) % len(nodes)])
            out.append(there[local % len(there)])
        return out

    def sources(self, rank: int, replicas: int) -> List[int]:
        """The ranks whose replicas ``rank`` holds."""
        return [r for r in range(self.world) if rank in self.buddies(r, replicas)]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# Once per process: the job's ranks stay where they are.
_topology: Optional[Topology] = None
_topology_dir = ""
_lock = threading.Lock()


def topology(runtime_dir: str, region_store: Optional[Any]) -> Optional[Topology]:
    """The job's topology (None outside a job of several ranks). Every rank
    must ask once (any call of the writer, the reader or latest_checkpoint
    does): each waits up to the replication timeout for the others'
    answers."""
    global _topology, _topology_dir
    if not _distributed():
        return None
    where = os.path.realpath(_store.runtime_dir_of(runtime_dir))
    with _lock:
        if _topology is not None:
            if where != _topology_dir:
                raise ValueError(
                    "memoffload checkpoints of a job that spans nodes use one runtime dir per "
                    f"process; this process already uses {_topology_dir}, not {where}")
            return _topology
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_PREFIX}/node/{rank}",
                  json.dumps([node_key(runtime_dir, region_store), _device_problem()]))
        names = [f"{_PREFIX}/node/{r}" for r in range(world)]
        wait = timeout_s()
        try:
            store.wait(names, timedelta(seconds=wait))
        except Exception as exc:  # noqa: BLE001 - the store's own timeout error, reworded
            raise errors.DeadlineExceeded(
                f"rank {rank}: memoffload checkpoints in a job of {world} ranks ask every rank "
                f"which node it is on, and not every rank answered within {wait:.0f} s ({exc}); "
                "call the writer, the reader and latest_checkpoint() on every rank") from exc
        told = [json.loads(store.get(n).decode()) for n in names]
        _topology = Topology(rank, tuple(t[0] for t in told), tuple(t[1] for t in told))
        _topology_dir = where
        return _topology


# ---- the link ---------------------------------------------------------------


class Link:
    """The job's gloo group for checkpoint traffic between nodes, and the one
    thread that uses it."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.rank = topo.rank
        self._timeout = timedelta(seconds=timeout_s())
        self._pg: Optional[Any] = None
        self._calls = 0  # collective jobs so far (_agree)
        self._broken = ""  # why the group is out of step, once it is
        self._count_lock = threading.Lock()
        self._pending = 0  # jobs submitted and not done
        self._jobs: "queue.Queue[Any]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="memoffload-replication",
                                        daemon=True)
        self._thread.start()
        atexit.register(self._finish_at_exit)

    def _finish_at_exit(self) -> None:
        """A trainer that exits right after its last save: the save's
        replication finishes first (else that checkpoint would not be
        node-safe, and the peers' half of it would wait for this rank)."""
        if self._pending == 0:
            return
        wait = min(self._timeout.total_seconds(), EXIT_WAIT_S)
        logs.log(logging.INFO, f"waiting up to {wait:.0f} s at exit for a checkpoint's "
                 "replication to other nodes to finish", errors.StatusCode.OK)
        try:
            self.submit(lambda: None).result(timeout=wait)
        except concurrent.futures.TimeoutError:
            logs.log(logging.WARNING, f"exiting with a checkpoint's replication unfinished after "
                     f"{wait:.0f} s: it is not node-safe", errors.StatusCode.DEADLINE_EXCEEDED)

    def drain(self) -> None:
        """Waits until every job this rank submitted so far has run: the
        replication of a save made through another writer of this process
        (one writer per save), whose .metadata may not be on this node yet
        and whose retention is still to run."""
        self.submit(lambda: None).result()

    def submit(self, fn: Callable[[], Any], call: str = "") -> "concurrent.futures.Future[Any]":
        """Runs ``fn`` on the worker, after every job submitted before it.
        ``call`` names a job that uses the group (a collective: every rank
        submits the same ones, in the same order); "" a local one."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._count_lock:
            self._pending += 1
        self._jobs.put((fn, fut, call))
        return fut

    def _run(self) -> None:
        while True:
            fn, fut, call = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if call:
                    self._agree(call)
                try:
                    fut.set_result(fn())
                except errors.Error:
                    raise  # the daemon's answer: the jobs handle those between collectives
                except BaseException as exc:
                    if call:  # a collective failed half-way: the ranks are out of step
                        self._broken = f"{call} failed: {type(exc).__name__}: {exc}"
                    raise
            except BaseException as exc:  # noqa: BLE001 - handed to the submitter
                fut.set_exception(exc)
            finally:
                with self._count_lock:
                    self._pending -= 1

    def _agree(self, call: str) -> None:
        """Before a collective job: every rank says, through the job's c10d
        store, which call it is making as its ``_calls``-th; a rank whose
        link broke says so. A rank that is not making the same call (say
        ``latest_checkpoint`` on rank 0 alone) gets a clear error, and the
        group itself is left in step, untouched."""
        self._calls += 1
        store = dist.distributed_c10d._get_default_store()
        mine = f"broken: {self._broken}" if self._broken else call
        store.set(f"{_PREFIX}/call/{self._calls}/{self.rank}", mine)
        if self._broken:  # said, for the ranks that wait on it; nothing to wait for here
            raise self._out_of_step()
        names = [f"{_PREFIX}/call/{self._calls}/{r}" for r in range(self.topo.world)]
        wait = self._timeout.total_seconds()
        try:
            store.wait(names, self._timeout)
        except Exception as exc:  # noqa: BLE001 - the store's timeout, reworded
            self._broken = f"{call} was made by this rank alone"
            raise errors.DeadlineExceeded(
                f"rank {self.rank}: {call} is a collective across the job's nodes, and not every "
                f"rank made it within {wait:.0f} s; {IN_STEP}") from exc
        said = [store.get(n).decode() for n in names]
        if self._calls > 1:  # every rank has read the previous call's keys
            store.delete_key(f"{_PREFIX}/call/{self._calls - 1}/{self.rank}")
        broken = [(r, w) for r, w in enumerate(said) if w.startswith("broken: ")]
        if broken:
            r, w = broken[0]
            self._broken = f"rank {r}: {w[len('broken: '):]}"
            raise self._out_of_step()
        if any(w != call for w in said):
            others = "; ".join(f"rank {r}: {w}" for r, w in enumerate(said) if w != call)
            self._broken = f"rank {self.rank}'s call {self._calls} was {call}, but {others}"
            raise errors.FailedPrecondition(
                f"the ranks are out of step across the job's nodes ({self._broken}): {IN_STEP}")

    def _out_of_step(self) -> errors.Error:
        return errors.Unavailable(f"the link between this job's nodes is out of step "
                                  f"({self._broken}): {IN_STEP}")

    def _group(self) -> Any:
        if self._pg is None:
            store = dist.PrefixStore(f"{_PREFIX}/pg", dist.distributed_c10d._get_default_store())
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self._timeout
            opts._devices = [_device()]
            self._pg = dist.ProcessGroupGloo(store, self.rank, self.topo.world, opts)
        return self._pg

    # -- on the worker thread only ---------------------------------------------

    def all_gather(self, obj: Any) -> List[Any]:
        pg = self._group()
        blob = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.topo.world)]
        pg.allgather([sizes], [torch.tensor([blob.numel()], dtype=torch.int64)]).wait()
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: blob.numel()] = blob
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.topo.world)]
        pg.allgather([out], [padded]).wait()
        return [pickle.loads(t[: int(s.item())].numpy().tobytes()) for t, s in zip(out, sizes)]

    def broadcast(self, obj: Any, src: int) -> Any:
        pg = self._group()
        blob = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(blob)], dtype=torch.int64)
        pg.broadcast(size, src).wait()
        data = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if self.rank == src
                else torch.empty(int(size.item()), dtype=torch.uint8))
        if data.numel():
            pg.broadcast(data, src).wait()
        return pickle.loads(data.numpy().tobytes())

    def exchange(self, sends: Dict[int, Iterator[torch.Tensor]],
                 recvs: Dict[int, Iterator[Tuple[torch.Tensor, Callable[[], None]]]]) -> None:
        """Streams pieces to and from peers, all streams at once, in rounds:
        every stream posts its next piece (a send; or a receive into the
        buffer its iterator gives, with what to do once it is filled); while
        they travel, the previous round's received pieces are handed on and
        the next pieces to send are read (so streams alternate two
        buffers); then the round is waited for. Each side knows how many
        pieces a stream has, so the rounds always pair up."""
        pg = self._group()
        ahead = {dst: next(it, None) for dst, it in sends.items()}
        live_recvs = dict(recvs)
        landed: List[Callable[[], None]] = []
        while True:
            works = []
            for dst, piece in list(ahead.items()):
                if piece is None:
                    del ahead[dst]
                    continue
                works.append(pg.send([piece], dst, 0))
            arriving: List[Callable[[], None]] = []
            for src, it in list(live_recvs.items()):
                item = next(it, None)
                if item is None:
                    del live_recvs[src]
                    continue
                works.append(pg.recv([item[0]], src, 0))
                arriving.append(item[1])
            for done in landed:
                done()
            if not works:
                return
            for dst in ahead:
                ahead[dst] = next(sends[dst], None)
            for work in works:
                work.wait()
            landed = arriving


def _device_setting() -> Tuple[str, Dict[str, str]]:
    """Which setting names the gloo device replicas use, and its arguments:
    ``$MEMOFFLOAD_REPLICATION_ADDRESS``, else ``$MEMOFFLOAD_REPLICATION_IFNAME``,
    else gloo's default."""
    for env, arg in ((ADDRESS_ENV, "hostname"), (IFNAME_ENV, "interface")):
        value = os.environ.get(env, "")
        if value:
            return f"${env}={value!r}", {arg: value}
    return "gloo's default device ($GLOO_SOCKET_IFNAME or the host name)", {}


def _device() -> Any:
    _, args = _device_setting()
    if args:
        return dist.ProcessGroupGloo.create_device(**args)
    return dist.ProcessGroupGloo.create_default_device()


def _device_problem() -> str:
    """Why this rank cannot make its replication device, or ""."""
    try:
        _device()
    except Exception as exc:  # noqa: BLE001 - gloo's own error, named to every rank
        first = str(exc).strip().splitlines()
        return f"{_device_setting()[0]}: {first[0] if first else type(exc).__name__}"
    return ""


_link: Optional[Link] = None


def link(topo: Topology) -> Link:
    """The process's link (made on first use; one topology per process, so
    one link: its group's name in the store is the same on every rank)."""
    global _link
    with _lock:
        if _link is None:
            _link = Link(topo)
        return _link


def several_nodes() -> bool:
    """Whether the job may span nodes, without asking the other ranks: it
    has several ranks, and more than ``$LOCAL_WORLD_SIZE`` (torchrun's) when
    that is set. ``latest_checkpoint`` is a collective only then, so that a
    single-node job may still call it on one rank."""
    if not _distributed():
        return False
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return not local.isdigit() or dist.get_world_size() > int(local)


def multi_node(runtime_dir: str, store: Optional[Any]) -> Optional[Link]:
    """The link when the job spans several nodes, else None. ``store``: this
    rank's RegionStore (None without a daemon), which names its node."""
    topo = topology(runtime_dir, store)
    if topo is None or len(topo.nodes) < 2:
        return None
    bad = [(r, p) for r, p in enumerate(topo.problems) if p]
    if bad:
        raise errors.FailedPrecondition(
            "memoffload checkpoints of a job on several nodes need a gloo device on every rank "
            "for the traffic between nodes; " + "; ".join(f"rank {r}: {p}" for r, p in bad[:4]) +
            f" (set ${ADDRESS_ENV} to an address of the rank's host, or ${IFNAME_ENV} to an "
            "interface)")
    return link(topo)


def pieces(total: int) -> Iterator[Tuple[int, int]]:
    """(offset, length) of the pieces of ``total`` bytes."""
    offset = 0
    while offset < total:
        length = min(PIECE_BYTES, total - offset)
        yield offset, length
        offset += length
