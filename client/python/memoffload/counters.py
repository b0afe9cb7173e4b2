"""A handle's own counters and per-step differences of stats dicts."""

from __future__ import annotations

from typing import Any, Dict, Optional

# Per-group counters of the native part, per handle and per process.
_GROUP_COUNTERS = (
    "groups",
    "groups_offloaded",
    "groups_skipped",
    "groups_live",
    "offloaded_bytes",
    "prefetched_bytes",
    "skipped_bytes",
)


class _Counters:
    """A handle's own counts of what its pack hook kept where it was. The byte
    counts live in ``native`` (``_C.PackCounters``), which the native pack
    hooks of the handle's groups update."""

    __slots__ = ("native", "steps", "stepped_aside")

    def __init__(self) -> None:
        from . import _C

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
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value - (0 if before is None else before.get(name, 0))
        else:
            out[name] = value
    return out
