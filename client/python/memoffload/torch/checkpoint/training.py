"""What the Hugging Face and Lightning callbacks do with a
:class:`CheckpointManager`: the model and its optimizers as one DCP
Stateful, the manager's figures as log keys, and the step numbering across
a restore.

``MemoffloadCallback(checkpoints={...})`` (either framework) takes the
manager's keyword arguments (``job_id``, ``node_every``, ``durable_every``,
``durable_dir``, ...). At train start it restores the newest checkpoint
into the model and the optimizers (``restore=False`` in the dict skips
that) and numbers the saves from the restored step on, so a resumed run
never reuses a checkpoint id; after each optimizer step it calls
``manager.step``; at train end it closes the manager. With ``"restore":
False`` the saves are numbered on past the job's newest checkpoint. The data
position, the LR scheduler and the framework's own step counters stay the
framework's (docs/torch_frameworks.md)."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ... import errors, logs
from .manager import CheckpointManager

# The keys the callbacks log (absent until the first save / persist).
FIGURE_KEYS = ("memoffload/ckpt_node_step", "memoffload/ckpt_node_blocked_s",
               "memoffload/ckpt_node_s", "memoffload/ckpt_persisted_step",
               "memoffload/ckpt_persisted_bytes", "memoffload/ckpt_persist_s")


class TrainState:
    """A module and its optimizers as one DCP Stateful (through
    ``get_state_dict``, so the optimizers' state exists before their first
    step and loads)."""

    def __init__(self, model: Any, optimizers: List[Any]) -> None:
        self.model = model
        self.optimizers = list(optimizers)

    def state_dict(self) -> Dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizers, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def figures(manager: CheckpointManager) -> Dict[str, float]:
    """The manager's last node save and last persist, as FIGURE_KEYS."""
    out: Dict[str, float] = {}
    node, durable = manager.last_node_save, manager.last_persisted
    if node:
        out.update({FIGURE_KEYS[0]: node["step"], FIGURE_KEYS[1]: node["blocked_s"],
                    FIGURE_KEYS[2]: node["seconds"]})
    if durable:
        out.update({FIGURE_KEYS[3]: durable["step"], FIGURE_KEYS[4]: durable.get("bytes", 0),
                    FIGURE_KEYS[5]: durable.get("seconds", 0.0)})
    return out


class Checkpoints:
    """One training's manager, for a callback."""

    def __init__(self, options: Dict[str, Any]) -> None:
        self.options = dict(options)
        self.restore = bool(self.options.pop("restore", True))
        self.manager: Optional[CheckpointManager] = None
        self.offset = 0  # the restored step: saves are numbered from it
        self.restored: Optional[int] = None
        self.final: Dict[str, float] = {}

    def begin(self, model: Any, optimizers: List[Any]) -> Optional[int]:
        """Makes the manager (on every rank) and restores; returns the
        restored step, or None."""
        self.manager = CheckpointManager({"train": TrainState(model, optimizers)}, **self.options)
        if self.restore:
            self.restored = self.manager.restore()
            self.offset = self.restored or 0
        else:  # numbered on past the job's newest checkpoint: never an id that exists
            self.offset = self.manager.newest_step() or 0
        return self.restored

    def step(self, step: int) -> None:
        if self.manager is not None:
            self.manager.step(self.offset + step)

    def figures(self) -> Dict[str, float]:
        return figures(self.manager) if self.manager is not None else dict(self.final)

    def end(self, failed: bool = False) -> None:
        """Closes the manager (the save and the persist in flight finish);
        ``final`` keeps its last figures. ``failed``: training raised: the
        save in flight finishes, the persist goes on in its thread, and what
        fails here is logged, not raised over the training's own error."""
        manager, self.manager = self.manager, None
        if manager is None:
            return
        if not failed:
            manager.close()
        else:
            try:
                manager.close(wait_persist=False)
            except Exception as exc:  # noqa: BLE001 - the training's error is the one raised
                logs.log(logging.WARNING, f"closing the checkpoint manager after training failed: "
                         f"{exc}", errors.StatusCode.INTERNAL)
        self.final = figures(manager)
