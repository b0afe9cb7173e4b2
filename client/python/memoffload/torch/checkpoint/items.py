"""The plan and metadata records of :mod:`memoffload.torch.checkpoint` and the
helpers its writer and reader share.

``_RegionItem`` is pickled into every daemon checkpoint's ``.metadata`` under
the name ``memoffload.torch.checkpoint._RegionItem`` (where it was defined
first, and which re-exports it), so checkpoints saved before and after it
moved here read the same."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StoragePrefix

from ... import errors, logs

DAEMON = "daemon"
FILESYSTEM = "filesystem"


@dataclass(frozen=True)
class _RegionItem:
    """Where one item of a daemon checkpoint is (Metadata.storage_data).
    ``dtype`` and ``shape`` describe a tensor item's raw bytes; both are None
    for a BYTE_IO item. ``record``: (offset, length) of the tensor's whole
    ``torch.save`` record around its raw bytes (frames.py), which DCP's
    FileSystemReader reads from the region's file once persisted; None in
    checkpoints saved before records were written (never persisted)."""

    region: str
    offset: int
    length: int
    dtype: Optional[torch.dtype] = None
    shape: Optional[Tuple[int, ...]] = None
    record: Optional[Tuple[int, int]] = None


@dataclass(frozen=True)
class _RankMode:
    """A rank's local SavePlan.storage_data: could it reach the daemon."""

    rank: int
    daemon: bool
    reason: str
    runtime_dir: str
    code: int = 14  # StatusCode.UNAVAILABLE: why not the daemon


@dataclass(frozen=True)
class _RegionPlan:
    """The coordinator's answer when every rank reached the daemon."""

    region: str
    world: int = 1  # ranks in the save: the only rank's shard can still go to files


@dataclass(frozen=True)
class _FallbackPlan:
    """The coordinator's answer when some rank did not: the prefix DCP's
    FileSystemWriter would give this rank, and why."""

    prefix: _StoragePrefix
    runtime_dir: str
    reason: str
    code: int = 14  # StatusCode.UNAVAILABLE


def _rank_of(rank: Optional[int]) -> int:
    if rank is not None:
        return int(rank)
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _warn_fallback(what: str, why: str, path: str, cause: str = "") -> None:
    # The "memoffload" logger (with no handler configured Python's last-resort
    # handler prints WARNING records on stderr): once per cause every few
    # minutes, not at every save of a job that runs without a daemon.
    logs.log_limited(f"checkpoint {what} falls back: {cause or why}", logging.WARNING,
                     f"checkpoint {what} falls back to the filesystem: {why}; using {path}",
                     errors.StatusCode.UNAVAILABLE)


def _unreachable(runtime_dir: str, reason: str) -> str:
    return f"no memoffload daemon reachable at {runtime_dir} ({reason})"


_RegionItem.__module__ = "memoffload.torch.checkpoint"
