"""One save at a time per process: a second save waits for the one in flight.

Two saves whose collectives run at once on one process group interleave and
hang for good (a second ``dcp.async_save`` before the first finished does
that, with torch's own writers too). Every :class:`MemoffloadWriter` of the
process registers its save here before DCP's first collective: at
``stage()`` (``dcp.async_save``, the training thread), at ``reset()`` and at
``set_up_storage_writer()`` (the thread that runs the save). A save is in
flight while the thread that runs it is inside DCP's ``_save_state_dict``
(read from that thread's stack: DCP tells a writer of no end of a save on
ranks other than the coordinator; from DCP's ``save``, which calls
``reset()`` before ``_save_state_dict``), or, for a staged save whose thread has
not started yet, until it starts (``_CLAIM_GRACE_S`` at most).
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from torch.distributed.checkpoint import state_dict_saver as _saver

from ... import errors, logs

# A save is in flight from DCP's ``save`` on: it calls the writer's
# ``reset()`` (where the saving thread claims its registration) before
# ``_save_state_dict``, and a stack read between the two must not see a save
# over (CI once let a second save's stage() through there).
_SAVE_CODES = frozenset(inspect.unwrap(f).__code__ for f in (
    _saver.save, _saver.save_state_dict, _saver._save_state_dict))
# A staged save's thread starts as async_save returns; past this a staged
# registration nobody claimed is a stage() without a save.
_CLAIM_GRACE_S = 30.0
_POLL_S = 0.005


@dataclass
class _Save:
    checkpoint_id: str
    owner: int  # id() of the writer that registered it
    started: float
    thread: Optional[threading.Thread]  # None: staged, its save not started yet


_lock = threading.Lock()
_current: Optional[_Save] = None


def _in_dcp_save(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None
    while frame is not None:
        if frame.f_code in _SAVE_CODES:
            return True
        frame = frame.f_back
    return False


def _busy(save: _Save, owner: int, staged: bool) -> bool:
    """Whether ``save`` still holds the process's saves, seen by another
    save of writer ``owner`` from the current thread."""
    if save.thread is None:
        if save.owner == owner and not staged:
            return False  # this writer's own staged save: the caller claims it
        return time.monotonic() - save.started < _CLAIM_GRACE_S
    if save.thread is threading.current_thread():
        return False
    return save.thread.is_alive() and _in_dcp_save(save.thread)


def begin(checkpoint_id: Optional[str], owner: int, timeout_s: float, staged: bool) -> None:
    """Waits until no other save of the process is in flight, then registers
    this one (``staged``: from stage(), its thread is not known yet).
    Raises DeadlineExceeded, naming the save in flight, after ``timeout_s``."""
    global _current
    started = time.monotonic()
    waited_for: Optional[_Save] = None
    while True:
        with _lock:
            current = _current
            if current is None or not _busy(current, owner, staged):
                if (not staged and current is not None and current.thread is None
                        and current.owner == owner):
                    current.thread = threading.current_thread()  # claims its own staged save
                    if checkpoint_id:
                        current.checkpoint_id = checkpoint_id
                elif not (current is not None and current.thread is threading.current_thread()
                          and not staged):
                    _current = _Save(checkpoint_id or "", owner, time.monotonic(),
                                     None if staged else threading.current_thread())
                break
        waited_for = current
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise errors.DeadlineExceeded(
                f"{_label(checkpoint_id)} did not start: checkpoint "
                f"{current.checkpoint_id!r} was still being saved after {waited:.0f} s "
                f"(MemoffloadWriter(wait_previous_s={timeout_s:g}))")
        time.sleep(_POLL_S)
    if waited_for is not None:
        logs.log_limited(
            "a save waited for the one in flight", logging.WARNING,
            f"{_label(checkpoint_id)} waited {time.monotonic() - started:.2f} s for "
            f"checkpoint {waited_for.checkpoint_id!r}, still being saved (one save at a time: "
            "save less often, or wait for the last one before the next)",
            errors.StatusCode.OK)


def _label(checkpoint_id: Optional[str]) -> str:
    return f"checkpoint {checkpoint_id!r}" if checkpoint_id else "the next save"


def forget(owner: int) -> None:
    """A staged save of ``owner`` that will not run (its stage was dropped)."""
    global _current
    with _lock:
        if _current is not None and _current.thread is None and _current.owner == owner:
            _current = None
