"""The "memoffload" logger (no torch needed).

Every message of memoffload goes to ``logging.getLogger("memoffload")``, never
to bare stderr: the Python package's own and the native part's (the C++
client's and the torch layer's, which the extension's log sink queues from
import on, whatever thread logs them). Records carry three extra
attributes: ``rank`` (the global rank, ``None`` when unknown), ``local_rank``
(likewise) and ``code`` (the :class:`~memoffload.errors.StatusCode` the
message is about, ``OK`` if none). The message starts with ``rank N: `` when
the rank is known, else ``local rank N: `` when that one is, else with
nothing: never ``rank -1``.

The rank is torch.distributed's once a process group is initialized, else
``$RANK`` (the local rank: ``$LOCAL_RANK``); a native record made by a
session that knows its rank carries it. The native queue is taken (moved
into the logger) on Python threads only, so no native thread ever takes the
GIL: at attach, at each offloaded layer, ``stats()``, ``flush()``, and at exit.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Dict, Optional, Tuple

from .errors import StatusCode

logger = logging.getLogger("memoffload")


def _env_rank(name: str) -> Optional[int]:
    try:
        value = int(os.environ.get(name, ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def rank() -> Optional[int]:
    """This process's global rank, or None when unknown. torch.distributed is
    asked only when something imported it already."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # noqa: BLE001 - a broken or closing group: fall back to the env
            pass
    return _env_rank("RANK")


def local_rank() -> Optional[int]:
    """``$LOCAL_RANK``, or None when unset."""
    return _env_rank("LOCAL_RANK")


def prefix(global_rank: Optional[int], local: Optional[int]) -> str:
    """``"rank N: "``, ``"local rank N: "`` or ``""``."""
    if global_rank is not None:
        return f"rank {global_rank}: "
    if local is not None:
        return f"local rank {local}: "
    return ""


def log(level: int, message: str, code: "StatusCode | int" = StatusCode.OK,
        rank_hint: Optional[int] = None) -> None:
    """Logs ``message``; ``rank_hint`` (a native record's rank) wins when it
    is known and no process group says otherwise."""
    if not logger.isEnabledFor(level):
        return
    r = rank()
    if r is None and rank_hint is not None and rank_hint >= 0:
        r = rank_hint
    lr = local_rank()
    logger.log(level, "%s%s", prefix(r, lr), message,
               extra={"rank": r, "local_rank": lr, "code": StatusCode(int(code))})


# A cause logged by log_limited at most once per this many seconds.
REPEAT_SECONDS = 300.0
_limited: Dict[str, Tuple[float, int]] = {}  # cause -> (when last logged, repeats held back)
_limited_lock = threading.Lock()


def log_limited(cause: str, level: int, message: str,
                code: "StatusCode | int" = StatusCode.OK) -> bool:
    """:func:`log`, at most once per ``cause`` per :data:`REPEAT_SECONDS` in
    this process: for what repeats at every step or save (no daemon, a full
    arena). The record after a quiet spell says how many it held back.
    Returns whether it logged."""
    now = time.monotonic()
    with _limited_lock:
        last, held = _limited.get(cause, (None, 0))
        if last is not None and now - last < REPEAT_SECONDS:
            _limited[cause] = (last, held + 1)
            return False
        _limited[cause] = (now, 0)
    if held:
        message += (f" ({held} more like this held back since {now - last:.0f} s ago; "
                    f"logged at most every {REPEAT_SECONDS:.0f} s)")
    log(level, message, code)
    return True


def forward(native: Any) -> None:
    """Logs what the native part ``native`` (memoffload._C) queued."""
    for level, code, native_rank, message in native.take_log_records():
        log(level, message, code, native_rank)
