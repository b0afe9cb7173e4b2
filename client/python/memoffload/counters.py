"""A handle's own counters and per-step differences of stats dicts."""

from __future__ import annotations

from typing import Any, Dict, Optional

# Per-group counters of the native part, per handle and per process.
_GROUP_COUNTERS = (
    "groups",
    "groups_offloaded",
    "groups_skipped",
    "offloaded_bytes",
    "prefetched_bytes",
    "skipped_bytes",
)


class _Counters:
    """A handle's own counts of what its pack hook kept where it was."""

    __slots__ = ("small_bytes", "param_bytes", "weight_copy_bytes", "steps", "stepped_aside")

    def __init__(self) -> None:
        self.small_bytes = 0
        self.param_bytes = 0  # parameters and buffers, weight copies included
        self.weight_copy_bytes = 0  # of which low-precision copies of weights
        self.steps = 0  # forward passes through the first layer
        self.stepped_aside = 0  # layer calls under foreign hooks or in backward

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
