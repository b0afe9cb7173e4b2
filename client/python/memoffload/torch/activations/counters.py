"""The shapes of ``stats()`` (typed), a handle's own counters and per-step
differences of stats dicts."""

from __future__ import annotations

import enum
import typing
from typing import Any, Dict, Optional, TypedDict

from ...errors import StatusCode
from .._native import _C


class GroupStats(TypedDict):
    """``OffloadHandle.stats()["handle"]``: the handle's own groups.

    Counters (cumulative; differences in ``step_stats()``) except
    ``groups_live``, a gauge: groups begun and not yet released."""

    groups: int
    groups_offloaded: int
    groups_skipped: int
    groups_live: int
    offloaded_bytes: int
    prefetched_bytes: int
    skipped_bytes: int
    kept_small_bytes: int
    kept_param_bytes: int
    kept_weight_copy_bytes: int
    steps: int
    stepped_aside: int


class OffloadStats(TypedDict):
    """``offload_activations.stats()``, and the top level of
    ``OffloadHandle.stats()``: the process's session on that runtime dir and
    job id (shared by every handle there), plus the caller's own ``kept_*``,
    ``steps`` and ``stepped_aside``. Counters are cumulative;
    ``groups_live`` and ``arena_held_bytes`` are gauges; ``connected``,
    ``engine`` and ``last_skip_*`` are states. All zero (``connected``
    false) when disabled."""

    offloaded_bytes: int
    prefetched_bytes: int
    skipped_bytes: int
    groups: int
    groups_offloaded: int
    groups_skipped: int
    groups_live: int
    arena_held_bytes: int
    tensors: int
    deduplicated: int
    caller_copies: int
    blocking_rpcs: int
    prefetch_waits: int
    prefetch_wait_seconds: float
    rereads: int
    capture_skipped: int
    unpinned_bytes: int
    reconnects: int
    rpc_errors: int
    internal_errors: int
    connected: bool
    engine: str
    last_skip_reason: str
    last_skip_code: StatusCode
    kept_small_bytes: int
    kept_param_bytes: int
    kept_weight_copy_bytes: int
    steps: int
    stepped_aside: int


class HandleStats(OffloadStats):
    """``OffloadHandle.stats()`` and ``step_stats()`` (there every number is
    a difference since the previous call)."""

    enabled: bool
    handle: GroupStats


_ZERO = {int: 0, float: 0.0, bool: False, str: "", StatusCode: StatusCode.OK}


def _zero_stats(shape: Any) -> Dict[str, Any]:
    """A dict of ``shape`` (a TypedDict above) with every value zero, empty,
    false or ``OK``: what a disabled handle or block reports."""
    return {name: _ZERO[kind] for name, kind in typing.get_type_hints(shape).items()
            if kind in _ZERO}


class _Counters:
    """A handle's own counts of what its pack hook kept where it was. The byte
    counts live in ``native`` (``_C.PackCounters``), which the native pack
    hooks of the handle's groups update."""

    __slots__ = ("native", "steps", "stepped_aside")

    def __init__(self) -> None:
        self.native = _C.PackCounters()
        self.steps = 0  # forward passes through the first layer
        self.stepped_aside = 0  # layer calls under foreign hooks or in backward

    @property
    def small_bytes(self) -> int:
        return self.native.small_bytes

    @property
    def param_bytes(self) -> int:  # parameters and buffers, weight copies included
        return self.native.param_bytes

    @property
    def weight_copy_bytes(self) -> int:  # of which low-precision copies of weights
        return self.native.weight_copy_bytes

    def as_dict(self) -> Dict[str, int]:
        return {
            "kept_small_bytes": self.small_bytes,
            "kept_param_bytes": self.param_bytes,
            "kept_weight_copy_bytes": self.weight_copy_bytes,
            "steps": self.steps,
            "stepped_aside": self.stepped_aside,
        }


def _delta(now: Dict[str, Any], before: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, value in now.items():
        if isinstance(value, dict):
            out[name] = _delta(value, None if before is None else before.get(name))
        elif isinstance(value, (int, float)) and not isinstance(value, (bool, enum.Enum)):
            # (a StatusCode is an int, but a state: never a difference)
            out[name] = value - (0 if before is None else before.get(name, 0))
        else:
            out[name] = value
    return out
