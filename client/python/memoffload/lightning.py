"""Lightning integration: :class:`MemoffloadCallback` for ``lightning.pytorch``.

``from memoffload.lightning import MemoffloadCallback``; importing
:mod:`memoffload` or :mod:`memoffload.torch` never imports lightning.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from torch import nn

try:
    from lightning.pytorch import Callback
except ImportError as exc:  # pragma: no cover - lightning is pinned in the test environment
    raise ImportError(
        f"memoffload.lightning needs the lightning package (pip install lightning): {exc}"
    ) from exc

from .step_log import LOGGED_KEYS, StepLog
from .torch import OffloadHandle, find_layer_stack, offload_layers
from .torch.checkpoint.training import Checkpoints

__all__ = ["MemoffloadCallback", "LOGGED_KEYS"]


class MemoffloadCallback(Callback):
    """Offloads the module's layer stack while it trains and logs
    ``memoffload/*`` (:data:`memoffload.step_log.LOGGED_KEYS`) to the
    Trainer's loggers: what changed since the previous log, at the Trainer's
    own cadence (``log_every_n_steps``, the step Lightning logs its metrics
    at), and the rest since the last of those at train end, so the logged
    differences sum to the whole training's. One summary line goes to the
    ``memoffload`` logger (INFO) at each epoch end and at train end;
    ``totals`` holds the last training's sums once it ended.

    ``L.Trainer(..., callbacks=[MemoffloadCallback()])``. ``layers``: the
    layers to offload (default: the longest ``nn.ModuleList`` of the
    LightningModule); ``job_id``: the session's job id (see
    :func:`memoffload.torch.get_offloader`); the other keyword arguments go to
    :func:`memoffload.torch.offload_layers`. The layers are wrapped at
    ``on_train_start`` (after the strategy set the model up) and restored at
    train end or when training raises.

    ``checkpoints``: keyword arguments of a
    :class:`memoffload.torch.checkpoint.CheckpointManager`: the module and
    its optimizers are restored at train start (unless ``"restore": False``)
    and saved through the manager after each optimizer step when due; its
    figures (``memoffload/ckpt_*``) join the logged metrics
    (memoffload.torch.checkpoint.training).

    The numbers are this process's (its rank's); loggers that write on rank
    0 only (all of Lightning's) show rank 0's.
    """

    def __init__(self, layers: Optional[Sequence[nn.Module]] = None, *,
                 job_id: Optional[str] = None, checkpoints: Optional[Dict[str, Any]] = None,
                 **offload_kwargs: Any) -> None:
        self._layers = layers
        self._kwargs = dict(offload_kwargs, job_id=job_id)
        self.checkpoints = Checkpoints(checkpoints) if checkpoints is not None else None
        self._saved_step = -1
        self.handle: Optional[OffloadHandle] = None
        self.totals: Optional[Dict[str, Any]] = None
        self._log: Optional[StepLog] = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.handle is not None:
            return
        layers = list(self._layers) if self._layers is not None else find_layer_stack(pl_module)
        self.handle = offload_layers(layers, **self._kwargs)
        self._log = StepLog(self.handle, trainer.global_step)
        if self.checkpoints is not None:
            self.checkpoints.begin(pl_module, list(trainer.optimizers))

    def _write(self, trainer: Any) -> None:
        assert self._log is not None
        entry = self._log.take()
        if self.checkpoints is not None:
            entry.update(self.checkpoints.figures())
        # As Lightning's LearningRateMonitor does: straight to the loggers, at
        # the step Lightning logs this batch's metrics at. (LightningModule.log
        # would turn the byte counts into float32 tensors.)
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            logger.log_metrics(entry, step=step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # After each optimizer step (not each batch of an accumulation).
        if self.checkpoints is not None and trainer.global_step != self._saved_step:
            self._saved_step = trainer.global_step
            self.checkpoints.step(trainer.global_step)
        if self._log is not None and trainer._logger_connector.should_update_logs:
            self._write(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._log is not None:
            self._log.summary(f"epoch {trainer.current_epoch}", trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.checkpoints is not None:
            self.checkpoints.end()
        if self._log is not None:
            if self._log.pending():
                self._write(trainer)
            self._log.summary("training", trainer.global_step, scope="run")
            self.totals = self._log.totals()
        self._remove()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.checkpoints is not None:
            self.checkpoints.end(failed=True)  # the save in flight finishes; nothing raised here
        self._remove()

    def _remove(self) -> None:
        self._log = None
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
