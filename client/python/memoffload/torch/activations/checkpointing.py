"""Activation checkpointing composed with offload.

Both use ``saved_tensors_hooks``, and the innermost hooks win. So:

* ``offload_layers(..., checkpoint=True)`` puts the checkpoint *inside* the
  offloaded group: checkpoint's own hooks handle everything the layer saves
  (it is recomputed in backward, checkpointing stays in force) and the group
  receives exactly what the checkpoint keeps, the layer's inputs. That is the
  torchtune/TRL recipe (checkpoint the layers, offload what the checkpoints
  keep; verl's ``enable_ckpt``).
* A checkpoint the user put *around* an offloaded layer would see its hooks
  replaced by ours inside the layer (non-reentrant: nothing recomputed, the
  checkpoint silently off) or its recomputation sent through the arena
  (reentrant). The wrapped forward therefore steps aside: inside someone
  else's saved-tensor hooks or inside a backward pass (a recomputation) it
  runs the layer as it is and offloads nothing (logged once per handle).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint as _cp

# Set on memoffload's own pack functions, so that a group nested in another
# memoffload group (offload_activations around offload_layers) is no foreign
# hook.
OWN_HOOK_ATTR = "_memoffload_pack"


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a
    checkpoint recomputing its forward, for instance)."""
    return torch._C._current_graph_task_id() != -1


def foreign_hooks_active() -> bool:
    """Whether saved-tensor hooks other than memoffload's are in force (a
    non-reentrant checkpoint, save_on_cpu, another offloader)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and not getattr(top[0], OWN_HOOK_ATTR, False)


def checkpointed(forward: Callable, use_reentrant: bool) -> Callable:
    """``forward`` run under ``torch.utils.checkpoint.checkpoint``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return _cp.checkpoint(forward, *args, use_reentrant=use_reentrant, **kwargs)

    return run
