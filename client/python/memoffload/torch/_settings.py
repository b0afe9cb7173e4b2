"""What every part of memoffload.torch reads from its arguments and the
environment the same way: the job id, and the launcher's rank variables.
Imports nothing of memoffload.torch."""

from __future__ import annotations

import os
from typing import Optional

from .. import errors

DEFAULT_JOB_ID = "torch"


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "-1"))
    except ValueError:
        return -1


def _job_id_of(job_id: Optional[str]) -> str:
    """``job_id``, else ``$MEMOFFLOAD_JOB_ID``, else ``"torch"``."""
    if job_id is not None and (not isinstance(job_id, str) or not job_id):
        raise errors.InvalidArgument(f"job_id must be a non-empty string or None, not {job_id!r}")
    return job_id or os.environ.get("MEMOFFLOAD_JOB_ID") or DEFAULT_JOB_ID
