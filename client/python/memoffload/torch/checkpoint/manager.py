"""CheckpointManager: one object that runs a job's checkpoint tiers.

::

    manager = CheckpointManager({"app": AppState(model, optimizer)}, job_id=JOB,
                                node_every=50, durable_every=500, durable_dir=f"/ckpt/{JOB}")
    start = manager.restore() or 0          # on every rank; the same answer everywhere
    for step in range(start + 1, total + 1):
        train_step(step)
        manager.step(step)                  # saves when due
    manager.close()

Every ``node_every`` steps a save goes to the node's daemon (with
``replicas``, copies on the next nodes), with ``dcp.async_save`` by default;
every ``durable_every`` steps that node checkpoint is also persisted to
``durable_dir`` in the background (persist.py), in DCP's own FileSystem
layout. ``restore()`` loads the newest checkpoint every rank can load from
the fastest tier that has it, and first finishes or removes what a killed
persist left. Retention per tier: ``keep_last_node``, ``keep_last_durable``.
docs/checkpoints.md."""

from __future__ import annotations

import atexit
import errno
import logging
import re
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ... import errors, logs
from . import durable_url as _durable_url
from . import outcome as _outcome
from . import persist as _persist
from . import store as _store
from .latest import latest_checkpoint
from .nodes import load as _node_load
from .outcome import DAEMON, FILESYSTEM, SaveResult
from .reader import MemoffloadReader
from .writer import MemoffloadWriter

__all__ = ["CheckpointManager"]

PERSIST_SHARE = 0.1
_STEP_ID = re.compile(r"^step-(\d+)$")


def step_of(checkpoint_id: Optional[str]) -> Optional[int]:
    """The step of a manager's checkpoint id (``step-<N>``), else None."""
    match = _STEP_ID.match(checkpoint_id or "")
    return int(match.group(1)) if match else None


def _world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CheckpointManager:
    """Saves ``state`` (DCP's dict of Stateful objects and tensors) to the
    node's daemon every ``node_every`` steps and persists every
    ``durable_every``-th step's (0: never) to ``durable_dir`` (the job's
    directory of files, also the writer's ``fallback_dir``; default
    ``$MEMOFFLOAD_CHECKPOINT_DIR`` or ``./memoffload-checkpoints/<job>``).
    ``keep_last_node`` / ``keep_last_durable``: checkpoints kept per tier.
    ``replicas``, ``on_error``, ``runtime_dir``: the writer's.
    ``async_save``: ``dcp.async_save`` (staged into the daemon; training
    goes on while it is written). ``persist_share``: of one core's and the
    disk's time the background persist may use (1: unthrottled).
    Construct it on every rank; ``restore``, ``step`` and ``close`` are
    collectives (call them on every rank, at the same steps)."""

    def __init__(self, state: Dict[str, Any], job_id: Optional[str] = None, *,
                 node_every: int = 100, durable_every: int = 0, durable_dir: Optional[str] = None,
                 replicas: int = 0, keep_last_node: int = 2, keep_last_durable: Optional[int] = 2,
                 async_save: bool = True, on_error: str = "fallback", runtime_dir: str = "",
                 persist_share: float = PERSIST_SHARE, persist_timeout_s: float = 600.0) -> None:
        if node_every < 1:
            raise ValueError(f"node_every must be >= 1, got {node_every}")
        if durable_every < 0:
            raise ValueError(f"durable_every must be >= 0 (0: never), got {durable_every}")
        if not 0 < persist_share <= 1:
            raise ValueError(f"persist_share must be in (0, 1], got {persist_share}")
        if keep_last_durable is not None and keep_last_durable < 1:
            raise ValueError(f"keep_last_durable must be >= 1 or None, got {keep_last_durable}")
        self.state = state
        self.job_id = _store.job_id_of(job_id)
        self.runtime_dir = runtime_dir
        self.durable_dir = _store.fallback_dir_of(durable_dir, self.job_id)
        self.node_every = node_every
        self.durable_every = durable_every
        self.keep_last_durable = keep_last_durable
        self.async_save = async_save
        self.persist_share = persist_share
        self.persist_timeout_s = persist_timeout_s
        self.url = _durable_url.is_url(self.durable_dir)  # an object store (fsspec)
        # A save the daemon cannot take goes to the durable dir whole (a
        # local one: the writer's fallback writes files only).
        self.writer = MemoffloadWriter(job_id=self.job_id, runtime_dir=runtime_dir,
                                       fallback_dir=False if self.url else self.durable_dir,
                                       keep_last=keep_last_node, replicas=replicas,
                                       on_error=on_error)
        # A save that went to the durable dir (no daemon) counts in its retention.
        self.writer.keep_last_files = keep_last_durable
        self.on_error = on_error
        self._rank, self._world = _world()
        # The saves' collectives apart from training's (async_save runs them
        # on a thread of its own).
        self._group = (dist.new_group(backend="gloo")
                       if async_save and dist.is_available() and dist.is_initialized() else None)
        self._pending: Optional[Dict[str, Any]] = None  # the async save in flight
        self._persisting: Optional[threading.Thread] = None
        # persisting (the id in flight), _persisting and _queued change under it
        self._persist_lock = threading.Lock()
        self._queued: Optional[tuple] = None  # (id, step, token, shard): the persist waiting its turn
        self._persist_error: Optional[BaseException] = None
        self._piece_bytes = 64 << 20
        self.last_node_save: Dict[str, Any] = {}
        self.last_persisted: Dict[str, Any] = {}
        self.persisting: Optional[str] = None
        self.last_restore: Dict[str, Any] = {}
        atexit.register(self._at_exit)

    # -- saving ---------------------------------------------------------------

    def step(self, step: int) -> Optional[SaveResult]:
        """Saves when ``step`` is due; returns the SaveResult of the save
        that completed in this call (a synchronous one, or with
        ``async_save`` the previous one once done), else None."""
        done = self._collect()
        node_due = step % self.node_every == 0
        durable_due = self.durable_every > 0 and step % self.durable_every == 0
        if not (node_due or durable_due):
            return done
        checkpoint_id = f"step-{step}"
        started = time.perf_counter()
        if self.async_save:
            done = self._collect(wait=True) or done  # one save in flight at a time
        self._raise_persist_errors()
        if self.async_save:
            future = dcp.async_save(self.state, storage_writer=self.writer,
                                    checkpoint_id=checkpoint_id, process_group=self._group)
            self._pending = {"future": future, "step": step, "durable": durable_due,
                             "started": started, "blocked_s": time.perf_counter() - started}
            return done
        metadata = dcp.save(self.state, storage_writer=self.writer, checkpoint_id=checkpoint_id)
        blocked = time.perf_counter() - started
        return self._saved(metadata, step, durable_due, blocked, blocked)

    def _collect(self, wait: bool = False) -> Optional[SaveResult]:
        """The async save in flight, once done (``wait``: waits for it)."""
        pending = self._pending
        if pending is None or (not wait and not pending["future"].done()):
            return None
        self._pending = None
        metadata = pending["future"].result()
        return self._saved(metadata, pending["step"], pending["durable"], pending["blocked_s"],
                           time.perf_counter() - pending["started"])

    def _saved(self, metadata: Any, step: int, durable_due: bool, blocked_s: float,
               total_s: float) -> SaveResult:
        result = self.writer.result(metadata)
        self.last_node_save = {"step": step, "where": result.where, "blocked_s": blocked_s,
                               "seconds": total_s, "why": result.why}
        if not durable_due or not result.saved:
            return result
        if result.where == FILESYSTEM:  # the fallback went to the durable dir itself
            self.last_persisted = {"step": step, "path": result.path, "bytes": 0, "seconds": 0.0}
        elif result.where == DAEMON:
            save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
            self._start_persist(result.checkpoint_id, step, save_id or result.checkpoint_id)
        return result

    # -- persisting -----------------------------------------------------------

    def _start_persist(self, checkpoint_id: str, step: int, token: str) -> None:
        if checkpoint_id in self._durable():
            return  # persisted already (by the run that saved it, or at a restore)
        # This rank's regions, open now: node retention deleting them before
        # their turn keeps their bytes until the persist closes them.
        shard: Any
        try:
            store, reason = _store.attach(self.runtime_dir, self.job_id, self._rank, True)
            if store is None:
                raise errors.Unavailable(f"checkpoint {checkpoint_id!r} cannot be persisted: {reason}")
            shard = (_persist.open_shard(store, checkpoint_id, self._rank),
                     _persist.node_metadata(store, checkpoint_id) if self._rank == 0 else None)
        except errors.Error as exc:
            shard = exc  # raised by the persist itself, which says so (and tells the coordinator)
        with self._persist_lock:
            if self.persisting is not None:
                # One waits its turn; the one that waited is dropped (every
                # rank drops it, or says so in its record: the coordinator
                # then gives up on it at once).
                if self._queued is not None:
                    self._drop(*self._queued, because=checkpoint_id)
                self._queued = (checkpoint_id, step, token, shard)
                return
            self._begin(checkpoint_id, step, token, shard)

    def _begin(self, checkpoint_id: str, step: int, token: str, shard: Any) -> None:
        """Under _persist_lock: the persist thread (``persisting`` until _next)."""
        self.persisting = checkpoint_id
        self._persisting = threading.Thread(
            target=self._persist, args=(checkpoint_id, step, token, shard),
            name=f"memoffload-persist-{checkpoint_id}", daemon=True)
        self._persisting.start()

    def _drop(self, checkpoint_id: str, step: int, token: str, shard: Any, because: str) -> None:
        if isinstance(shard, tuple):
            _persist.close_shard(shard[0])
        logs.log(logging.WARNING, f"checkpoint {checkpoint_id!r} is not persisted: "
                 f"{self.persisting!r} was still being persisted when {because!r} came (raise "
                 "durable_every or persist_share)", errors.StatusCode.RESOURCE_EXHAUSTED)
        if self._rank != 0:
            try:
                (_durable_url if self.url else _persist).record_failure(
                    self.durable_dir, self.job_id, checkpoint_id, self._rank, token,
                    f"rank {self._rank} dropped it: {self.persisting!r} was still being "
                    "persisted")
            except (OSError, errors.Error):
                pass  # the coordinator then gives up at its timeout

    def _next(self) -> None:
        """At the end of a persist: the one that waited, if any."""
        with self._persist_lock:
            queued, self._queued = self._queued, None
            self.persisting = None
            if queued is not None:
                self._begin(*queued)

    def _persist(self, checkpoint_id: str, step: int, token: str, opened: Any) -> None:
        """This rank's shard, and on the coordinator the publish (a thread)."""
        try:
            if isinstance(opened, BaseException):
                raise opened
            regions, node = opened
            tier = _durable_url if self.url else _persist
            shard = tier.persist_shard(regions, self.durable_dir, self.job_id, checkpoint_id,
                                       self._rank, token, self.persist_share,
                                       piece_bytes=self._piece_bytes)
            if self._rank != 0:
                return
            started = time.perf_counter()
            path = tier.publish(node, self.durable_dir, self.job_id, checkpoint_id, self._world,
                                token, self.persist_timeout_s)
            store, _ = _store.attach(self.runtime_dir, self.job_id, self._rank, True)
            deleted = (_durable_url.retain if self.url else _store.retain_filesystem)(
                self.durable_dir, self.job_id, self.keep_last_durable, checkpoint_id)
            if store is not None:  # while the node still holds it (retention may not have)
                _persist.mark_persisted(store, checkpoint_id)
            for older in self._partial_ids():  # what ranks wrote of checkpoints dropped since
                if (step_of(older) or 0) < step:
                    self._remove_partial(older)
            self.last_persisted = {"step": step, "path": path, "bytes": shard.bytes,
                                   "seconds": shard.seconds + time.perf_counter() - started,
                                   "direct": shard.direct, "deleted": deleted}
            logs.log(logging.INFO, f"checkpoint {checkpoint_id!r} is persisted to {path} "
                     f"(rank 0's {shard.bytes / 2**20:.1f} MiB in {shard.seconds:.2f} s, "
                     f"{'O_DIRECT' if shard.direct else 'buffered'}, share "
                     f"{self.persist_share:g}; deleted {deleted or 'none'})", errors.StatusCode.OK)
        except BaseException as exc:  # noqa: BLE001 - said here, raised by step() with on_error="raise"
            self._persist_error = exc
            if self._rank != 0:
                try:
                    (_durable_url if self.url else _persist).record_failure(
                        self.durable_dir, self.job_id, checkpoint_id, self._rank, token, str(exc))
                except (OSError, errors.Error):
                    pass  # the coordinator then gives up at its timeout
            else:  # nothing unpublished stays (the other ranks' files included)
                try:
                    self._remove_partial(checkpoint_id)
                except OSError as cleanup:
                    # Another rank still writes into it: the next publish, or
                    # the next restore, removes it.
                    level = logging.INFO if cleanup.errno == errno.ENOTEMPTY else logging.WARNING
                    logs.log(level, f"what the persist of {checkpoint_id!r} left in "
                             f"{self.durable_dir} stays for now: {cleanup}",
                             errors.StatusCode.INTERNAL)
                except errors.Error as cleanup:
                    logs.log(logging.WARNING, f"what the persist of {checkpoint_id!r} left in "
                             f"{self.durable_dir} stays for now: {cleanup}", cleanup.code)
            logs.log(logging.WARNING, f"checkpoint {checkpoint_id!r} was not persisted: {exc}; the "
                     "node checkpoint stays, and the next durable save tries again",
                     _outcome.code_of(exc) if isinstance(exc, Exception) else
                     errors.StatusCode.CANCELLED)
        finally:
            self._next()

    def _raise_persist_errors(self) -> None:
        """With on_error="raise", at a save (no save in flight): a persist
        that failed on any rank raises on every rank, so that none goes on
        into the save's collectives alone."""
        if self.on_error != "raise":
            return
        exc, self._persist_error = self._persist_error, None
        everyone = self._all(exc is None)
        if exc is not None and isinstance(exc, Exception):
            raise exc
        if not everyone:
            raise errors.FailedPrecondition("a checkpoint was not persisted: another rank's "
                                            "persist failed (its log says why)")

    def _raise_persist_error(self) -> None:
        exc, self._persist_error = self._persist_error, None
        if exc is not None and self.on_error == "raise" and isinstance(exc, Exception):
            raise exc

    def wait_persisted(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Waits for the persist in flight (on the coordinator, until it is
        published); returns ``last_persisted``. TimeoutError while it runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._persist_lock:
                if self.persisting is None:
                    break
                running = self._persisting
            assert running is not None
            running.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if running.is_alive():
                raise TimeoutError(f"checkpoint {self.persisting!r} is still being persisted")
        self._raise_persist_error()
        return self.last_persisted

    # -- restoring ------------------------------------------------------------

    def restore(self) -> Optional[int]:
        """Loads the newest checkpoint every rank can load into ``state``,
        from the fastest tier that has it (this node's daemon, a peer's,
        the durable dir), and returns its step; None when the job has none.
        First finishes persisting the newest node checkpoint that a killed
        run did not, and removes what unpublished persists left."""
        self._recover()  # first: a finished persist it publishes counts below
        checkpoint_id = self._newest()
        if checkpoint_id is None:
            logs.log(logging.INFO, f"job {self.job_id!r} has no checkpoint yet: starting from the "
                     "beginning", errors.StatusCode.OK)
            return None
        reader = MemoffloadReader(job_id=self.job_id, runtime_dir=self.runtime_dir,
                                  fallback_dir=self.durable_dir)
        started = time.perf_counter()
        dcp.load(self.state, storage_reader=reader, checkpoint_id=checkpoint_id)
        remote = [n for n, where in reader.last_sources.items() if where != _node_load.LOCAL]
        tier = (f"durable storage ({self.durable_dir})" if reader.last_mode != DAEMON
                else f"the daemons ({len(remote)} region(s) from other nodes)" if remote
                else "this node's daemon")
        logs.log(logging.INFO, f"restored checkpoint {checkpoint_id!r} from {tier} in "
                 f"{time.perf_counter() - started:.2f} s", errors.StatusCode.OK)
        self.last_restore = {"checkpoint_id": checkpoint_id, "tier": reader.last_mode,
                             "sources": dict(reader.last_sources)}
        return step_of(checkpoint_id)

    def _newest(self) -> Optional[str]:
        """The newest checkpoint every rank can load, the same on every rank."""
        return self._agree(latest_checkpoint(
            self.job_id, self.runtime_dir, None if self.url else self.durable_dir,
            _files=self._durable() if self.url else None))

    def newest_step(self) -> Optional[int]:
        """The step of the job's newest checkpoint (any tier), without
        loading it; None when it has none. A collective, as ``restore``."""
        return step_of(self._newest())

    def _agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self._world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _recover(self) -> None:
        """What killed persists left: the newest node checkpoint that was
        due for the durable tier and is newer than every durable one is
        persisted again (when every rank still has its
        regions), and every unpublished persist dir is removed first."""
        decision: Optional[Dict[str, Any]] = None
        if self._rank == 0:
            decision = self._recovery_plan()
        decision = self._agree(decision)
        if not decision:
            return
        checkpoint_id = decision["finish"]
        store, _ = _store.attach(self.runtime_dir, self.job_id, self._rank, True)
        have = bool(store is not None and _persist.shard_regions(store, checkpoint_id, self._rank))
        everyone = self._all(have)
        if not everyone:
            if self._rank == 0:
                logs.log(logging.WARNING, f"checkpoint {checkpoint_id!r} was not persisted by the "
                         "run that saved it, and not every rank's daemon still has its shard: it "
                         "stays in the node tier only", errors.StatusCode.NOT_FOUND)
            return
        if self._rank == 0:
            logs.log(logging.INFO, f"checkpoint {checkpoint_id!r} was not persisted by the run that "
                     "saved it: persisting it now", errors.StatusCode.OK)
        self._start_persist(checkpoint_id, step_of(checkpoint_id) or 0, decision["token"])

    def _recovery_plan(self) -> Optional[Dict[str, Any]]:
        for partial in self._partial_ids():
            if not self.url and _persist.finish_partial(self.durable_dir, self.job_id, partial):
                logs.log(logging.INFO, f"published checkpoint {partial!r}, which a killed persist "
                         f"had finished, in {self.durable_dir}", errors.StatusCode.OK)
                continue
            self._remove_partial(partial)
            logs.log(logging.INFO, f"removed what an unfinished persist of checkpoint {partial!r} "
                     f"left in {self.durable_dir}", errors.StatusCode.OK)
        if self.durable_every == 0:
            return None
        store, _ = _store.attach(self.runtime_dir, self.job_id, 0, True)
        if store is None:
            return None
        durable = self._durable()
        newest_durable = max(durable.values(), default=0.0)
        node = [c for c in _store.stored_checkpoints(store).values()
                if c.complete and c.checkpoint_id not in durable
                and c.committed_unix > newest_durable
                and (step_of(c.checkpoint_id) or -1) % self.durable_every == 0]
        if not node:
            return None
        newest = max(node, key=lambda c: (c.committed_unix, c.checkpoint_id))
        return {"finish": newest.checkpoint_id, "token": uuid.uuid4().hex}

    def _durable(self) -> Dict[str, float]:
        """{id: its node commit time} of the durable tier's checkpoints."""
        if self.url:
            return _durable_url.checkpoints(self.durable_dir, self.job_id)
        return _store.filesystem_checkpoints(self.durable_dir, self.job_id)

    def _partial_ids(self) -> List[str]:
        return (_durable_url if self.url else _persist).partial_ids(self.durable_dir, self.job_id)

    def _remove_partial(self, checkpoint_id: str) -> None:
        (_durable_url if self.url else _persist).remove_partial(self.durable_dir, self.job_id,
                                                                 checkpoint_id)

    def _all(self, flag: bool) -> bool:
        if self._world == 1:
            return flag
        flags: List[Any] = [None] * self._world
        dist.all_gather_object(flags, flag, group=self._group)
        return all(flags)

    # -- the view -------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        """Which checkpoints each tier holds (node ids with ``node_safe`` and
        ``persisted`` flags, durable ids), what is being persisted, and the
        last node save's and persist's figures."""
        node: List[Dict[str, Any]] = []
        store, _ = _store.attach(self.runtime_dir, self.job_id, self._rank, True)
        if store is not None:
            try:
                found = _store.stored_checkpoints(store)
            except errors.Unavailable:
                found = {}
            for c in sorted(found.values(), key=lambda c: c.committed_unix, reverse=True):
                if c.complete:
                    node.append({"checkpoint_id": c.checkpoint_id, "node_safe": c.node_safe,
                                 "persisted": any(r.endswith("/" + _persist.PERSISTED_REGION)
                                                  for r in c.regions),
                                 "bytes": c.size_bytes})
        durable = self._durable()
        return {"node": node,
                "durable": sorted(durable, key=lambda c: durable[c], reverse=True),
                "persisting": self.persisting,
                "partial": self._partial_ids(),
                "last_node_save": dict(self.last_node_save),
                "last_persisted": dict(self.last_persisted)}

    def close(self, wait_persist: bool = True) -> None:
        """Waits for the save and (``wait_persist``) the persist in flight;
        then the writer's close. Without waiting, a persist in flight goes
        on in its thread (the process's exit waits for it up to 120 s)."""
        self._collect(wait=True)
        if wait_persist:
            self.wait_persisted()
            atexit.unregister(self._at_exit)
        self.writer.close()

    def _at_exit(self) -> None:
        running = self._persisting
        if running is not None and running.is_alive():
            logs.log(logging.INFO, f"waiting up to 120 s for checkpoint {self.persisting!r} to be "
                     "persisted before the process exits", errors.StatusCode.OK)
            try:
                self.wait_persisted(120)
            except Exception:  # noqa: BLE001 - its failure was said by the persist itself
                pass
