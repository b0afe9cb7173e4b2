"""Which rank of a job is on which node, and each rank's replication address.

A "node" is a daemon: ranks whose sessions are on the same daemon instance
are on the same node, whatever their host names (pods of one machine) or
paths, and tests give each simulated node a daemon of its own on one
machine. A rank without a daemon is a node of its own (its host name and
runtime dir); it holds nothing. Each rank publishes its node in the job's c10d
store (the default process group's), and reads everyone else's: no
collective, so it is safe from any thread.

The bytes between nodes go from and to each rank's replication address:
``$MEMOFFLOAD_REPLICATION_ADDRESS``, else the IPv4 address of the interface
``$MEMOFFLOAD_REPLICATION_IFNAME``, else of ``$GLOO_SOCKET_IFNAME``'s (the job's
own network), else the host name's address; so that replicas can use another
network than training's. A rank whose address cannot be used says so when
the job learns its topology, and every rank's save names it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from .... import errors
from .. import store as _store

ADDRESS_ENV = "MEMOFFLOAD_REPLICATION_ADDRESS"
IFNAME_ENV = "MEMOFFLOAD_REPLICATION_IFNAME"
TIMEOUT_ENV = "MEMOFFLOAD_REPLICATION_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
PREFIX = "memoffload/link"
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
    """Which node (``node_of[rank]``, a node key) each rank of the job is on,
    and each rank's replication address."""

    rank: int
    node_of: Tuple[str, ...]
    # Per rank: why its replication address cannot be used ("" when it can).
    problems: Tuple[str, ...] = ()
    addresses: Tuple[str, ...] = ()

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


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def several_nodes() -> bool:
    """Whether the job may span nodes, without asking the other ranks: it
    has several ranks, and more than ``$LOCAL_WORLD_SIZE`` (torchrun's) when
    that is set. ``latest_checkpoint`` is a collective only then, so that a
    single-node job may still call it on one rank."""
    if not distributed():
        return False
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return not local.isdigit() or dist.get_world_size() > int(local)


# ---- the replication address ------------------------------------------------


def _interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (OSError when none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                             struct.pack("256s", name.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def address_setting() -> Tuple[str, str]:
    """(the setting that names this rank's replication address, the address)."""
    value = os.environ.get(ADDRESS_ENV, "")
    if value:
        return f"${ADDRESS_ENV}={value!r}", value
    for env in (IFNAME_ENV, "GLOO_SOCKET_IFNAME"):
        name = os.environ.get(env, "").split(",")[0]
        if name:
            return f"${env}={name!r}", _interface_address(name)
    host = socket.gethostname()
    return f"the host name {host!r}", socket.gethostbyname(host)


def address() -> str:
    return address_setting()[1]


def address_problem() -> str:
    """Why this rank cannot use its replication address, or ""."""
    setting = ADDRESS_ENV
    try:
        setting, where = address_setting()
        family = socket.AF_INET6 if ":" in where else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((socket.getaddrinfo(where, None, family)[0][4][0], 0))
    except OSError as exc:
        return f"{setting}: {exc}"
    return ""


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
    if not distributed():
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
        problem = address_problem()
        store.set(f"{PREFIX}/node/{rank}",
                  json.dumps([node_key(runtime_dir, region_store), problem,
                              "" if problem else address()]))
        names = [f"{PREFIX}/node/{r}" for r in range(world)]
        wait = timeout_s()
        try:
            store.wait(names, timedelta(seconds=wait))
        except Exception as exc:  # noqa: BLE001 - the store's own timeout error, reworded
            raise errors.DeadlineExceeded(
                f"rank {rank}: memoffload checkpoints in a job of {world} ranks ask every rank "
                f"which node it is on, and not every rank answered within {wait:.0f} s ({exc}); "
                "call the writer, the reader and latest_checkpoint() on every rank") from exc
        told = [json.loads(store.get(n).decode()) for n in names]
        _topology = Topology(rank, tuple(str(t[0]) for t in told), tuple(str(t[1]) for t in told),
                             tuple(str(t[2]) for t in told))
        _topology_dir = where
        return _topology
