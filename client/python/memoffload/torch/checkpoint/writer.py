"""MemoffloadWriter: DCP's StorageWriter into the node daemon's regions (the
package docstring says how a checkpoint is laid out)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import logging
import os
import pickle
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemWriter,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ... import errors, logs
from . import stage as _stage
from . import store as _store
from .nodes import link as _link
from . import trusted_files as _trusted_files
from .nodes.save import Replication, SaveJob

from .items import (
    DAEMON,
    FILESYSTEM,
    _FallbackPlan,
    _rank_of,
    _RankMode,
    _RegionItem,
    _RegionPlan,
    _unreachable,
    _warn_fallback,
)

__all__ = ["MemoffloadWriter"]

class MemoffloadWriter(StorageWriter):
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
        fallback_dir: Optional[str] = None,
        keep_last: Optional[int] = 2,
        checksums: bool = True,
        ttl_seconds: float = 0,
        sync_files: bool = True,
        rpc_timeout_ms: int = 30000,
        replicas: int = 0,
    ) -> None:
        super().__init__()
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        self.replicas = replicas
        self.job_id = _store.job_id_of(job_id)
        self.runtime_dir = runtime_dir or ""
        self.fallback_dir = _store.fallback_dir_of(fallback_dir, self.job_id)
        self.keep_last = keep_last
        self.checksums = checksums
        self.ttl_seconds = ttl_seconds
        self.sync_files = sync_files
        self.rpc_timeout_ms = rpc_timeout_ms
        self.checkpoint_id: Optional[str] = (
            None if checkpoint_id is None else _store.checked_checkpoint_id(checkpoint_id))
        self.save_id = str(uuid.uuid4())
        # After a save: DAEMON or FILESYSTEM; the leftovers of dead saves
        # deleted before writing; the checkpoints retention deleted after it.
        self.last_mode = ""
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
        memory (the save then takes its usual path)."""
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
        if self._staged is not None:
            self._staged.writer.abort()
            self._staged = None

    def __reduce__(self) -> Any:
        raise TypeError("MemoffloadWriter holds this process's daemon session and cannot be sent "
                        "to another process: use dcp.async_save with "
                        "AsyncCheckpointerType.THREAD (the default)")

    # -- StorageWriter --------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.checkpoint_id = _store.checked_checkpoint_id(checkpoint_id)
        self.save_id = str(uuid.uuid4())
        self.last_mode = ""
        self.last_collected = []
        self.last_deleted = []
        self._fs = None

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
        self._is_coordinator = is_coordinator
        self.wait_replication()
        self._job = None
        self._region_store, self._unreachable_reason = self._attach(self._rank)

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
        mode = _RankMode(self._rank, self._region_store is not None, self._unreachable_reason,
                         _store.runtime_dir_of(self.runtime_dir))
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
                        _store.region_name(self.checkpoint_id, f"__{i}_0.distcp")))
                    for i, p in enumerate(plans)]
        first = failed[0]
        reason = first.reason if len(modes) == 1 else f"rank {first.rank}: {first.reason}"
        return [dataclasses.replace(p, storage_data=_FallbackPlan(
                    _StoragePrefix(f"__{i}_"), first.runtime_dir, reason))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[List[WriteResult]]:
        assert self.checkpoint_id is not None
        target = plan.storage_data
        if isinstance(target, _FallbackPlan):
            self.last_mode = FILESYSTEM
            path = os.path.join(self.fallback_dir, self.checkpoint_id)
            # Every file is opened through the fallback dir's verified
            # descriptor (_trusted_files), never by path.
            fs = _trusted_files.TrustedFileSystem(
                _trusted_files.trusted_fallback_dir(self.fallback_dir, create=True))
            if fs.exists(path):
                try:
                    os.close(fs.root.open_checkpoint(self.checkpoint_id, check_files=True))
                except _trusted_files.Untrusted as exc:
                    raise _trusted_files.refused(exc) from None
            _warn_fallback("save", _unreachable(target.runtime_dir, target.reason), path)
            if self._link is not None or self.replicas > 0:
                self.last_replication = Replication(
                    self.checkpoint_id, False,
                    why=f"saved to the filesystem fallback ({target.reason})")
            self._fs = FileSystemWriter(path, sync_files=self.sync_files)
            self._fs.fs = fs
            self._fs.set_up_storage_writer(self._is_coordinator, rank=self._rank)
            fs.mkdir(path)
            if self._is_coordinator:
                _store.write_marker(fs, path, self.job_id)
            fs_fut = self._fs.write_data(dataclasses.replace(plan, storage_data=target.prefix), planner)
            self._drop_staged()  # written from the staged tensors; the region is not needed
            return fs_fut
        if not isinstance(target, _RegionPlan) or self._region_store is None:
            raise RuntimeError(f"MemoffloadWriter: unexpected plan storage_data {target!r}")
        self.last_mode = DAEMON
        fut: Future[List[WriteResult]] = Future()
        staged, self._staged = self._staged, None
        try:
            if staged is not None:
                try:
                    results = _stage.write(staged, plan.items, planner, target.region,
                                           lambda region, items: self._write_region(region, items, planner))
                except BaseException:
                    staged.writer.abort()
                    raise
            else:
                results = self._write_region(target.region, plan.items, planner)
        except BaseException as exc:
            self._replicate([], f"rank {self._rank}: {type(exc).__name__}: {exc}")
            raise
        self._replicate(sorted({wr.storage_data.region for wr in results if wr.storage_data.region}), "")
        fut.set_result(results)
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
        assert self.checkpoint_id is not None
        if self.last_mode == FILESYSTEM:
            assert self._fs is not None
            self._fs.finish(metadata, results)
            self.last_deleted = _store.retain_filesystem(
                self.fallback_dir, self.job_id, self.keep_last, self.checkpoint_id)
            return
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)
        job = self._job
        try:
            self._commit(_store.region_name(self.checkpoint_id, _store.METADATA_NAME), [blob])
        except BaseException:
            if job is not None:
                job.metadata.set_result(None)
            raise
        if job is not None:  # the other nodes get it, then retention runs on each
            job.metadata.set_result(blob)
            return
        self.last_deleted = _store.retain(self._region_store, self.keep_last, self.checkpoint_id)

    # -- regions ----------------------------------------------------------------

    def _before_writing(self) -> None:
        """On the coordinator, before any rank writes: a complete checkpoint
        of this id stays (overwriting would delete it before the new one
        commits), and what saves that died left behind (regions without a
        .metadata: never loadable) is deleted now, so that its memory counts
        for this save."""
        assert self.checkpoint_id is not None and self._region_store is not None
        found = _store.stored_checkpoints(self._region_store)
        same = found.get(self.checkpoint_id)
        if same is not None and same.complete:
            raise errors.AlreadyExists(
                f"checkpoint {self.checkpoint_id!r} of job {self.job_id!r} already exists in the daemon; "
                "save under a new checkpoint id (e.g. f'step-{step}')")
        self.last_collected += _store.collect_dead(self._region_store, found)

    def _write_region(self, region: str, items: List[WriteItem], planner: SavePlanner) -> List[WriteResult]:
        """Resolves every item, then writes them all into one region."""
        resolved: List[Tuple[WriteItem, Any, int, Optional[torch.dtype], Optional[Tuple[int, ...]]]] = []
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                blob = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                resolved.append((item, blob, len(blob), None, None))
            else:
                t = data.detach()
                # A CUDA tensor is copied from the device straight into the
                # region (RegionWriter.append); other devices through the CPU.
                t = t.contiguous() if t.is_cuda else t.cpu().contiguous()
                resolved.append((item, t, t.numel() * t.element_size(), t.dtype, tuple(t.shape)))
        total = sum(r[2] for r in resolved)
        if total == 0:  # nothing (or only empty items): no region (the daemon has no empty ones)
            region = ""
            offsets = [0] * len(resolved)
        else:
            offsets = self._commit(region, [r[1] for r in resolved], total)
        return [
            WriteResult(index=item.index, size_in_bytes=length,
                        storage_data=_RegionItem(region, offset, length, dtype, shape))
            for (item, _, length, dtype, shape), offset in zip(resolved, offsets)
        ]

    def _commit(self, region: str, parts: List[Any], size_bytes: Optional[int] = None) -> List[int]:
        """Creates ``region``, appends ``parts`` and commits it; returns each
        part's offset."""
        store = self._region_store
        assert store is not None
        if size_bytes is None:
            size_bytes = sum(len(p) for p in parts)
        writer = store.create(region, size_bytes, self.ttl_seconds)
        offsets: List[int] = []
        try:
            for part in parts:
                nbytes = part.numel() * part.element_size() if isinstance(part, torch.Tensor) else len(part)
                offsets.append(writer.append(part) if nbytes else writer.written)
                if self._after_append is not None:
                    self._after_append(region, writer.written)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        return offsets
