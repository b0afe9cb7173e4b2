"""Which saved tensors stay where they are because they are parameters,
buffers or low-precision copies of them (decided per group, by storage
identity and autograd history; see docs/torch.md, "FSDP2 recipe")."""

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


# Autograd nodes between a parameter and a low-precision copy of it that
# autocast (or ``weight.to(bf16)``) saves: the cast and views of either side.
_CAST_NODE = "ToCopyBackward0"
_VIEW_NODES = frozenset(
    (
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "AsStridedBackward0",
        "ExpandBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
    )
)
_MAX_WEIGHT_HOPS = 6

NOT_PARAM, PARAM, WEIGHT_COPY = 0, 1, 2


class _ParamSkip:
    """Decides which saved tensors are parameters or buffers of ``modules``
    (``PARAM``) or casts of them (``WEIGHT_COPY``: autocast's bf16 weight).

    The storage set is taken at the group's first pack call, not before the
    forward: FSDP1 gathers a unit's full weights into a fresh storage inside
    its forward (and frees it in place after), FSDP2 in a pre-forward hook;
    either way the parameters' storages are final once the wrapped forward
    runs. Views of a parameter (FSDP1's unsharded weights are views of the
    FlatParameter, ``weight.t()`` of a weight) are recognised by their base
    too, which also covers nested units that unshard later in the group.

    A weight copy is found through its autograd history: a cast
    (``ToCopyBackward0``), possibly with views around it, leading to the
    ``AccumulateGrad`` of a parameter. Casts of frozen weights (no grad) have
    no history and are not recognised.
    """

    __slots__ = ("_modules", "_keys", "_weights")

    def __init__(self, modules: Iterable[nn.Module], offload_weights: bool = False) -> None:
        self._modules = list(modules)
        self._keys: Optional[Set[int]] = None
        self._weights = offload_weights

    def _storages(self) -> Set[int]:
        if self._keys is None:
            self._keys = _module_storages(self._modules)
        return self._keys

    @property
    def offload_weights(self) -> bool:
        return self._weights

    def storage_keys(self) -> Set[int]:
        """The modules' parameter and buffer storage identities (taken at the
        first call). The native pack hook asks for them, then applies the same
        rules as ``__call__``."""
        return self._storages()

    def _is_param(self, t: torch.Tensor) -> bool:
        return isinstance(t, nn.Parameter) or _storage_key(t) in self._storages()

    def _weight_copy(self, t: torch.Tensor) -> bool:
        node = t.grad_fn
        cast = False
        for _ in range(_MAX_WEIGHT_HOPS):
            if node is None:
                return False
            name = type(node).__name__
            if name == "AccumulateGrad":
                return cast and self._is_param(node.variable)
            if name == _CAST_NODE:
                cast = True
            elif name not in _VIEW_NODES:
                return False
            node = next((fn for fn, _ in node.next_functions if fn is not None), None)
        return False

    def __call__(self, t: torch.Tensor) -> int:
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return PARAM
        base = t._base
        if base is not None and (
            isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)
        ):
            return PARAM
        keys = self._storages()
        if keys and _storage_key(t) in keys:
            return PARAM
        if not self._weights and t.grad_fn is not None and self._weight_copy(t):
            return WEIGHT_COPY
        return NOT_PARAM
