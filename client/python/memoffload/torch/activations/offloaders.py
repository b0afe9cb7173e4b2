"""The process's offloaders: one native ``_C.GroupOffloader`` (one session
of memoffloadd) per runtime dir and job id, made on first use."""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

from ... import logs
from .._native import _C
from .._settings import DEFAULT_JOB_ID, _env_int, _job_id_of  # noqa: F401 - DEFAULT_JOB_ID re-exported

# The process's offloaders (one session each), by (runtime dir, job id).
_offloaders: Dict[Tuple[str, str], "_C.GroupOffloader"] = {}
_offloaders_lock = threading.Lock()

def get_offloader(runtime_dir: Optional[str] = None, job_id: Optional[str] = None) -> "_C.GroupOffloader":
    """The process's offloader (one session) for ``runtime_dir`` and ``job_id``.

    ``None`` or ``""`` means ``$MEMOFFLOAD_RUNTIME_DIR`` or the default runtime
    directory; ``job_id`` ``None`` means ``$MEMOFFLOAD_JOB_ID`` or ``"torch"``
    (the job ``memoffloadctl sessions`` and ``/metrics`` show, and the job
    quota the session counts against). One offloader per (runtime dir, job
    id). The first call attaches (the only blocking RPC of a steady training
    loop); without a daemon it still succeeds and every group stays in memory
    until a daemon appears there.
    """
    key = (runtime_dir or "", _job_id_of(job_id))
    with _offloaders_lock:
        off = _offloaders.get(key)
        if off is None:
            off = _C.GroupOffloader(
                runtime_dir=key[0],
                job_id=key[1],
                rank=_env_int("RANK"),
                local_rank=_env_int("LOCAL_RANK"),
            )
            _offloaders[key] = off
    logs.forward(_C)
    return off


def forget_offloader(runtime_dir: Optional[str] = None, job_id: Optional[str] = None) -> None:
    """Drops the cached offloader of ``runtime_dir`` and ``job_id`` (``None``:
    of every job id there); its session ends once no live graph uses it.
    Mostly for tests that start and stop daemons."""
    with _offloaders_lock:
        for key in list(_offloaders):
            if key[0] == (runtime_dir or "") and (job_id is None or key[1] == _job_id_of(job_id)):
                del _offloaders[key]


def daemon_status(runtime_dir: Optional[str] = None, timeout_ms: int = 5000) -> Dict[str, Any]:
    """The daemon's GetStatus (capacity, used, reserved, committed, ...).
    Raises :class:`memoffload.Unavailable` when no daemon answers."""
    return _C.daemon_status(runtime_dir or "", timeout_ms)
