"""Hugging Face ``Trainer`` integration: :class:`MemoffloadCallback`.

Its own module, loaded on first use of ``memoffload.torch.MemoffloadCallback``
(or ``from memoffload.hf import MemoffloadCallback``), so that importing
:mod:`memoffload.torch` does not import transformers.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from .errors import InvalidArgument
from .torch import OffloadHandle, find_layer_stack, offload_layers

try:  # Subclass the real TrainerCallback when transformers is installed.
    from transformers import TrainerCallback as _CallbackBase  # type: ignore
except ImportError:  # transformers is optional: the same method names suffice
    _CallbackBase = object

__all__ = ["MemoffloadCallback", "LOGGED_COUNTERS"]

# The stats() counters added to the Trainer's logs as "memoffload/<name>".
LOGGED_COUNTERS = ("offloaded_bytes", "prefetched_bytes", "skipped_bytes", "blocking_rpcs")


def _checkpointing_layers(args: Any, model: Optional[nn.Module], layers: Sequence[nn.Module]) -> bool:
    """True when Hugging Face activation (gradient) checkpointing is on for
    the model: by the TrainingArguments or by the modules' own flag, which
    ``activation_checkpointing_enable`` sets on the layers or their parent."""
    for flag in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(args, flag, False) is True:
            return True
    modules = list(model.modules()) if model is not None else []
    for layer in layers:
        modules.extend(layer.modules())
    return any(getattr(m, "gradient_checkpointing", False) is True for m in modules)


class MemoffloadCallback(_CallbackBase):  # type: ignore[misc, valid-type]
    """Offloads the model's layer stack for the whole training and adds
    ``memoffload/*`` counters to the logs.

    ``Trainer(..., callbacks=[MemoffloadCallback()])``. ``layers``: the layers
    to offload (default: the longest ``nn.ModuleList`` of the model); the
    other keyword arguments go to :func:`memoffload.torch.offload_layers`.

    With Hugging Face activation checkpointing (``gradient_checkpointing=True``)
    it refuses to start: the checkpointed layers would be recomputed in
    backward, and offloading from inside them either switches checkpointing
    off or moves the recomputed activations through the arena.
    """

    def __init__(self, layers: Optional[Sequence[nn.Module]] = None, **offload_kwargs: Any):
        self._layers = layers
        self._kwargs = offload_kwargs
        self.handle: Optional[OffloadHandle] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        if self.handle is None:
            layers = list(self._layers) if self._layers is not None else find_layer_stack(model)
            if _checkpointing_layers(args, model, layers):
                raise InvalidArgument(
                    "MemoffloadCallback does not combine with Hugging Face activation checkpointing "
                    "(gradient_checkpointing=True / activation_checkpointing=True): Trainer's "
                    "checkpoint sits outside memoffload's hooks, so nothing would be offloaded. "
                    "For checkpointing plus offload of what the checkpoints keep, set "
                    "gradient_checkpointing=False and pass MemoffloadCallback(checkpoint=True); "
                    "to offload every activation instead of recomputing, just set "
                    "gradient_checkpointing=False."
                )
            self.handle = offload_layers(layers, **self._kwargs)
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
        if self.handle is None or not isinstance(logs, dict):
            return control
        s = self.handle.stats()
        counters = {f"memoffload/{name}": s[name] for name in LOGGED_COUNTERS}
        logs.update(counters)
        # Trainer.log appends a copy of `logs` to state.log_history before the
        # callbacks run: put the counters into that entry too.
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == getattr(state, "global_step", None):
            history[-1].update(counters)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        return control
