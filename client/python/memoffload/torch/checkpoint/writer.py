"""MemoffloadWriter: DCP's StorageWriter into the node daemon's regions (the
package docstring says how a checkpoint is laid out)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import pickle
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemWriter,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ... import errors, logs
from . import inflight as _inflight
from . import outcome as _outcome
from . import stage as _stage
from . import store as _store
from .file_writes import FileWrites
from .items import _FallbackPlan, _rank_of, _RankMode, _RegionPlan, _unreachable
from .nodes import link as _link
from .nodes.save import Replication, SaveJob
from .outcome import DAEMON, FILESYSTEM, SKIPPED, SaveResult, _RankOutcome, _SkipPlan
from .region_writes import RegionWrites, _abort

__all__ = ["MemoffloadWriter"]


class MemoffloadWriter(RegionWrites, FileWrites, StorageWriter):
    """A DCP StorageWriter into the node daemon's regions, with a visible
    filesystem fallback.

    ``job_id``: explicit job id (else ``$MEMOFFLOAD_JOB_ID``; ValueError if
    neither). ``runtime_dir``: the daemon's ("" = discovery).
    ``fallback_dir``: where checkpoints go without a daemon (else
    ``$MEMOFFLOAD_CHECKPOINT_DIR``, else ``./memoffload-checkpoints/<job>``).
    ``keep_last``: complete checkpoints kept after each successful save
    (None keeps all). ``checksums``: CRC32C of every region, verified when it
    is read. ``ttl_seconds``: the daemon deletes the regions this long after
    their commit (0: the daemon's ``regions.ttl``, 24 h by default; it caps
    larger values). ``sync_files``: fsync the fallback's files. The
    checkpoint id comes from ``dcp.save(checkpoint_id=...)`` or the
    constructor; use a new one per save (e.g. ``f"step-{step}"``).
    Needs ``use_collectives=True`` (DCP's default).

    ``on_error``: what a save does when the node tier fails (no daemon, a
    daemon that dies during the save, a checkpoint that does not fit):
    ``"fallback"`` (the default) writes it to ``fallback_dir`` where DCP's
    protocol still allows (docs/checkpoints.md, "What is lost, and when"),
    else skips it; ``"skip"`` skips it; ``"raise"`` raises. A skipped save
    leaves nothing visible (the previous checkpoint stays the latest) and
    says why in one WARNING. With "fallback" and "skip", ``dcp.save`` and
    the future of ``dcp.async_save`` return normally;
    ``writer.result(pending)`` says where the save went (a
    :class:`SaveResult`) and, with "raise", raises memoffload's own error
    (an ``Exception``, with the daemon's code) where DCP would raise its
    ``CheckpointException``. ``fallback_dir=False``: no fallback ("fallback"
    then skips). A save started while another of this process is in flight
    waits for it (``wait_previous_s``, then DeadlineExceeded).

    On a job whose ranks use the daemons of several nodes, every node gets
    the checkpoint's ``.metadata`` after the save, in the background.
    ``replicas=k`` also keeps a copy of each rank's shard in the daemons of
    the next k nodes; once every copy committed the checkpoint is node-safe
    (``wait_replication()``, ``latest_checkpoint(node_safe=True)``). Saves
    of such a job must include every rank of the default process group.

    It is also the ``AsyncStager`` that ``dcp.async_save(state, storage_writer=
    writer, ...)`` uses: the staged copy is written straight into a region that
    becomes the checkpoint (``stage``), with
    ``AsyncCheckpointerType.THREAD`` (the default) only. ``close()`` after the
    last save.
    """

    # AsyncStager: stage() copies before it returns.
    _synchronize_after_execute = False

    def __init__(
        self,
        checkpoint_id: Optional[str] = None,
        *,
        job_id: Optional[str] = None,
        runtime_dir: str = "",
        fallback_dir: Any = None,
        keep_last: Optional[int] = 2,
        checksums: bool = True,
        ttl_seconds: float = 0,
        sync_files: bool = True,
        rpc_timeout_ms: int = 30000,
        replicas: int = 0,
        on_error: str = "fallback",
        wait_previous_s: float = 600.0,
    ) -> None:
        super().__init__()
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        self.replicas = replicas
        self.job_id = _store.job_id_of(job_id)
        self.runtime_dir = runtime_dir or ""
        self.on_error = _outcome.checked_on_error(on_error)
        self.wait_previous_s = wait_previous_s
        # None: no fallback (fallback_dir=False).
        self.fallback_dir: Optional[str] = (
            None if fallback_dir is False else _store.fallback_dir_of(fallback_dir, self.job_id))
        self.keep_last = keep_last
        # The fallback dir's own retention (CheckpointManager: its durable tier's).
        self.keep_last_files = keep_last
        self.checksums = checksums
        self.ttl_seconds = ttl_seconds
        self.sync_files = sync_files
        self.rpc_timeout_ms = rpc_timeout_ms
        self.checkpoint_id: Optional[str] = (
            None if checkpoint_id is None else _store.checked_checkpoint_id(checkpoint_id))
        self.save_id = str(uuid.uuid4())
        # After a save: where this rank's shard went (DAEMON, FILESYSTEM or
        # SKIPPED); where the save went (the coordinator's, else result());
        # the leftovers of dead saves deleted before writing; the
        # checkpoints retention deleted after it.
        self.last_mode = ""
        self.last_result: Optional[SaveResult] = None
        self.last_collected: List[str] = []
        self.last_deleted: List[str] = []
        self._rank = 0
        self._is_coordinator = False
        self._region_store: Optional[Any] = None
        self._unreachable_reason = ""
        self._fs: Optional[FileSystemWriter] = None
        # Test hook: called with (region name, bytes written) after each append.
        self._after_append: Optional[Callable[[str, int], None]] = None
        # async_save: the staged region of the save to come.
        self._staged: Optional[_stage.Staged] = None
        self.last_staged: Dict[str, int] = {}
        # A save without staging: its region, created when the plan is made
        # (a save that cannot fit goes to the fallback before any rank writes).
        self._reserved: Optional[Any] = None
        # This rank's final plan and planner: the only rank of a save whose
        # daemon failed writes its shard to files from them.
        self._final: Optional[Tuple[SavePlan, SavePlanner]] = None
        # Several nodes: the job's link, this save's work across nodes, and
        # what became of the last save there.
        self._link: Optional[_link.Link] = None
        self._job: Optional[SaveJob] = None
        self._replicating: Optional[Any] = None
        self.last_replication: Optional[Replication] = None
        self._warned_one_node = False

    # -- AsyncStager (dcp.async_save) -------------------------------------------

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """A copy of ``state_dict`` in a new region of the daemon (staged, to
        become the checkpoint at the save), or, without a daemon, in torch's
        memory (the save then takes its usual path). Waits first for a save
        of this process still in flight."""
        _inflight.begin(None, id(self), self.wait_previous_s, staged=True)
        self._drop_staged()
        self.wait_replication()
        rank = _rank_of(None)
        # Attached at each stage, as the save attaches at each save: the
        # process's store for this job and rank, checked alive (a daemon
        # restart, or another writer's close(), leaves a dead one).
        store, reason = self._attach(rank)
        if store is None:
            return self._stage_in_torch(
                state_dict,
                "async checkpoint staging: "
                f"{_unreachable(_store.runtime_dir_of(self.runtime_dir), reason)}",
                errors.StatusCode.UNAVAILABLE)
        try:
            staged_dict, self._staged = _stage.stage(store, state_dict, rank, self.ttl_seconds)
        except errors.Error as e:  # a region limit, the daemon going away
            return self._stage_in_torch(
                state_dict, f"async checkpoint staging into the daemon failed ({e})", e.code)
        s = self._staged
        self.last_staged = ({"tensors": s.tensors, "bytes": s.bytes, "outside": s.outside}
                            if s is not None else {})
        return staged_dict

    def _stage_in_torch(self, state_dict: Dict[str, Any], why: str,
                        code: errors.StatusCode) -> Dict[str, Any]:
        """The staged copy in torch's memory, after a warning saying why (once
        per cause every few minutes: a full arena stays full for many saves)."""
        logs.log_limited(f"staged in torch's memory: {self.runtime_dir} "
                         f"{errors.StatusCode(int(code)).name}",
                         logging.WARNING, f"{why}; the staged copy is in torch's memory and the "
                         "save takes its usual path", code)
        self.last_staged = {}
        return _stage._walk(state_dict, lambda t: t.detach().to("cpu", copy=True))

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage() copies before it returns."""

    def close(self) -> None:
        """Aborts a staged region that was never saved and waits for the
        last save's replication. The staging session is the process's
        RegionStore for this job and rank, which other writers and readers
        share: it stays open for them."""
        self._drop_staged()
        self._release()
        _inflight.forget(id(self))
        self.wait_replication()

    def wait_replication(self, timeout: Optional[float] = None) -> Optional[Replication]:
        """Waits for the last save's work across nodes (the copies of
        ``.metadata`` and, with ``replicas``, of the shards) and returns what
        became of it: ``node_safe``, and ``why`` not. None before a save of
        a job on several nodes (or with ``replicas`` on one). With
        ``timeout``, raises ``TimeoutError`` while it still runs (ask again
        later; the next save waits for it)."""
        pending, self._replicating = self._replicating, None
        if pending is not None:
            try:
                self.last_replication = pending.result(timeout=timeout)
                self.last_deleted = self.last_replication.deleted
            except concurrent.futures.TimeoutError:
                self._replicating = pending  # still running: the next save waits for it
                raise
            except Exception as exc:  # noqa: BLE001 - the link failed (a rank died): said, not raised
                assert self._job is not None
                self.last_replication = Replication(self._job.checkpoint_id, False,
                                                    why=f"the replication failed: {exc}")
                logs.log(logging.WARNING, f"checkpoint {self._job.checkpoint_id!r} is not on every "
                         f"node: {self.last_replication.why}", errors.StatusCode.UNAVAILABLE)
        return self.last_replication

    def _drop_staged(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            _abort(staged.writer)

    def _release(self) -> None:
        reserved, self._reserved = self._reserved, None
        if reserved is not None:
            _abort(reserved)

    def result(self, pending: Any, timeout: Optional[float] = None) -> SaveResult:
        """Where the save of ``pending`` went: waits for ``pending`` (the
        future of ``dcp.async_save``, or what ``dcp.save`` returned) and
        returns its :class:`SaveResult` (``where``: "daemon", "filesystem"
        or "skipped"; ``why`` not the daemon). DCP's CheckpointException (a
        BaseException) becomes the failing rank's own error: with
        ``on_error="raise"``, memoffload's error with the daemon's code."""
        try:
            metadata = pending.result(timeout) if hasattr(pending, "result") else pending
        except BaseException as exc:
            inner = _outcome.unwrapped(exc)
            if inner is exc:
                raise
            raise inner from exc
        found = _outcome.result_of(metadata)
        if found is None:
            raise TypeError(f"{type(metadata).__name__} is not what a save with a "
                            "MemoffloadWriter returned")
        self.last_result = found
        return found

    def __reduce__(self) -> Any:
        raise TypeError("MemoffloadWriter holds this process's daemon session and cannot be sent "
                        "to another process: use dcp.async_save with "
                        "AsyncCheckpointerType.THREAD (the default)")

    # -- StorageWriter --------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        # The first call of a save, before DCP's first collective: a save of
        # this process still in flight finishes first.
        _inflight.begin(str(checkpoint_id) if checkpoint_id else self.checkpoint_id, id(self),
                        self.wait_previous_s, staged=False)
        if checkpoint_id:
            self.checkpoint_id = _store.checked_checkpoint_id(checkpoint_id)
        self.save_id = str(uuid.uuid4())
        self.last_mode = ""
        self.last_result = None
        self.last_collected = []
        self.last_deleted = []
        self._fs = None
        self._final = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _store.checkpoint_id_problem(checkpoint_id) is None

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("MemoffloadWriter needs dcp.save(..., use_collectives=True)")
        if self.checkpoint_id is None:
            raise ValueError(
                "MemoffloadWriter needs a checkpoint id: dcp.save(..., checkpoint_id='step-100')")
        self._rank = _rank_of(kwargs.get("rank"))
        _inflight.begin(self.checkpoint_id, id(self), self.wait_previous_s, staged=False)
        if _outcome.pause is not None:
            _outcome.pause("b", self._rank)
        self._is_coordinator = is_coordinator
        self._release()
        self.wait_replication()
        self._job = None
        self._unreachable_code = int(errors.StatusCode.UNAVAILABLE)
        try:
            self._region_store, self._unreachable_reason = self._attach(self._rank)
        except errors.Error as exc:  # say, a daemon that cannot take the session now
            if self.on_error == "raise" or not _outcome.is_node_failure(exc):
                raise
            self._region_store, self._unreachable_reason = None, str(exc)
            self._unreachable_code = int(exc.code)

    def _attach(self, rank: int) -> Tuple[Optional[Any], str]:
        """The process's store for this job and rank (attach()), and the
        job's link when it spans nodes, once every save the process started
        before is done across nodes: another writer's save (a writer per
        save) may still be replicating, and until then its regions on this
        node may have no .metadata (the dead saves prepare_local_plan
        collects) and its retention is still to run."""
        store, reason = _store.attach(
            self.runtime_dir, self.job_id, rank, self.checksums, self.rpc_timeout_ms)
        self._link = _link.multi_node(self.runtime_dir, store)
        if self._link is not None:
            self._link.drain()
        return store, reason

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self._link is not None and self._region_store is not None and self._link.topo.leader(
                self._link.rank):
            # Every node's lowest rank, before any rank writes (the plans
            # are gathered first): what dead saves left on this node.
            self.last_collected = _store.collect_dead(self._region_store)
        elif self._link is None and self._region_store is not None and self._is_coordinator:
            # Before this rank's region is made: what dead saves hold counts for it.
            self.last_collected = _store.collect_dead(self._region_store)
        if self._region_store is not None and self._staged is None:
            self._reserve(plan)
        mode = _RankMode(self._rank, self._region_store is not None, self._unreachable_reason,
                         _store.runtime_dir_of(self.runtime_dir), self._unreachable_code)
        return dataclasses.replace(plan, storage_data=mode)

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        assert self.checkpoint_id is not None
        modes: List[_RankMode] = [p.storage_data for p in plans]
        if self._link is not None and len(plans) != self._link.topo.world:
            raise ValueError(
                f"a save of a job that spans nodes must include all {self._link.topo.world} ranks "
                f"of the default process group (this one has {len(plans)})")
        failed = [m for m in modes if not m.daemon]
        if not failed:
            self._before_writing()
            return [dataclasses.replace(p, storage_data=_RegionPlan(
                        _store.region_name(self.checkpoint_id, f"__{i}_0.distcp"), len(plans)))
                    for i, p in enumerate(plans)]
        first = failed[0]
        reason = first.reason if len(modes) == 1 else f"rank {first.rank}: {first.reason}"
        if first.code in (int(errors.StatusCode.UNAVAILABLE), int(errors.StatusCode.NOT_FOUND)):
            why = _unreachable(first.runtime_dir, reason)
        else:
            why = f"the memoffload daemon at {first.runtime_dir} refused it ({reason})"
        if self.on_error == "raise":
            raise _outcome.as_error(f"checkpoint {self.checkpoint_id!r}: {why}", first.code)
        if self.on_error == "skip" or self.fallback_dir is None:
            return [dataclasses.replace(p, storage_data=_SkipPlan(why, first.code)) for p in plans]
        return [dataclasses.replace(p, storage_data=_FallbackPlan(
                    _StoragePrefix(f"__{i}_"), first.runtime_dir, why, first.code))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[List[WriteResult]]:
        assert self.checkpoint_id is not None
        target = plan.storage_data
        self._final = (plan, planner)
        fut: Future[List[WriteResult]] = Future()
        if isinstance(target, _SkipPlan):
            self._drop_staged()
            self._release()
            self.last_mode = SKIPPED
            fut.set_result([_outcome.outcome_result(
                _RankOutcome(self._rank, SKIPPED, target.why, target.code))])
            return fut
        if isinstance(target, _FallbackPlan):
            fut.set_result(self._to_files(plan, planner, target.prefix, target.reason, target.code))
            return fut
        if not isinstance(target, _RegionPlan) or self._region_store is None:
            raise RuntimeError(f"MemoffloadWriter: unexpected plan storage_data {target!r}")
        try:
            results = self._write_regions(target, plan, planner)
        except Exception as exc:
            why = f"rank {self._rank}: {type(exc).__name__}: {exc}"
            self._replicate([], why)
            if not _outcome.is_node_failure(exc) or self.on_error == "raise":
                raise
            code = _outcome.code_of(exc)
            if target.world == 1 and self.on_error == "fallback" and self.fallback_dir:
                # The only rank: its shard still goes to files whole.
                fut.set_result(self._to_files(plan, planner, _StoragePrefix("__0_"),
                                              f"the daemon failed during the save ({exc})", code))
                return fut
            self.last_mode = SKIPPED
            fut.set_result([_outcome.outcome_result(_RankOutcome(self._rank, SKIPPED, why, code))])
            return fut
        self.last_mode = DAEMON
        self._replicate(sorted({wr.storage_data.region for wr in results if wr.storage_data.region}), "")
        fut.set_result(results + [_outcome.outcome_result(_RankOutcome(self._rank, DAEMON))])
        return fut

    def _replicate(self, regions: List[str], failure: str) -> None:
        """After this rank's write: the save's work across nodes, in the
        background (every rank starts it, failed or not, so that the link's
        collectives pair up)."""
        assert self.checkpoint_id is not None
        if self._link is None:
            if self.replicas > 0:
                self.last_replication = Replication(self.checkpoint_id, False,
                                                    why="the job runs on one node")
                if not self._warned_one_node:
                    self._warned_one_node = True
                    logs.log(logging.WARNING, f"MemoffloadWriter(replicas={self.replicas}): every "
                             "rank of this job uses one node's daemon, so its checkpoints are not "
                             "node-safe (logged once)", errors.StatusCode.FAILED_PRECONDITION)
            return
        self._job = SaveJob(self._link, self._region_store, self.checkpoint_id, regions, failure,
                            self._is_coordinator, self.replicas, self.ttl_seconds, self.keep_last)
        self._replicating = self._link.submit(self._job.run, f"the save of {self.checkpoint_id!r}",
                                              self._region_store, save_id=self.checkpoint_id)

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """The coordinator, once every rank wrote: publishes the checkpoint
        where every rank's shard is (.metadata last), else skips it."""
        assert self.checkpoint_id is not None
        results, outcomes = _outcome.split_outcomes(results)
        wheres = {o.where for o in outcomes}
        skipped = [o for o in outcomes if o.where == SKIPPED]
        job = self._job
        if skipped:
            found = SaveResult(self.checkpoint_id, SKIPPED, why=skipped[0].why,
                               code=skipped[0].code)
        elif wheres == {FILESYSTEM}:
            found = self._finish_files(metadata, results, outcomes[0])
        elif wheres == {DAEMON}:
            found = self._finish_daemon(metadata, results, job)
        else:
            found = SaveResult(self.checkpoint_id, SKIPPED,
                               why="its ranks' shards went to different places",
                               code=int(errors.StatusCode.ABORTED))
        if found.where == SKIPPED:
            if job is not None:
                job.metadata.set_result(None)
            self._remove_partial_files()
            if self.on_error == "raise":
                raise _outcome.as_error(f"checkpoint {self.checkpoint_id!r}: {found.why}",
                                        found.code)
            _outcome.warn_skipped(self.checkpoint_id, found.why, found.code)
        self.last_result = found
        self.last_mode = found.where
        # Rides back to every rank on the Metadata dcp.save returns, after
        # the stored .metadata was written without it.
        setattr(metadata, _outcome.RESULT_ATTR, found)

    def _finish_daemon(self, metadata: Metadata, results: List[List[WriteResult]],
                       job: Optional[SaveJob]) -> SaveResult:
        """Commits .metadata; when the daemon fails here, the only rank's
        shard goes to files (from its plan), else the save is skipped."""
        assert self.checkpoint_id is not None
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)
        if _outcome.pause is not None:
            _outcome.pause("d", self._rank)
        try:
            self._commit(_store.region_name(self.checkpoint_id, _store.METADATA_NAME), [blob])
        except Exception as exc:
            if not _outcome.is_node_failure(exc) or self.on_error == "raise":
                if job is not None:
                    job.metadata.set_result(None)
                raise
            why = f"rank {self._rank}: its .metadata could not be committed ({exc})"
            if len(results) == 1 and self.on_error == "fallback" and self.fallback_dir:
                assert self._final is not None
                plan, planner = self._final
                files, outcomes = _outcome.split_outcomes([self._to_files(
                    plan, planner, _StoragePrefix("__0_"),
                    f"the daemon failed at the commit ({exc})", _outcome.code_of(exc))])
                if outcomes[0].where == FILESYSTEM:
                    return self._finish_files(metadata, files, outcomes[0])
                why = outcomes[0].why
            return SaveResult(self.checkpoint_id, SKIPPED, why=why, code=_outcome.code_of(exc))
        if job is not None:  # the other nodes get it, then retention runs on each
            job.metadata.set_result(blob)
        else:
            self.last_deleted = _store.retain(self._region_store, self.keep_last, self.checkpoint_id)
        return SaveResult(self.checkpoint_id, DAEMON)
