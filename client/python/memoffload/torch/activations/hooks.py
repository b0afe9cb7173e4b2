"""The saved-tensor hooks of an offloaded group: the native pack hook
(``_C.PackHook``) with its Python fallback for CUDA tensors, and the unpack
hook (``_C.UnpackHook``) with its CUDA fallback."""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from .counters import _Counters
from .._native import _C
from .param_skip import _ParamSkip

# Group keys, unique in the process (every handle and block draws from it).
_keys = itertools.count(1)


class _Packed:
    """What autograd keeps for an offloaded saved CUDA tensor (CPU tensors get
    a native ``_C.SavedEntry``). When autograd drops it, the entry is dropped;
    the group goes when its last entry does."""

    __slots__ = ("off", "key", "entry", "device", "__weakref__")

    def __init__(self, off: "_C.GroupOffloader", key: int, entry: int, device: torch.device) -> None:
        self.off = off
        self.key = key
        self.entry = entry
        self.device = device  # the device whose stream will use it

    def __del__(self) -> None:
        try:
            self.off.drop_entry(self.key, self.entry)
        except Exception:  # interpreter shutdown, or the group is gone
            pass


def _unpack_cuda(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Packed):
        # The consumer stream waits (on the GPU) for the copy back; the block
        # is not reused before that stream is done with it.
        stream = torch.cuda.current_stream(packed.device)
        t = packed.off.get(packed.key, packed.entry, stream.cuda_stream)
        if t.is_cuda:
            t.record_stream(stream)
        return t
    return packed


def _cuda_pack(off: "_C.GroupOffloader", key: int) -> Callable[[torch.Tensor], Any]:
    def pack(t: torch.Tensor) -> Any:
        stream = torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0
        # -1: the offloader cannot take this tensor; it counted it as skipped.
        entry = off.add(key, t, stream)
        if entry < 0:
            # Never a saved output as-is: see _C.PackHook's KeptInPlace.
            return t if t.is_leaf else t.detach()
        return _Packed(off, key, entry, t.device)

    return pack


# The unpack hook (native): a CPU tensor's entry comes back from the arena
# without a Python frame; CUDA handles go through _unpack_cuda.
_unpack = _C.UnpackHook(_unpack_cuda)


def _make_pack(
    off: "_C.GroupOffloader",
    key: int,
    min_tensor_bytes: int,
    is_param: _ParamSkip,
    counters: _Counters,
) -> Callable[[torch.Tensor], Any]:
    """The pack hook of group ``key`` (native, see client/torch/python_hooks.cc):
    small tensors, parameters, buffers and weight copies (``is_param``'s
    rules) stay in place and are counted in ``counters``; the rest goes into
    the group."""
    return _C.PackHook(
        off,
        key,
        min_tensor_bytes,
        is_param.storage_keys,
        is_param.offload_weights,
        counters.native,
        _cuda_pack(off, key),
    )
