"""FSDP2's internals that place_state reads and patches: the FSDPParams of
a model, and a shard re-viewed onto a copy of it (as FSDP2's own
``reset_sharded_param`` does). placement.py checks the torch version
(``TESTED_TORCH``) before it patches anything."""

from __future__ import annotations

import ctypes
from typing import Any, Iterator

import torch


def give_back_freed_memory() -> None:
    """Returns what glibc's allocator keeps of freed memory to the system:
    the torch copies of the tensors just moved would otherwise stay in the
    rank's RSS (bench/state_bench.py measured 3.9 GB of RssAnon kept for
    2.4 GB moved). A no-op without glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def fsdp_params(model: torch.nn.Module) -> Iterator[Any]:
    """Every FSDPParam under ``model`` (none without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch 2.11: at most one group
            group = state._fsdp_param_group
            groups = [group] if group is not None else []
        for group in groups:
            yield from group.fsdp_params


FSDP_PARAM_FIELDS = ("offload_to_cpu", "_sharded_param_data", "sharded_param",
                     "padded_sharded_param_size", "fsdp_placement")


def set_fsdp_shard(fp: Any, new: torch.Tensor) -> None:
    """Makes ``new`` (a copy of its padded shard) FSDPParam ``fp``'s shard,
    its parameter's local tensor re-viewed onto it, as FSDP2's own
    ``reset_sharded_param`` does."""
    local = fp.sharded_param._local_tensor
    dim = fp.fsdp_placement.dim
    length = local.size(dim) if local.numel() > 0 else 0
    fp._sharded_param_data = new
    fp.sharded_param._local_tensor = new.view(fp.padded_sharded_param_size).narrow(
        dim, 0, length)

