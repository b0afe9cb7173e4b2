"""torch.distributed.checkpoint (DCP) into the node daemon's arena.

::

    import torch.distributed.checkpoint as dcp
    from memoffload.torch.checkpoint import MemoffloadWriter, MemoffloadReader, latest_checkpoint

    writer = MemoffloadWriter(job_id="run-42", fallback_dir="/ckpt/run-42", keep_last=2)
    dcp.save(state, storage_writer=writer, checkpoint_id=f"step-{step}")
    ...
    ckpt = latest_checkpoint(job_id="run-42", fallback_dir="/ckpt/run-42")   # after a restart
    dcp.load(state, storage_reader=MemoffloadReader(job_id="run-42", fallback_dir="/ckpt/run-42"),
             checkpoint_id=ckpt)

Each rank writes its items into one region, ``dcp/<id>/__<rank>_0.distcp``:
raw tensor bytes and the bytes of DCP's BYTE_IO items, back to back. The
coordinator then commits ``dcp/<id>/.metadata`` (the pickled DCP Metadata
whose storage_data names region, offset and length of every item), last: a
checkpoint is complete iff that region exists, so a save killed half-way never
reads as complete. Only after that commit are older checkpoints deleted
(``keep_last``).

When some rank cannot reach a daemon, every rank writes a normal DCP
filesystem checkpoint into ``<fallback_dir>/<id>`` instead (the decision is
made once, by the coordinator, from every rank's local plan), and each rank
logs one warning naming the runtime dir, the reason and the path. The reader
takes the daemon's copy when there is one, else the fallback directory's.

Regions are owned by (uid, job id): a restarted job finds its checkpoints
only with the same explicit job id (``job_id=`` or ``$MEMOFFLOAD_JOB_ID``).
They do not survive a restart of the daemon (docs/checkpoints.md).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemReader,
    FileSystemWriter,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import errors, logs
from . import _checkpoint_store as _store
from . import _trusted_files
from ._checkpoint_store import latest_checkpoint

__all__ = ["MemoffloadWriter", "MemoffloadReader", "latest_checkpoint"]

DAEMON = "daemon"
FILESYSTEM = "filesystem"


@dataclass(frozen=True)
class _RegionItem:
    """Where one item of a daemon checkpoint is (Metadata.storage_data).
    ``dtype`` and ``shape`` describe a tensor item's raw bytes; both are None
    for a BYTE_IO item."""

    region: str
    offset: int
    length: int
    dtype: Optional[torch.dtype] = None
    shape: Optional[Tuple[int, ...]] = None


@dataclass(frozen=True)
class _RankMode:
    """A rank's local SavePlan.storage_data: could it reach the daemon."""

    rank: int
    daemon: bool
    reason: str
    runtime_dir: str


@dataclass(frozen=True)
class _RegionPlan:
    """The coordinator's answer when every rank reached the daemon."""

    region: str


@dataclass(frozen=True)
class _FallbackPlan:
    """The coordinator's answer when some rank did not: the prefix DCP's
    FileSystemWriter would give this rank, and why."""

    prefix: _StoragePrefix
    runtime_dir: str
    reason: str


def _rank_of(rank: Optional[int]) -> int:
    if rank is not None:
        return int(rank)
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _warn_fallback(what: str, why: str, path: str) -> None:
    # The "memoffload" logger; with no handler configured Python's last-resort
    # handler prints WARNING records on stderr.
    logs.log(logging.WARNING, f"checkpoint {what} falls back to the filesystem: {why}; using {path}",
             errors.StatusCode.UNAVAILABLE)


def _unreachable(runtime_dir: str, reason: str) -> str:
    return f"no memoffload daemon reachable at {runtime_dir} ({reason})"


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
    """

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
    ) -> None:
        super().__init__()
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
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
        self._region_store, self._unreachable_reason = _store.attach(
            self.runtime_dir, self.job_id, self._rank, self.checksums, self.rpc_timeout_ms)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        mode = _RankMode(self._rank, self._region_store is not None, self._unreachable_reason,
                         _store.runtime_dir_of(self.runtime_dir))
        return dataclasses.replace(plan, storage_data=mode)

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        assert self.checkpoint_id is not None
        modes: List[_RankMode] = [p.storage_data for p in plans]
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
            _trusted_files.ensure_fallback_dir(self.fallback_dir)
            if os.path.lexists(path):
                _trusted_files.check_checkpoint(self.fallback_dir, path)
            _warn_fallback("save", _unreachable(target.runtime_dir, target.reason), path)
            self._fs = FileSystemWriter(path, sync_files=self.sync_files)
            self._fs.set_up_storage_writer(self._is_coordinator, rank=self._rank)
            self._fs.fs.mkdir(path)
            if self._is_coordinator:
                _store.write_marker(path, self.job_id)
            return self._fs.write_data(dataclasses.replace(plan, storage_data=target.prefix), planner)
        if not isinstance(target, _RegionPlan) or self._region_store is None:
            raise RuntimeError(f"MemoffloadWriter: unexpected plan storage_data {target!r}")
        self.last_mode = DAEMON
        fut: Future[List[WriteResult]] = Future()
        fut.set_result(self._write_region(target.region, plan.items, planner))
        return fut

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
        self._commit(_store.region_name(self.checkpoint_id, _store.METADATA_NAME), [blob])
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
        dead = [c for c in found.values() if not c.complete]
        for info in dead:
            _store.delete_checkpoint(self._region_store, info)
        self.last_collected = [c.checkpoint_id for c in dead]

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


class MemoffloadReader(StorageReader):
    """A DCP StorageReader of checkpoints written by :class:`MemoffloadWriter`:
    from the daemon's regions when the checkpoint is there, else (with one
    warning) from ``<fallback_dir>/<id>``. ``verify``: check the CRC32C of
    each checksummed region, as its items are copied out (memoffload.DataLoss
    on a mismatch; the load then fails, and the state dict may hold part of
    the bad checkpoint). Other arguments as for the writer."""

    def __init__(
        self,
        checkpoint_id: Optional[str] = None,
        *,
        job_id: Optional[str] = None,
        runtime_dir: str = "",
        fallback_dir: Optional[str] = None,
        verify: bool = True,
        rpc_timeout_ms: int = 30000,
    ) -> None:
        super().__init__()
        self.job_id = _store.job_id_of(job_id)
        self.runtime_dir = runtime_dir or ""
        self.fallback_dir = _store.fallback_dir_of(fallback_dir, self.job_id)
        self.verify = verify
        self.rpc_timeout_ms = rpc_timeout_ms
        self.checkpoint_id: Optional[str] = (
            None if checkpoint_id is None else _store.checked_checkpoint_id(checkpoint_id))
        self.load_id = str(uuid.uuid4())
        self.storage_data: Dict[Any, Any] = {}
        self.last_mode = ""
        self._region_store: Optional[Any] = None
        self._fs: Optional[FileSystemReader] = None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.checkpoint_id = _store.checked_checkpoint_id(checkpoint_id)
        self.load_id = str(uuid.uuid4())
        self.storage_data = {}
        self.last_mode = ""
        self._fs = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _store.checkpoint_id_problem(checkpoint_id) is None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("memoffload checkpoints have one global .metadata, no per-rank one")
        if self.checkpoint_id is None:
            raise ValueError("MemoffloadReader needs a checkpoint id: dcp.load(..., checkpoint_id=...) "
                             "(latest_checkpoint() names the newest)")
        runtime_dir = _store.runtime_dir_of(self.runtime_dir)
        store, reason = _store.attach(self.runtime_dir, self.job_id, _rank_of(None), True,
                                      self.rpc_timeout_ms)
        if store is not None:
            name = _store.region_name(self.checkpoint_id, _store.METADATA_NAME)
            try:
                reader = store.open(name, self.verify)
            except errors.Unavailable as exc:
                _store.forget(store)
                why = _unreachable(runtime_dir, str(exc))
            except errors.NotFound:
                why = f"the memoffload daemon at {runtime_dir} has no checkpoint {self.checkpoint_id!r} " \
                      f"of job {self.job_id!r}"
            else:
                try:
                    metadata = pickle.loads(reader.read_bytes(0, reader.size_bytes))
                finally:
                    reader.close()
                self._region_store = store
                self.last_mode = DAEMON
                return self._stamped(metadata)
        else:
            why = _unreachable(runtime_dir, reason)
        path = os.path.join(self.fallback_dir, self.checkpoint_id)
        if not os.path.exists(os.path.join(path, _store.METADATA_NAME)):
            raise FileNotFoundError(f"checkpoint {self.checkpoint_id!r} not found: {why}, and {path} "
                                    f"has no {_store.METADATA_NAME}")
        _trusted_files.check_checkpoint(self.fallback_dir, path)  # before a byte is unpickled
        _warn_fallback("load", why, path)
        self._fs = FileSystemReader(path)
        self.last_mode = FILESYSTEM
        return self._stamped(self._fs.read_metadata())

    def _stamped(self, metadata: Metadata) -> Metadata:
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._fs is not None:
            self._fs.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            return
        if metadata.storage_data is None:
            raise AssertionError("storage_data must not be None in metadata")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=(_rank_of(None), self.last_mode))

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        modes = {mode for _, mode in (p.storage_data for p in plans)}
        if len(modes) > 1:
            where = ", ".join(f"rank {r}: {m}" for r, m in (p.storage_data for p in plans))
            raise RuntimeError(
                f"checkpoint {self.checkpoint_id!r}: the ranks read it from different places ({where})")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._fs is not None:
            return self._fs.read_data(plan, planner)
        assert self._region_store is not None
        readers: Dict[str, Any] = {}
        try:
            for req in plan.items:
                info: _RegionItem = self.storage_data[req.storage_index]
                reader = readers.get(info.region)
                if reader is None and info.length:
                    # Checksums are checked as the items are copied out (in
                    # region order, the order they were written), and what
                    # no read covered, at the end: one pass over the bytes.
                    reader = readers[info.region] = self._region_store.open(
                        info.region, self.verify, verify_as_read=True)
                if req.type == LoadItemType.BYTE_IO:
                    blob = reader.read_bytes(info.offset, info.length) if info.length else b""
                    planner.load_bytes(req, io.BytesIO(blob))
                    continue
                target = planner.resolve_tensor(req).detach()
                _read_tensor(reader, info, req.storage_offsets, req.lengths, target, req.storage_index)
                planner.commit_tensor(req, target)
            for reader in readers.values():
                reader.verify_rest()
        finally:
            for reader in readers.values():
                reader.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _read_tensor(reader: Any, info: _RegionItem, offsets: Any, lengths: Any,
                 target: torch.Tensor, index: Any) -> None:
    """Copies the stored chunk, narrowed to ``offsets``/``lengths`` as
    FileSystemReader narrows it, into ``target``: straight from the region
    when the whole chunk is wanted in a matching CPU tensor."""
    assert info.dtype is not None and info.shape is not None
    whole = all(o == 0 for o in offsets) and tuple(lengths) == info.shape
    if (whole and target.device.type == "cpu" and target.dtype == info.dtype
            and tuple(target.shape) == info.shape and target.is_contiguous()):
        if info.length:
            reader.read_into(info.offset, target)
        return
    chunk = torch.empty(info.shape, dtype=info.dtype)
    if info.length:
        reader.read_into(info.offset, chunk)
    chunk = narrow_tensor_by_index(chunk, offsets, lengths)
    if target.size() != chunk.size():
        raise AssertionError(f"req {index} mismatch sizes {target.size()} vs {chunk.size()}")
    target.copy_(chunk)
