"""Which checkpoint files of the filesystem fallback may be trusted.

A fallback checkpoint's ``.metadata`` is a pickle: loading one that another
user wrote runs their code as you. Only what you own and nobody else can
write is read (docs/checkpoints.md, "Whose files are read"): the fallback
dir, each checkpoint dir, every file in it, and every directory above the
fallback dir (root's or yours, and not writable by group or others unless
sticky, like /tmp). What fails is refused with :class:`PermissionDenied`, or
skipped with one warning by ``latest_checkpoint``.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from typing import Iterable, Optional, Set

from .. import errors, logs

_warned: Set[str] = set()
_warned_lock = threading.Lock()


def _owner_problem(path: str, st: os.stat_result, what: str) -> Optional[str]:
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return f"{what} {path} is a symlink"
    if st.st_uid != me:
        return f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {me})"
    if st.st_mode & 0o022:
        return (f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: its group or others "
                f"can write it (chmod go-w {path})")
    return None


def _ancestors_problem(path: str) -> Optional[str]:
    me = os.geteuid()
    current = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    while True:
        st = os.lstat(current)
        if st.st_uid not in (0, me):
            return (f"directory {current} above {path} belongs to uid {st.st_uid}, who could "
                    f"replace what is below it")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"directory {current} above {path} has mode {stat.S_IMODE(st.st_mode):04o}: "
                    f"its group or others could replace what is below it")
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def fallback_dir_problem(fallback_dir: str) -> Optional[str]:
    """Why ``fallback_dir`` (which exists) cannot be trusted, or None."""
    problem = _ancestors_problem(fallback_dir)
    if problem is None:
        problem = _owner_problem(fallback_dir, os.lstat(fallback_dir), "checkpoint fallback dir")
    return problem


def checkpoint_problem(path: str) -> Optional[str]:
    """Why checkpoint dir ``path`` or a file in it cannot be trusted, or None
    (the fallback dir above it is checked by :func:`fallback_dir_problem`)."""
    problem = _owner_problem(path, os.lstat(path), "checkpoint dir")
    if problem is not None:
        return problem
    for name in sorted(os.listdir(path)):
        entry = os.path.join(path, name)
        problem = _owner_problem(entry, os.lstat(entry), "checkpoint file")
        if problem is not None:
            return problem
    return None


def _refused(problem: str) -> errors.PermissionDenied:
    return errors.PermissionDenied(
        f"refusing checkpoint files another user could have written: {problem}. Nothing was read "
        "from it. Remove it if it is not yours, or use a fallback_dir / $MEMOFFLOAD_CHECKPOINT_DIR "
        "of your own that nobody else can write")


def ensure_fallback_dir(fallback_dir: str) -> None:
    """Creates ``fallback_dir`` (0700, with any missing parent) if needed,
    then checks it; PermissionDenied when it cannot be trusted."""
    missing = []
    current = os.path.abspath(fallback_dir)
    while not os.path.lexists(current):
        missing.append(current)
        current = os.path.dirname(current)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)  # every dir it makes is private, not only the last
        except FileExistsError:
            pass
    problem = fallback_dir_problem(fallback_dir)
    if problem is not None:
        raise _refused(problem)


def check_checkpoint(fallback_dir: str, path: str) -> None:
    """PermissionDenied unless the fallback dir and checkpoint ``path`` in it
    (which exist) can be trusted."""
    problem = fallback_dir_problem(fallback_dir) or checkpoint_problem(path)
    if problem is not None:
        raise _refused(problem)


def warn_ignored(problems: Iterable[str]) -> None:
    """One warning (through the "memoffload" logger) naming what
    ``latest_checkpoint`` ignored and why; each problem is told once."""
    with _warned_lock:
        new = [p for p in problems if p not in _warned]
        _warned.update(new)
    if new:
        logs.log(logging.WARNING,
                 "latest_checkpoint ignores checkpoint files another user could have written: "
                 + "; ".join(new) + " (remove them if they are not yours)",
                 errors.StatusCode.PERMISSION_DENIED)
