"""DCP ``async_save`` staging straight into a checkpoint region, for
:class:`memoffload.torch.checkpoint.MemoffloadWriter` (which is the
``AsyncStager`` that ``async_save`` uses when given the writer).

``stage`` copies every tensor of the state dict (a DTensor's local shard; a
CUDA tensor from the device) into one region of this rank's session, created
under a staging name (``staging/dcp/<uuid>/<rank>``), each tensor contiguous
in one extent and aligned, and returns the same state dict over those bytes.
Training may change its own tensors from then on. In the background save,
``write_data`` records where each staged tensor already is (no copy) and
commits the region under the checkpoint's own name (``dcp/<id>/__<rank>_0.distcp``,
the daemon's rename-on-commit): the staged copy *is* the checkpoint, with
no per-rank staging buffer and no second copy. Items that were not staged
(DCP's BYTE_IO items, a tensor larger than a chunk) go to
``dcp/<id>/__<rank>_1.distcp`` the usual way.

A staged region is its writer session's until that commit: a save that dies
first leaves nothing (the daemon frees the region with the session), and the
next ``stage`` or ``close`` aborts one that was never saved. Only
``AsyncCheckpointerType.THREAD``: the staged tensors live in this process's
mapping of the arena.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import frames as _frames

ALIGN = 64


@dataclass
class Staged:
    """One rank's staged state: the region being written and where each
    staged tensor's storage starts in it."""

    writer: Any  # _C.RegionWriter
    name: str
    offsets: Dict[int, int] = field(default_factory=dict)  # storage data_ptr -> region offset
    # region offset of a staged tensor's bytes -> (offset, length) of its
    # torch.save record around them (frames.py), its dtype and shape
    records: Dict[int, Tuple[Tuple[int, int], torch.dtype, Tuple[int, ...]]] = field(
        default_factory=dict)
    tensors: int = 0
    bytes: int = 0
    outside: int = 0  # tensors copied outside the region (no room in one extent)

    def locate(self, t: torch.Tensor) -> Optional[Tuple[int, Tuple[int, int]]]:
        """The region offset of ``t``'s bytes and its record, or None when
        ``t`` is not one whole staged tensor."""
        if not t.is_contiguous() or t.device.type != "cpu":
            return None
        offset = self.offsets.get(t.data_ptr())
        if offset is None or self.records[offset][1:] != (t.dtype, tuple(t.shape)):
            return None
        return offset, self.records[offset][0]


def _walk(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``; containers
    rebuilt, other values deep-copied (the staged state must not follow
    later changes of the trainer's objects)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, ...)
        for key, value in obj.items():
            out[key] = _walk(value, fn)
        return out
    if isinstance(obj, list):
        return [_walk(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_walk(v, fn) for v in obj)
    return copy.deepcopy(obj)


def _tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for v in values for t in _tensors(v)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def stage(store: Any, state_dict: Dict[str, Any], rank: int, ttl_seconds: float
          ) -> Tuple[Dict[str, Any], Optional[Staged]]:
    """The staged state dict, and its region (None when it has no tensor
    bytes)."""
    tensors = [_local(t) for t in _tensors(state_dict)]
    sizes = [_nbytes(t) + _frames.FRAME_ROOM for t in tensors if t.device.type != "meta"]
    total = sum((n + ALIGN - 1) // ALIGN * ALIGN for n in sizes if n)
    if total == 0:
        return _walk(state_dict, lambda t: t.detach().clone()), None
    # Room for the tensors, their alignment, and the tail an extent may keep
    # when the next tensor does not fit in it.
    size = total + min(total, max(sizes)) // 4 + (1 << 20)
    name = f"staging/dcp/{uuid.uuid4().hex}/{rank}"
    staged = Staged(store.create(name, size, ttl_seconds), name)
    try:
        # Largest first: the small ones fill the tails the large ones leave.
        order = sorted(range(len(tensors)), key=lambda i: -_nbytes(tensors[i]))
        copies: Dict[int, torch.Tensor] = {}
        for i in order:
            copies[id(tensors[i])] = _place(staged, tensors[i])
        return _walk(state_dict, lambda t: _rewrap(t, copies[id(_local(t))])), staged
    except BaseException:
        staged.writer.abort()
        raise


def _place(staged: Staged, t: torch.Tensor) -> torch.Tensor:
    """A copy of local tensor ``t`` in the staged region (outside it when no
    extent has room), same dtype and shape, contiguous."""
    n = _nbytes(t)
    if t.device.type == "meta" or n == 0:
        return t.detach().clone() if t.device.type != "meta" else t
    from ... import errors

    head, tail = _frames.frames(t.dtype, tuple(t.shape))
    length = len(head) + n + len(tail)
    try:  # the whole torch.save record, the tensor's bytes in it
        offset, raw = staged.writer.place(length, ALIGN)
    except errors.OutOfRange:
        staged.outside += 1
        return t.detach().to("cpu", copy=True).contiguous()
    raw[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    raw[len(head) + n:].copy_(torch.frombuffer(bytearray(tail), dtype=torch.uint8))
    raw = raw[len(head):len(head) + n]
    out = raw.view(t.dtype).view(t.shape)
    out.copy_(t.detach())
    staged.offsets[raw.data_ptr()] = offset + len(head)
    staged.records[offset + len(head)] = ((offset, length), t.dtype, tuple(t.shape))
    staged.tensors += 1
    staged.bytes += n
    return out


def _rewrap(original: torch.Tensor, local_copy: torch.Tensor) -> torch.Tensor:
    if hasattr(original, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local_copy, original.device_mesh, original.placements,
                                  run_check=False, shape=original.shape, stride=original.stride())
    return local_copy


def write(staged: Staged, items: List[Any], planner: Any, final_region: str,
          write_rest: Callable[[str, List[Any]], List[Any]]) -> List[Any]:
    """DCP write results for ``items``: each staged tensor where it already is
    in the staged region, committed as ``final_region``; the rest through
    ``write_rest(region, items)`` into ``final_region``'s ``_1`` sibling."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from .items import _RegionItem

    results: List[Any] = []
    rest: List[Any] = []
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            rest.append(item)
            continue
        t = planner.resolve_data(item).detach()
        found = staged.locate(t)
        if found is None:
            rest.append(item)
            continue
        n = _nbytes(t)
        results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=_RegionItem(
            final_region, found[0], n, t.dtype, tuple(t.shape), found[1])))
    if results:
        staged.writer.commit(rename_to=final_region)
    else:
        staged.writer.abort()
    if rest:
        results.extend(write_rest(final_region[: -len("_0.distcp")] + "_1.distcp", rest))
    return results
