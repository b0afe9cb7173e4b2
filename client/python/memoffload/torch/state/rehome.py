"""Placed state that follows its daemon (issue 42): ``StatePlacement``'s
moves, at the optimizer's step (a safe point: nothing reads or writes the
state between the step's end and the next forward).

- The daemon drains (``memoffloadctl drain``, a SIGTERM) and asks the
  session to leave, or it ended the session (it restarted, crashed or
  stopped): every placed tensor moves, bit for bit, into the arena of a
  daemon that takes a new session now, else into this process's memory
  (pinned where it was), and the old session's blocks go back at once. The
  drain then finishes without waiting out its timeout, and the old arena's
  chunks leave this process's mappings (``/proc/PID/smaps``) with the last
  tensor that used them.
- While the state is in process memory (or there was no daemon at the
  start), a new session is tried at most every ``REATTACH_S`` seconds, and
  the state is placed again as at the start once one is granted.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Optional, Tuple

import torch

from ... import errors, logs
from .fsdp import fsdp_params, set_fsdp_shard

# Seconds between attach attempts while the state is out of the arena.
REATTACH_S = 1.0

# The reason counted (stats()["left_reasons"]) for the tensors moved into
# process memory.
MOVED_OUT = "moved out: no daemon took them"


def _dense_strides(t: torch.Tensor) -> Tuple[int, ...]:
    """``t``'s strides where its layout is dense (channels_last, a transposed
    parameter's state), else contiguous ones (see StatePlacement._arena_copy)."""
    return torch.empty_like(t, device="meta").stride()


def _process_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in torch's own memory, page-locked where ``t`` was."""
    out = torch.empty_strided(t.shape, _dense_strides(t), dtype=t.dtype, device="cpu",
                              pin_memory=t.is_pinned())
    out.copy_(t)
    return out


class Rehoming:
    """Mixed into StatePlacement (placement.py), which provides ``_store``,
    ``_attach``, ``_arena_copy``, ``_set_fsdp_shard``, ``_rewrap``,
    ``_decide``, ``_leave``, ``_left``, the watched model and optimizers
    (``_model``, ``_optimizers``: weak references) and ``_place_again``."""

    _store: Optional[Any]

    def _init_rehoming(self) -> None:
        self._next_attach = 0.0
        self._moves = 0
        self._last_move: Optional[str] = None
        self._placed_again = False  # reported once the step hook placed the optimizer's

    def _follow_daemon(self) -> None:
        """At each step: moves the state out of an arena it must leave, or
        places it again once a daemon takes a new session."""
        if self._store is not None:
            reason = self._store.move_reason()
            if reason:
                self._move_out(reason)
            return
        if time.monotonic() < self._next_attach:
            return
        self._next_attach = time.monotonic() + REATTACH_S
        store = self._attach(quiet=True)
        if store is not None:
            self._store = store
            self._place_again()
            self._placed_again = True

    def _move_out(self, reason: str) -> None:
        old = self._store
        start = time.monotonic()
        new = self._attach(quiet=True)
        self._store = new
        self._next_attach = time.monotonic() + REATTACH_S
        into_arena = into_process = nbytes = 0

        def relocate(local: torch.Tensor) -> Optional[torch.Tensor]:
            nonlocal into_arena, into_process, nbytes
            if local.untyped_storage().nbytes() == 0 or not old.holds(
                    local.untyped_storage().data_ptr()):
                return None
            # A refusal of the new daemon's is counted (and said) by _arena_copy.
            copy = self._arena_copy(local) if new is not None else None
            if copy is None:
                copy = _process_copy(local)
                if new is None:
                    self._leave(MOVED_OUT, local.numel() * local.element_size())
                into_process += 1
            else:
                into_arena += 1
            nbytes += local.numel() * local.element_size()
            return copy

        self._relocate_all(relocate)
        self._moves += 1
        self._last_move = reason
        ms = (time.monotonic() - start) * 1e3
        where = (f"session {new.stats()['session_id']} of the daemon now serving"
                 if new is not None else "this process's memory")
        message = (f"place_state: {reason}: moved {into_arena + into_process} tensors "
                   f"({nbytes / 2**20:.1f} MiB) into {where} in {ms:.0f} ms")
        if into_process:
            logs.log(logging.WARNING,
                     message + (f" ({into_process} into this process's memory); placed again "
                                f"when a daemon takes a session (tried every {REATTACH_S:g} s)"),
                     errors.StatusCode.UNAVAILABLE)
        else:
            logs.log(logging.INFO, message)
        left = old.stats()
        if left["tensors"]:
            # Only references the placement does not know of (a tensor the
            # trainer kept aside) hold them now.
            logs.log(logging.WARNING,
                     f"place_state: {left['tensors']} placed tensors "
                     f"({left['bytes'] / 2**20:.1f} MiB) are still referenced outside the model "
                     f"and optimizer: session {left['session_id']} and its arena mapping stay "
                     f"until they are freed", errors.StatusCode.FAILED_PRECONDITION)

    def _relocate_all(self, relocate: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> None:
        """Replaces every placed tensor the placement watches (FSDP2 shards,
        optimizer state, kept gradients) for which ``relocate(local)`` gives
        a copy."""
        model = self._model() if self._model is not None else None
        if model is not None:
            for fp in fsdp_params(model):
                data = getattr(fp, "_sharded_param_data", None)
                if isinstance(data, torch.Tensor):
                    new = relocate(data)
                    if new is not None:
                        set_fsdp_shard(fp, new)
                        self._decide(new)
        for optimizer in self._live_optimizers():
            for state in optimizer.state.values():
                for key, value in list(state.items()):
                    if isinstance(value, torch.Tensor):
                        new = self._relocated(value, relocate)
                        if new is not None:
                            state[key] = new
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        new = self._relocated(p.grad, relocate)
                        if new is not None:
                            p.grad = new

    def _relocated(self, value: torch.Tensor,
                   relocate: Callable[[torch.Tensor], Optional[torch.Tensor]]
                   ) -> Optional[torch.Tensor]:
        local = getattr(value, "_local_tensor", value)
        new_local = relocate(local)
        if new_local is None:
            return None
        new = self._rewrap(value, new_local)
        self._decide(new)
        return new

    def _live_optimizers(self) -> List[torch.optim.Optimizer]:
        return [o for o in (ref() for ref in self._optimizers) if o is not None]
