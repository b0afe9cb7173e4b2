"""Activation offload for PyTorch trainers through memoffloadd.

Two entry points:

* :func:`offload_layers` wraps the forward of each chosen layer; every forward
  invocation of a layer is one *group*. Tensors autograd saves inside it move
  into the arena after the layer's forward and come back, one
  ``prefetch_window`` ahead, during backward.
* :func:`offload_activations` offloads everything saved inside a ``with``
  block as one group.

Both use ``torch.autograd.graph.saved_tensors_hooks``. The native part
(:mod:`memoffload._C`) does the bookkeeping: storage-identity dedup, bump
placement in the group's reservation, the worker thread that runs Reserve,
copies, Commit, Prefetch and Release, the version check of saved tensors, and
the fallback that keeps a group in memory when the daemon cannot take it.

A saved tensor's handle releases its part of the group when autograd drops
it (after the node that used it ran, or when the graph dies); the group's
arena space is returned when its last handle is gone. So ``retain_graph=True``
keeps the data in the arena for a second backward, and a graph dropped without
backward releases everything it reserved.

The package by concern, each part with a docstring saying what lives there
and what it may import (scripts/check_layers.py checks the arrows):
``_native`` (loads ``_C``) and ``_settings`` (job id, rank variables), which
every part may use; ``activations/`` (offload_layers, offload_activations,
their handles, hooks and counters; the Hugging Face callback, loaded on first
use); ``state/`` (place_state: FSDP2's offloaded shards and optimizer state in
the arena); ``checkpoint/`` (DCP storage into the daemon, with ``nodes/`` for
jobs on several nodes; imported by its users). None imports another, and
none imports this module.
"""

from __future__ import annotations

from typing import Any

from .. import errors, logs  # noqa: F401 - part of this module's names
from ._native import _C  # noqa: F401 - checks torch and loads the native part first
from .activations.checkpointing import OWN_HOOK_ATTR, checkpointed, foreign_hooks_active, in_backward  # noqa: F401
from .activations.functional import offload_activations
from .activations.counters import GroupStats, HandleStats, OffloadStats, _Counters  # noqa: F401
from .activations.handle import OffloadHandle
from .activations.hooks import _make_pack, _unpack  # noqa: F401 - used by tests and benchmarks
from .activations.layers import DEFAULT_MIN_TENSOR_BYTES, find_layer_stack, offload_layers  # noqa: F401
from .activations.offloaders import DEFAULT_JOB_ID, daemon_status, forget_offloader, get_offloader  # noqa: F401
from .activations.param_skip import _ParamSkip  # noqa: F401
from .activations.selection import LayerSelection  # noqa: F401
from .state.placement import TESTED_TORCH, StatePlacement, place_state  # noqa: F401

__all__ = [
    # MemoffloadCallback is provided lazily (module __getattr__ below) and is
    # not listed, so that `from memoffload.torch import *` does not import
    # transformers either.
    "GroupStats",
    "HandleStats",
    "OffloadHandle",
    "OffloadStats",
    "daemon_status",
    "find_layer_stack",
    "get_offloader",
    "offload_activations",
    "offload_layers",
    "place_state",
    "StatePlacement",
]


def __getattr__(name: str) -> Any:
    # The Hugging Face callback lives in .activations.hf (re-exported by memoffload.hf)
    # and is loaded on first use, so that importing memoffload.torch never
    # imports transformers.
    if name == "MemoffloadCallback":
        from .activations.hf import MemoffloadCallback

        return MemoffloadCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
