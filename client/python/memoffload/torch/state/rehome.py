"""Placed state that follows its daemon (issue 42): ``StatePlacement``'s
moves, at the optimizer's step (a safe point: nothing reads or writes the
state between the step's end and the next forward).

- The daemon drains (``memoffloadctl drain``, a SIGTERM) and asks the
  session to leave: every placed tensor moves, bit for bit, into this
  process's memory (page-locked only for FSDP2 shards that want it) and the
  session ends at once, so the drain finishes without waiting out its
  timeout, and the old arena's chunks leave this process's mappings
  (``/proc/self/smaps``) with the last tensor that used them.
- The daemon ended the session (it restarted or crashed): a new session is
  asked for, waited for at most ``ATTACH_WAIT_S``; the state moves into its
  arena, else into process memory.
- While the state is in process memory (or there was no daemon at the
  start), a new session is asked for on a thread of its own (an attach
  waits for a starting daemon to build its arena), at most every
  ``REATTACH_S`` seconds; once one is granted the next step places the
  state again as at the start.

A move never raises into the step: what the new daemon refuses stays in
process memory, counted and said once, ``strict`` or not.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import torch

from ... import errors, logs
from .fsdp import fsdp_params, set_fsdp_shard

# Seconds between attach attempts while the state is out of the arena.
REATTACH_S = 1.0
# How long a step waits for a new session after the daemon ended the old
# one (a daemon already up answers in milliseconds; one still building its
# arena is waited for on the attach thread, not in the step).
ATTACH_WAIT_S = 0.2

# The reason counted (stats()["left_reasons"]) for the tensors moved into
# process memory.
MOVED_OUT = "moved out: no daemon took them"


def _dense_strides(t: torch.Tensor) -> Tuple[int, ...]:
    """``t``'s strides where its layout is dense (channels_last, a transposed
    parameter's state), else contiguous ones (see StatePlacement._arena_copy)."""
    return torch.empty_like(t, device="meta").stride()


def _process_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy of ``t`` in torch's own memory, page-locked when ``pin`` (an
    FSDP2 shard that asked for pinned memory; never optimizer state, which
    torch keeps pageable: its pinned allocator rounds to powers of two)."""
    out = torch.empty_strided(t.shape, _dense_strides(t), dtype=t.dtype, device="cpu",
                              pin_memory=pin and torch.cuda.is_available())
    out.copy_(t)
    return out


class _Attacher:
    """Asks for a new session on a thread of its own: an attach waits for a
    daemon that is still building its arena, which a step must not."""

    def __init__(self, attach: Callable[[], Optional[Any]]) -> None:
        self._attach = attach
        self._thread: Optional[threading.Thread] = None
        self._store: Optional[Any] = None
        self._error: Optional[BaseException] = None

    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memoffload-state-attach",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._store = self._attach()
        except BaseException as e:  # a bug: raised from take(), in the step
            self._error = e

    def take(self, timeout: float = 0.0) -> Optional[Any]:
        """The new store once the attach is done (None: refused, or still
        running after ``timeout``)."""
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        self._thread = None
        store, self._store = self._store, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return store


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
        self._attacher = _Attacher(lambda: self._attach(quiet=True))

    def _follow_daemon(self) -> None:
        """At each step: moves the state out of an arena it must leave, or
        places it again once a daemon took a new session."""
        if self._store is not None:
            reason = self._store.move_reason()
            if reason:
                self._move_out(reason, self._store.session_lost())
            return
        store = self._attacher.take()
        if store is not None:
            self._store = store
            self._place_again()
            self._placed_again = True
        elif not self._attacher.running() and time.monotonic() >= self._next_attach:
            self._next_attach = time.monotonic() + REATTACH_S
            self._attacher.start()

    def _move_out(self, reason: str, lost: bool) -> None:
        """Moves every placed tensor out of the old store's arena: into a new
        session's when the daemon ended the old one and a new one is granted
        within ATTACH_WAIT_S, else (and always when asked to leave: that
        daemon drains) into process memory."""
        old = self._store
        start = time.monotonic()
        # From here on refusals are counted and said, never raised into a
        # step (strict governs the placement the trainer asked for at start).
        self._strict = False
        new = None
        if lost:
            self._attacher.start()
            new = self._attacher.take(ATTACH_WAIT_S)
        self._store = new
        self._next_attach = time.monotonic() + REATTACH_S
        into_arena = into_process = nbytes = 0

        def relocate(local: torch.Tensor, pin: bool) -> Optional[torch.Tensor]:
            nonlocal into_arena, into_process, nbytes
            if local.untyped_storage().nbytes() == 0 or not old.holds(
                    local.untyped_storage().data_ptr()):
                return None
            # A refusal of the new daemon's is counted (and said) by _arena_copy.
            copy = self._arena_copy(local, strict=False) if new is not None else None
            if copy is not None and pin and not copy.is_pinned():
                # FSDP2 would re-pin a copy of its own (see _place_fsdp).
                self._leave("not page-locked", local.numel() * local.element_size())
                copy = None
            if copy is None:
                copy = _process_copy(local, pin)
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
                                f"when a daemon takes a session (asked every {REATTACH_S:g} s)"),
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

    def _relocate_all(self, relocate: Callable[[torch.Tensor, bool], Optional[torch.Tensor]]
                      ) -> None:
        """Replaces every placed tensor the placement watches (FSDP2 shards,
        optimizer state, kept gradients) for which ``relocate(local)`` gives
        a copy."""
        model = self._model() if self._model is not None else None
        if model is not None:
            for fp in fsdp_params(model):
                data = getattr(fp, "_sharded_param_data", None)
                if isinstance(data, torch.Tensor):
                    new = relocate(data, bool(getattr(fp, "pin_memory", False)))
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
                   relocate: Callable[[torch.Tensor, bool], Optional[torch.Tensor]]
                   ) -> Optional[torch.Tensor]:
        local = getattr(value, "_local_tensor", value)
        new_local = relocate(local, False)
        if new_local is None:
            return None
        new = self._rewrap(value, new_local)
        self._decide(new)
        return new

    def _live_optimizers(self) -> List[torch.optim.Optimizer]:
        return [o for o in (ref() for ref in self._optimizers) if o is not None]
