"""How :class:`MemoffloadWriter` writes a rank's shard into the daemon's
regions: the region made when the plan is (``_reserve``), the items written
into it and committed under the checkpoint's name, DCP's BYTE_IO items and
what did not fit into the ``_1`` sibling."""

from __future__ import annotations

import io
import logging
import uuid
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ... import errors, logs
from . import frames as _frames
from . import outcome as _outcome
from . import stage as _stage
from . import store as _store
from .items import _RegionItem, _RegionPlan

BYTES_ROOM = 64 << 10
BYTES_ROOM_PER_ITEM = 4 << 10


class RegionWrites:
    """The region half of MemoffloadWriter (its state lives there)."""

    def _reserve(self, plan: SavePlan) -> None:
        """This rank's region, made now: a save that does not fit goes to
        the fallback before any rank writes. Its size is the plan's tensors
        (the daemon trims what is not written at the commit); when that is
        refused and some tensors are whole on every rank (replicated: DCP
        writes each from one rank only, decided after this plan), this
        rank's share of those. What does not fit the region at the write
        goes to its ``_1`` sibling."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        full = share = 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                continue
            nbytes = (item.tensor_storage_size() or 0) + _frames.FRAME_ROOM
            whole = tuple(item.tensor_data.chunk.sizes) == tuple(item.tensor_data.size)
            full += nbytes
            share += nbytes // world if whole else nbytes
        if full == 0:
            return
        # DCP's BYTE_IO items (pickled objects: an optimizer's param_groups,
        # a step) are sized only when written: room for the usual ones.
        room = BYTES_ROOM + BYTES_ROOM_PER_ITEM * sum(
            item.type == WriteItemType.BYTE_IO for item in plan.items)
        sizes = [full + room] + ([share + room] if share < full else [])
        for size in sizes:
            try:
                self._reserved = self._region_store.create(
                    f"staging/dcp/{uuid.uuid4().hex}/{self._rank}", size, self.ttl_seconds)
                return
            except errors.ResourceExhausted as exc:
                refused: errors.Error = exc
            except errors.Error as exc:
                refused = exc
                break
        if not _outcome.is_node_failure(refused):
            raise refused
        self._region_store = None
        self._unreachable_reason = (
            f"this rank's {size / 2**20:.2f} MiB do not fit: {refused.message}"
            if isinstance(refused, errors.ResourceExhausted) else str(refused))
        self._unreachable_code = int(refused.code)

    def _write_regions(self, target: _RegionPlan, plan: SavePlan,
                       planner: SavePlanner) -> List[WriteResult]:
        staged, self._staged = self._staged, None
        reserved, self._reserved = self._reserved, None
        try:
            if staged is not None:
                if _outcome.pause is not None:  # the staged bytes are in the region, not committed
                    _outcome.pause("c", self._rank)
                return _stage.write(staged, plan.items, planner, target.region,
                                    lambda region, items: self._write_region(region, items, planner))
            return self._write_region(target.region, plan.items, planner, reserved)
        except BaseException:
            for writer in (staged.writer if staged is not None else None, reserved):
                if writer is not None:
                    _abort(writer)
            raise

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

    def _write_region(self, region: str, items: List[WriteItem], planner: SavePlanner,
                      reserved: Optional[Any] = None) -> List[WriteResult]:
        """Resolves every item, then writes them all into one region; with
        ``reserved`` (the region made at the plan, under a staging name), the
        tensors into it and DCP's BYTE_IO items into ``region``'s ``_1``
        sibling."""
        # (item, parts, bytes of the parts, dtype, shape): a tensor's parts
        # are its torch.save record, head, raw bytes and tail (frames.py).
        resolved: List[Tuple[WriteItem, List[Any], int, Optional[torch.dtype],
                             Optional[Tuple[int, ...]]]] = []
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                blob = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                resolved.append((item, [blob], len(blob), None, None))
            else:
                t = data.detach()
                # A CUDA tensor is copied from the device straight into the
                # region (RegionWriter.append); other devices through the CPU.
                t = t.contiguous() if t.is_cuda else t.cpu().contiguous()
                head, tail = _frames.frames(t.dtype, tuple(t.shape))
                resolved.append((item, [head, t, tail],
                                 len(head) + t.numel() * t.element_size() + len(tail),
                                 t.dtype, tuple(t.shape)))
        groups = [(region, resolved, None)]
        if reserved is not None:  # what does not fit it goes to the _1 sibling
            inside, outside = [], []
            room = reserved.size_bytes
            for r in sorted(resolved, key=lambda r: r[3] is None):  # tensors first
                fits = r[2] <= room
                room -= r[2] if fits else 0
                (inside if fits else outside).append(r)
            groups = [(region, inside, reserved),
                      (region[: -len("_0.distcp")] + "_1.distcp", outside, None)]
        results: List[WriteResult] = []
        for name, group, writer in groups:
            total = sum(r[2] for r in group)
            if total == 0:  # nothing (or only empty items): no region (the daemon has no empty ones)
                name, offsets = "", [0] * sum(len(r[1]) for r in group)
                if writer is not None:
                    _abort(writer)
            else:
                offsets = self._commit(name, [p for r in group for p in r[1]], total, writer)
            at = 0
            for item, parts, length, dtype, shape in group:
                if dtype is None:  # a BYTE_IO item: its bytes as they are
                    info = _RegionItem(name, offsets[at], length)
                else:  # the raw bytes, inside their record
                    n = length - len(parts[0]) - len(parts[2])
                    info = _RegionItem(name, offsets[at + 1], n, dtype, shape, (offsets[at], length))
                results.append(WriteResult(index=item.index, size_in_bytes=info.length,
                                           storage_data=info))
                at += len(parts)
        return results

    def _commit(self, region: str, parts: List[Any], size_bytes: Optional[int] = None,
                writer: Optional[Any] = None) -> List[int]:
        """Creates ``region`` (or commits ``writer``, made under another
        name, as ``region``), appends ``parts`` and commits it; returns each
        part's offset."""
        store = self._region_store
        assert store is not None
        if size_bytes is None:
            size_bytes = sum(len(p) for p in parts)
        renamed = writer is not None
        if writer is None:
            writer = store.create(region, size_bytes, self.ttl_seconds)
        offsets: List[int] = []
        try:
            for part in parts:
                nbytes = part.numel() * part.element_size() if isinstance(part, torch.Tensor) else len(part)
                offsets.append(writer.append(part) if nbytes else writer.written)
                if self._after_append is not None:
                    self._after_append(region, writer.written)
                if _outcome.pause is not None and not region.endswith(_store.METADATA_NAME):
                    _outcome.pause("c", self._rank)  # part of the shard written, not committed
            writer.commit(rename_to=region) if renamed else writer.commit()
        except BaseException:
            _abort(writer)
            raise
        return offsets



def _abort(writer: Any) -> None:
    """Aborts an uncommitted region. In a daemon that died the region went
    with the session: nothing is left to abort, and nothing to say."""
    try:
        writer.abort()
    except (errors.Unavailable, errors.NotFound):
        pass
    except errors.Error as exc:
        logs.log(logging.WARNING, f"an uncommitted checkpoint region could not be aborted ({exc}); "
                 "the daemon frees it with the session", exc.code)
