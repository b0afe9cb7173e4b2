"""Which saved tensors stay where they are because they are parameters,
buffers or low-precision copies of them (decided per group, by storage
identity and autograd history; see docs/torch.md, "FSDP2 recipe").

The rules are applied by the native pack hook (``_C.PackHook``,
client/torch/python_hooks.cc); this module gives it the group's modules'
storage identities and whether weight copies are offloaded too."""

from __future__ import annotations

import itertools
from typing import Iterable, Optional, Set

import torch
from torch import nn


def _storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage: the address of its StorageImpl, shared
    by every view of it (never its data pointer, which a transpose shares with
    other storages' tensors over time and which FSDP swaps in place)."""
    if hasattr(t, "untyped_storage"):  # torch >= 2.0
        return t.untyped_storage()._cdata
    return t.storage()._cdata


def _module_storages(modules: Iterable[nn.Module]) -> Set[int]:
    """Storage identities of the modules' parameters and buffers as they are
    now (FSDP swaps a parameter's storage around each forward)."""
    keys: Set[int] = set()
    for m in modules:
        for p in itertools.chain(m.parameters(), m.buffers()):
            keys.add(_storage_key(p))
    return keys


class _ParamSkip:
    """What the native pack hook needs to tell the parameters and buffers of
    ``modules`` (and casts of them: autocast's bf16 weight) from activations.

    The storage set is taken at the group's first pack call, not before the
    forward: FSDP1 gathers a unit's full weights into a fresh storage inside
    its forward (and frees it in place after), FSDP2 in a pre-forward hook;
    either way the parameters' storages are final once the wrapped forward
    runs. The native hook also recognises views of a parameter by their base
    (FSDP1's unsharded weights are views of the FlatParameter, ``weight.t()``
    of a weight), which covers nested units that unshard later in the group.

    A weight copy is found through its autograd history: a cast
    (``ToCopyBackward0``), possibly with views around it, leading to the
    ``AccumulateGrad`` of a parameter. Casts of frozen weights (no grad) have
    no history and are not recognised. ``offload_weights`` offloads them.
    """

    __slots__ = ("_modules", "_keys", "_weights")

    def __init__(self, modules: Iterable[nn.Module], offload_weights: bool = False) -> None:
        self._modules = list(modules)
        self._keys: Optional[Set[int]] = None
        self._weights = offload_weights

    @property
    def offload_weights(self) -> bool:
        return self._weights

    def storage_keys(self) -> Set[int]:
        """The modules' parameter and buffer storage identities (taken at the
        first call, which the native pack hook makes when it needs them)."""
        if self._keys is None:
            self._keys = _module_storages(self._modules)
        return self._keys
