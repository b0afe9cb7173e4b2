"""Hugging Face ``Trainer`` integration: :class:`MemoffloadCallback`.

Its own module, loaded on first use of ``memoffload.torch.MemoffloadCallback``
(or by ``from memoffload.hf import MemoffloadCallback``, which re-exports it),
so that importing :mod:`memoffload.torch` does not import transformers. It
imports the modules of memoffload.torch it uses, never the package's
``__init__`` names, and nothing imports it back.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from torch import nn

from ...errors import InvalidArgument
from ...step_log import LOGGED_KEYS, StepLog
from ..checkpoint.training import Checkpoints
from .handle import OffloadHandle
from .layers import find_layer_stack, offload_layers

try:  # Subclass the real TrainerCallback when transformers is installed.
    from transformers import TrainerCallback as _CallbackBase  # type: ignore
except ImportError:  # transformers is optional: the same method names suffice
    _CallbackBase = object

__all__ = ["MemoffloadCallback", "LOGGED_KEYS"]


def _step(state: Any) -> int:
    """The Trainer's optimizer step (0 without a TrainerState)."""
    return int(getattr(state, "global_step", 0) or 0)


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
    ``memoffload/*`` keys (:data:`memoffload.step_log.LOGGED_KEYS`) to every
    log: what changed since the previous log, so a second Trainer in the same
    process starts from zero. At each epoch end and at train end it logs one
    summary line to the ``memoffload`` logger (INFO); ``totals`` holds the
    last training's sums once it ended.

    ``Trainer(..., callbacks=[MemoffloadCallback()])``. ``layers``: the layers
    to offload (default: the longest ``nn.ModuleList`` of the model);
    ``job_id``: the session's job id (see :func:`memoffload.torch.get_offloader`);
    the other keyword arguments go to :func:`memoffload.torch.offload_layers`.

    ``checkpoints``: keyword arguments of a
    :class:`memoffload.torch.checkpoint.CheckpointManager` (``job_id``,
    ``node_every``, ``durable_every``, ``durable_dir``, ...): the model and
    the optimizer are restored at train begin (unless ``"restore": False``)
    and saved through the manager after each optimizer step when due; its
    figures (``memoffload/ckpt_*``) join every log
    (memoffload.torch.checkpoint.training).

    With Hugging Face activation checkpointing (``gradient_checkpointing=True``)
    it refuses to start: the checkpointed layers would be recomputed in
    backward, and offloading from inside them either switches checkpointing
    off or moves the recomputed activations through the arena.
    """

    def __init__(self, layers: Optional[Sequence[nn.Module]] = None, *,
                 job_id: Optional[str] = None, checkpoints: Optional[Dict[str, Any]] = None,
                 **offload_kwargs: Any):
        self._layers = layers
        self._kwargs = dict(offload_kwargs, job_id=job_id)
        self.checkpoints = Checkpoints(checkpoints) if checkpoints is not None else None
        self.handle: Optional[OffloadHandle] = None
        self.totals: Optional[Dict[str, Any]] = None
        self._log: Optional[StepLog] = None
        self._epochs = 0

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
            self._log = StepLog(self.handle, _step(state))
            self._epochs = 0
            if self.checkpoints is not None:
                self.checkpoints.begin(model, [kw["optimizer"]] if kw.get("optimizer") else [])
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if self.checkpoints is not None:
            self.checkpoints.step(_step(state))
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
        if self._log is None or not isinstance(logs, dict) or LOGGED_KEYS[0] in logs:
            return control  # (the keys are there: this callback is listed twice)
        entry = self._log.take()
        if self.checkpoints is not None:
            entry.update(self.checkpoints.figures())
        logs.update(entry)
        # Trainer.log appends a copy of `logs` to state.log_history before the
        # callbacks run: put the entry into that copy too.
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == getattr(state, "global_step", None):
            history[-1].update(entry)
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if self._log is not None:
            self._epochs += 1
            self._log.summary(f"epoch {self._epochs}", _step(state))
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if self.checkpoints is not None:
            self.checkpoints.end()
        if self._log is not None:
            self._log.summary("training", _step(state), scope="run")
            self.totals = self._log.totals()
            self._log = None
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        return control
