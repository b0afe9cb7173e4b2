"""The link between the ranks of a job that spans nodes (issue 33; issue 40:
docs/checkpoints.md, "The link between nodes").

Bytes cross nodes only over TLS 1.3 with the job's pre-shared key
(``memoffload._C.LinkListener`` / ``link_exchange``, client/cpp link.h): both
sides prove the key, every byte is encrypted and authenticated. The key:

- **key file** (secure): each node's daemon derives the job's key from a
  cluster secret the operator provisions (``[replication] key_file``), for
  this rank's uid and job id, and hands it over the broker socket only;
- **store**: no daemon of the job has a key file, so rank 0 makes a key and
  publishes it in the job's c10d store: this protects against nothing that
  can reach the store (torch.distributed's own trust), and says so once per
  job. A daemon with ``replication.require_key`` never lets it come to this.

Small values between ranks (who sends what, the outcome of each stream)
go through the job's store as JSON sealed with an HMAC-SHA256 under the key
(session.py); nothing received is unpickled. Every collective job (a save's
replication, a load's fetch, latest_checkpoint) starts with an agreement
through the store: each rank says which call it is making, its address and
port, and the rank's key id, sealed. A rank that is not making the same call
gets a clear error. A save is also a point where the ranks agree again on
where they are: a call that failed on some ranks leaves the next save
working (nothing stays "out of step until the job restarts").

Every use of the link runs on one worker thread, in the order the ranks
submitted it: each rank submits the same jobs in the same order (the saves'
replication and the loads' fetches), as DCP's own steps are.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import queue
import secrets
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from .... import _C, errors, logs
from .session import _STORE_KEY_ID, SECURE, STORE, Session
from .topology import (  # noqa: F401 - re-exported for the writer, reader and tests
    ADDRESS_ENV,
    IFNAME_ENV,
    NO_DAEMON,
    PREFIX,
    Topology,
    address,
    several_nodes,
    timeout_s,
    topology,
)

# At most this long, at exit, for the last save's replication.
EXIT_WAIT_S = 120.0
_SECURE_MARK = "none: rank 0 has a key file"

_warned_store_mode = False


class Link:
    """The job's link between nodes, and the one thread that uses it."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.rank = topo.rank
        self._timeout = timedelta(seconds=timeout_s())
        self._calls = 0  # collective jobs agreed so far
        self._saves: Dict[str, int] = {}  # saves of a checkpoint id so far (resync points)
        self._pending = 0  # jobs submitted and not done
        self._count_lock = threading.Lock()
        self._store_key: Optional[bytes] = None
        self._marked_secure = False
        self._secure_keys: Optional[List[Tuple[str, bytes]]] = None
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
            self.submit_local(lambda: None).result(timeout=wait)
        except concurrent.futures.TimeoutError:
            logs.log(logging.WARNING, f"exiting with a checkpoint's replication unfinished after "
                     f"{wait:.0f} s: it is not node-safe", errors.StatusCode.DEADLINE_EXCEEDED)

    def drain(self) -> None:
        """Waits until every job this rank submitted so far has run: the
        replication of a save made through another writer of this process
        (one writer per save), whose .metadata may not be on this node yet
        and whose retention is still to run."""
        self.submit_local(lambda: None).result()

    def submit_local(self, fn: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
        """Runs ``fn`` on the worker, after every job submitted before it."""
        return self._put(lambda: fn())

    def submit(self, fn: Callable[[Any], Any], call: str, store: Optional[Any], *,
               listen: bool = True, save_id: str = "") -> "concurrent.futures.Future[Any]":
        """Runs the collective job ``fn(session)`` on the worker, after every
        job submitted before it: every rank submits the same ones, in the
        same order. ``store``: this rank's RegionStore (its daemon gives the
        key), or None. ``listen``: the job streams bytes, so it listens for
        its peers while it runs. ``save_id``: a save's checkpoint id, on which
        the ranks agree again where they are."""
        def job() -> Any:
            session = Session.open(self, call, store, listen, save_id)
            try:
                return fn(session)
            finally:
                session.close()
        return self._put(job)

    def _put(self, fn: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._count_lock:
            self._pending += 1
        self._jobs.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the submitter
                fut.set_exception(exc)
            finally:
                with self._count_lock:
                    self._pending -= 1

    # ---- keys (on the worker) ----------------------------------------------------

    def keys(self, store: Optional[Any]) -> Tuple[str, List[Tuple[str, bytes]]]:
        """(mode, keys): this rank's key(s) for this job, the first to seal
        and connect with. SECURE when this rank's daemon has a key file (or
        had: a rank whose daemon died keeps the keys it was given, so that
        it still loads from the other nodes); else STORE, with the key rank 0
        made for the job."""
        problem = " (this rank has no daemon)"
        if store is not None:
            try:
                keys = [(str(i), bytes(k)) for i, k in store.replication_keys()]
                if self.rank == 0 and not self._marked_secure:
                    # Store-mode ranks of other nodes wait for rank 0's key:
                    # they learn at once that there is none to take.
                    dist.distributed_c10d._get_default_store().set(f"{PREFIX}/store-key",
                                                                   _SECURE_MARK)
                    self._marked_secure = True
                self._secure_keys = keys
                return SECURE, keys
            except errors.NotFound:
                self._secure_keys = None  # no key file on this node (any more): the store's key
                problem = ""
            except errors.FailedPrecondition:
                raise
            except errors.Error as exc:
                problem = f" (its daemon did not say: {exc})"
        if self._secure_keys is not None:
            return SECURE, self._secure_keys
        return STORE, [(_STORE_KEY_ID, self._job_store_key(problem))]

    def _job_store_key(self, problem: str) -> bytes:
        """The key rank 0 makes for the job and publishes in its store, once."""
        global _warned_store_mode
        if self._store_key is not None:
            return self._store_key
        c10d = dist.distributed_c10d._get_default_store()
        name = f"{PREFIX}/store-key"
        if self.rank == 0:  # (over a mark of secure mode, if its daemon lost its key file)
            c10d.set(name, secrets.token_hex(32))
        c10d.wait([name], self._timeout)
        said = c10d.get(name).decode()
        if said == _SECURE_MARK:
            raise errors.FailedPrecondition(
                "rank 0's node has a replication key file and this rank's node has none" + problem +
                ": give every node's memoffloadd the same replication.key_file "
                "(docs/checkpoints.md)")
        self._store_key = bytes.fromhex(said)
        if self.rank == 0 and not _warned_store_mode:
            _warned_store_mode = True
            logs.log(logging.WARNING,
                     "checkpoint replication between this job's nodes uses a key published in the "
                     "job's store: rank 0's memoffloadd has no replication.key_file" + problem +
                     ". Anyone who can reach the job's store (as torch.distributed's rendezvous) "
                     "can join the link; give every node's daemon the same key file to make it "
                     "secure (docs/checkpoints.md)", errors.StatusCode.FAILED_PRECONDITION)
        return self._store_key

    def next_call(self, save_id: str) -> Tuple[int, str]:
        """(this job's call number, its agreement key's name): saves agree
        under their checkpoint id (and attempt), where every rank meets
        whatever happened before; other jobs under the next call number."""
        self._calls += 1
        if save_id:
            attempt = self._saves.get(save_id, 0) + 1
            self._saves[save_id] = attempt
            return self._calls, f"{PREFIX}/save/{save_id}/{attempt}"
        return self._calls, f"{PREFIX}/call/{self._calls}"


_link: Optional[Link] = None
_lock = threading.Lock()


def link(topo: Topology) -> Link:
    """The process's link (made on first use; one topology per process)."""
    global _link
    with _lock:
        if _link is None:
            _link = Link(topo)
        return _link


def multi_node(runtime_dir: str, store: Optional[Any]) -> Optional[Link]:
    """The link when the job spans several nodes, else None. ``store``: this
    rank's RegionStore (None without a daemon), which names its node."""
    topo = topology(runtime_dir, store)
    if topo is None or len(topo.nodes) < 2:
        return None
    bad = [(r, p) for r, p in enumerate(topo.problems) if p]
    if bad:
        raise errors.FailedPrecondition(
            "memoffload checkpoints of a job on several nodes send their bytes between nodes from "
            "each rank's replication address; " + "; ".join(f"rank {r}: {p}" for r, p in bad[:4]) +
            f" (set ${ADDRESS_ENV} to an address of the rank's host, or ${IFNAME_ENV} to an "
            "interface)")
    return link(topo)


def _check_listener_available() -> None:
    if not hasattr(_C, "LinkListener"):
        raise errors.FailedPrecondition(
            "this build of memoffload._C has no link between nodes (reinstall memoffload)")
