"""offload_layers, the entry point for a model's layer stack, and
find_layer_stack, which finds that stack."""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from .handle import OffloadHandle
from .offloaders import _job_id_of, get_offloader
from .selection import LayerSelection, _selected

# Saved tensors below this size stay in place: each cost ~20 us of fixed
# bookkeeping before the native hooks, more than its copy below ~16 KiB; the
# threshold was not re-derived since (docs/torch_measured.md).
DEFAULT_MIN_TENSOR_BYTES = 16 << 10


def offload_layers(
    layers: Sequence[nn.Module],
    num_layers: Optional[int] = None,
    prefetch_window: int = 1,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    runtime_dir: Optional[str] = None,
    *,
    select: Optional[LayerSelection] = None,
    enabled: bool = True,
    offload_weights: bool = False,
    strict: bool = False,
    checkpoint: bool = False,
    use_reentrant: bool = False,
    job_id: Optional[str] = None,
) -> OffloadHandle:
    """Offloads the activations of ``layers`` (run in this order each step).

    ``num_layers``: offload the first N layers; ``None`` offloads all but the
    last, whose activations backward needs first. ``select`` instead: a
    predicate ``(index, layer) -> bool`` or the indices / layer modules to
    offload. ``prefetch_window``: groups brought back ahead of the one
    backward is in. ``min_tensor_bytes``: smaller saved tensors stay where
    they are. Parameters and buffers (by storage) are never moved; nor are
    low-precision copies of them (autocast's bf16 weights) unless
    ``offload_weights``.

    ``enabled=False``: no offload and no daemon contact (a switch for A/B
    runs); ``checkpoint`` still applies. ``strict=True``: raise
    :class:`memoffload.Unavailable` (here and at the start of an offloaded
    layer) when memoffloadd is not reachable, instead of training on with the
    activations in memory. ``checkpoint=True``: each layer runs under
    ``torch.utils.checkpoint`` (``use_reentrant`` as there) inside its group,
    so the group holds what the checkpoint keeps (the layer's inputs) and the
    layer is recomputed in backward. A layer already wrapped by another
    handle is refused (:class:`memoffload.FailedPrecondition`). ``job_id``:
    the session's job (:func:`get_offloader`; default ``$MEMOFFLOAD_JOB_ID``
    or ``"torch"``).
    """
    layers = list(layers)
    offloaded = _selected(layers, num_layers, select)
    job = _job_id_of(job_id)  # checked also when disabled
    off = get_offloader(runtime_dir, job) if enabled else None
    return OffloadHandle(
        layers,
        offloaded,
        prefetch_window,
        min_tensor_bytes,
        off,
        offload_weights=offload_weights,
        strict=strict,
        checkpoint=checkpoint,
        use_reentrant=use_reentrant,
    )


def find_layer_stack(model: nn.Module) -> nn.ModuleList:
    """The longest ``nn.ModuleList`` in ``model`` (a transformer's layers)."""
    best: Optional[nn.ModuleList] = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best)):
            best = module
    if best is None or len(best) == 0:
        raise ValueError("no nn.ModuleList of layers found; pass the layers explicitly")
    return best
