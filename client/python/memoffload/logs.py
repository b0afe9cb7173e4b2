"""The "memoffload" logger (no torch needed).

Every message of memoffload goes to ``logging.getLogger("memoffload")``, never
to bare stderr. Records carry two extra attributes: ``rank`` (``$RANK``, -1
when unset) and ``code`` (the :class:`~memoffload.errors.StatusCode` the
message is about, ``OK`` if none); the message starts with ``rank N:``.
The native part queues its messages (the worker thread never takes the GIL);
:func:`drain` moves them into the logger and runs from the training thread
(at each offloaded layer, ``stats()``, ``flush()``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .errors import StatusCode

logger = logging.getLogger("memoffload")


def rank() -> int:
    try:
        return int(os.environ.get("RANK", "-1"))
    except ValueError:
        return -1


def log(level: int, message: str, code: "StatusCode | int" = StatusCode.OK) -> None:
    if not logger.isEnabledFor(level):
        return
    r = rank()
    logger.log(level, "rank %d: %s", r, message, extra={"rank": r, "code": StatusCode(int(code))})


def drain(native: Any) -> None:
    """Logs what the native part ``native`` (memoffload._C) queued."""
    for level, code, message in native.drain_log():
        log(level, message, code)
