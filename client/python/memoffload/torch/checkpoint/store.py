"""Where the checkpoints of :mod:`memoffload.torch.checkpoint` live.

In the daemon a checkpoint ``<id>`` of a job is a set of committed regions
named ``dcp/<id>/__<rank>_0.distcp`` (one per rank) plus ``dcp/<id>/.metadata``,
which is committed last: a checkpoint is complete iff its ``.metadata`` region
exists. Regions belong to (uid, job id), not to a process, and are gone when
the daemon restarts.

The filesystem fallback writes what DCP's FileSystemWriter writes into
``<fallback_dir>/<id>/`` plus a marker file naming the job, so that
retention only ever removes directories this module wrote for that job.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ... import _C, errors, logs
from . import trusted_files as _trusted_files

REGION_PREFIX = "dcp/"
METADATA_NAME = ".metadata"
NODE_SAFE_NAME = ".node-safe"  # committed once every piece has a copy on another node
MARKER_NAME = ".memoffload-job"
JOB_ID_ENV = "MEMOFFLOAD_JOB_ID"
FALLBACK_DIR_ENV = "MEMOFFLOAD_CHECKPOINT_DIR"
SYSTEM_RUNTIME_DIR = "/run/memoffload"
# "dcp/" + id + "/__<rank>_0.distcp" must stay within the daemon's 255 bytes.
MAX_CHECKPOINT_ID_BYTES = 200


def job_id_of(job_id: Optional[str]) -> str:
    """``job_id``, else ``$MEMOFFLOAD_JOB_ID``; a ValueError if neither is set.

    Regions are owned by (uid, job id): the restarted job finds its
    checkpoints only under the same explicit id."""
    value = job_id or os.environ.get(JOB_ID_ENV, "")
    if not value:
        raise ValueError(
            "memoffload checkpoints need an explicit job id: pass job_id=... or set "
            f"${JOB_ID_ENV} (the restarted job must use the same value to find its checkpoints)"
        )
    return value


def checkpoint_id_problem(checkpoint_id: Any) -> Optional[str]:
    """Why ``checkpoint_id`` cannot name a checkpoint, or None if it can."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return f"a checkpoint id is a str, got {type(checkpoint_id).__name__}"
    text = os.fspath(checkpoint_id)
    if not text or text in (".", ".."):
        return f"checkpoint id {text!r} is empty or a dot name"
    if "/" in text or any(not (" " < ch <= "~") for ch in text):
        return f"checkpoint id {text!r} must be printable ASCII without '/' or spaces (e.g. 'step-100')"
    if len(text) > MAX_CHECKPOINT_ID_BYTES:
        return f"checkpoint id of {len(text)} bytes is longer than {MAX_CHECKPOINT_ID_BYTES}"
    return None


def checked_checkpoint_id(checkpoint_id: Any) -> str:
    problem = checkpoint_id_problem(checkpoint_id)
    if problem is not None:
        raise ValueError(problem)
    return os.fspath(checkpoint_id)


def region_name(checkpoint_id: str, file_name: str) -> str:
    return f"{REGION_PREFIX}{checkpoint_id}/{file_name}"


def split_region_name(name: str) -> Optional[Tuple[str, str]]:
    """(checkpoint id, file name) of a checkpoint region, None for others."""
    if not name.startswith(REGION_PREFIX):
        return None
    ckpt, sep, file_name = name[len(REGION_PREFIX):].partition("/")
    if not sep or not ckpt or not file_name:
        return None
    return ckpt, file_name


def runtime_dir_of(runtime_dir: str) -> str:
    """The runtime dir a client attaches to, found in libmemoffload's order
    (common/runtime_dir.h; for messages only, libmemoffload verifies it):
    the argument, $MEMOFFLOAD_RUNTIME_DIR, /run/memoffload when its broker
    socket exists, $XDG_RUNTIME_DIR/memoffload, /tmp/memoffload-$EUID."""
    if runtime_dir:
        return runtime_dir
    env = os.environ.get("MEMOFFLOAD_RUNTIME_DIR", "")
    if env:
        return env
    if _is_socket(os.path.join(SYSTEM_RUNTIME_DIR, "broker.sock")):
        return SYSTEM_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    return f"{xdg}/memoffload" if xdg else f"/tmp/memoffload-{os.geteuid()}"


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def fallback_dir_of(fallback_dir: Optional[str], job_id: str) -> str:
    """``fallback_dir``, else ``$MEMOFFLOAD_CHECKPOINT_DIR``, else
    ``./memoffload-checkpoints/<job id>`` (absolute). Created 0700 and
    checked before use (:mod:`.trusted_files`)."""
    value = fallback_dir or os.environ.get(FALLBACK_DIR_ENV, "")
    if not value:
        value = os.path.join("memoffload-checkpoints", job_id)
    if "://" in os.fspath(value):  # an fsspec URL (the manager's durable tier: durable_url.py)
        return os.fspath(value).rstrip("/")
    return os.path.abspath(os.fspath(value))


# ---- attaching -------------------------------------------------------------

_stores: Dict[Tuple[str, str, int, bool], Any] = {}
# A prefix no checkpoint region has (ids have no spaces): a cheap liveness probe.
_NO_CHECKPOINT = REGION_PREFIX + " "
_stores_lock = threading.Lock()


def attach(runtime_dir: str, job_id: str, rank: int, checksums: bool,
           rpc_timeout_ms: int = 30000) -> Tuple[Optional[Any], str]:
    """(the process's RegionStore for these settings, "") or (None, why not).

    Only "no daemon here" (UNAVAILABLE, NOT_FOUND) is a reason to fall back;
    any other error (a refused job id, ...) is raised."""
    if not hasattr(_C, "RegionStore"):
        return None, "this build of memoffload._C has no RegionStore"
    key = (runtime_dir, job_id, rank, checksums)
    with _stores_lock:
        store = _stores.get(key)
        if store is not None:
            try:
                store.list(_NO_CHECKPOINT)  # still attached (the daemon may have restarted)?
                return store, ""
            except errors.Error:
                del _stores[key]
                _close(store)
        try:
            store = _C.RegionStore(runtime_dir=runtime_dir, job_id=job_id, rank=rank,
                                   checksums=checksums, rpc_timeout_ms=rpc_timeout_ms)
        except (errors.Unavailable, errors.NotFound) as exc:
            return None, str(exc)
        finally:
            logs.forward(_C)  # the attach's line
        _stores[key] = store
        return store, ""


def _close(store: Any) -> None:
    try:
        store.close()
    except errors.Error as exc:  # the session is gone already; it holds nothing of ours
        logs.log(logging.DEBUG, f"closing a region session: {exc}", exc.code)


def forget(store: Any) -> None:
    """Drops ``store`` from the cache (after it failed: the daemon may have
    restarted); the next attach makes a new session."""
    with _stores_lock:
        for key, value in list(_stores.items()):
            if value is store:
                del _stores[key]
    _close(store)


def forget_all() -> None:
    """Closes every cached session (tests that stop and start daemons)."""
    with _stores_lock:
        stores = list(_stores.values())
        _stores.clear()
    for store in stores:
        _close(store)


# ---- what is in the daemon -------------------------------------------------


@dataclass
class StoredCheckpoint:
    """One checkpoint id's regions. ``committed_unix``: the .metadata region's
    commit time when complete, else the newest region's."""

    checkpoint_id: str
    complete: bool = False
    committed_unix: float = 0.0
    regions: List[str] = field(default_factory=list)
    size_bytes: int = 0
    node_safe: bool = False  # its .node-safe region is here (nodes.save)


def stored_checkpoints(store: Any) -> Dict[str, StoredCheckpoint]:
    found: Dict[str, StoredCheckpoint] = {}
    for region in store.list(REGION_PREFIX):
        parts = split_region_name(region["name"])
        if parts is None:
            continue
        ckpt_id, file_name = parts
        info = found.setdefault(ckpt_id, StoredCheckpoint(ckpt_id))
        info.regions.append(region["name"])
        info.size_bytes += int(region["size_bytes"])
        committed = float(region["committed_unix"])
        if file_name == NODE_SAFE_NAME:
            info.node_safe = True
        if file_name == METADATA_NAME:
            info.complete = True
            info.committed_unix = committed
        elif not info.complete:
            info.committed_unix = max(info.committed_unix, committed)
    return found


def delete_checkpoint(store: Any, info: StoredCheckpoint) -> None:
    """Deletes the .metadata region first, so that a crash half-way leaves an
    incomplete checkpoint (collected later), never a complete-looking one
    with missing data."""
    for name in sorted(info.regions, key=lambda n: not n.endswith("/" + METADATA_NAME)):
        try:
            store.delete(name)
        except errors.NotFound:
            pass  # deleted by someone else meanwhile


def collect_dead(store: Any, found: Optional[Dict[str, "StoredCheckpoint"]] = None) -> List[str]:
    """Deletes what saves that died left (regions without a .metadata: never
    loadable); returns their ids. Only between saves: a save in flight has
    no .metadata yet either."""
    if found is None:
        found = stored_checkpoints(store)
    dead = [c for c in found.values() if not c.complete]
    for info in dead:
        delete_checkpoint(store, info)
    return [c.checkpoint_id for c in dead]


def retain(store: Any, keep_last: Optional[int], current_id: str) -> List[str]:
    """After ``current_id`` committed: deletes complete checkpoints older than
    the newest ``keep_last`` (never the newest node-safe one) and incomplete
    ones (dead saves) older than the current one. Returns the ids deleted."""
    if keep_last is None:
        return []
    found = stored_checkpoints(store)
    current = found.get(current_id)
    if current is None or not current.complete:
        return []  # never delete unless the new one has committed
    complete = sorted((c for c in found.values() if c.complete),
                      key=lambda c: (c.committed_unix, c.checkpoint_id), reverse=True)
    keep = {c.checkpoint_id for c in complete[:keep_last]} | {current_id}
    node_safe = [c for c in complete if c.node_safe]
    if node_safe:
        keep.add(node_safe[0].checkpoint_id)
    doomed = [c for c in complete if c.checkpoint_id not in keep]
    doomed += [c for c in found.values()
               if not c.complete and c.committed_unix <= current.committed_unix]
    for info in doomed:
        delete_checkpoint(store, info)
    return [c.checkpoint_id for c in doomed]


# ---- the filesystem fallback -----------------------------------------------


def write_marker(fs: "_trusted_files.TrustedFileSystem", path: str, job_id: str) -> None:
    """The job's marker in checkpoint dir ``path``, written through ``fs``
    (a temporary file, then a rename)."""
    tmp = os.path.join(path, f"{MARKER_NAME}.{os.getpid()}.tmp")
    with fs.create_stream(tmp, "wb") as f:
        f.write((job_id + "\n").encode())
    fs.rename(tmp, os.path.join(path, MARKER_NAME))


def _marked_checkpoints(fallback_dir: str, problems: Optional[List[str]] = None
                        ) -> Dict[str, Tuple[str, float]]:
    """{checkpoint id: (the job its marker names, .metadata mtime)} of the
    complete checkpoints this module wrote under ``fallback_dir``, read
    through its trusted descriptor (:mod:`._trusted_files`). What another
    user could have written is left out, and why is added to ``problems``."""
    found: Dict[str, Tuple[str, float]] = {}
    try:
        root = _trusted_files.open_fallback_dir(fallback_dir)
    except (FileNotFoundError, NotADirectoryError):
        return found
    except _trusted_files.Untrusted as exc:
        if problems is not None:
            problems.append(str(exc))
        return found
    with root:
        for name in os.listdir(root.fd):
            try:
                if not stat.S_ISDIR(os.stat(name, dir_fd=root.fd, follow_symlinks=False).st_mode):
                    continue
                try:
                    ckpt_fd = root.open_checkpoint(name, check_files=True)
                except _trusted_files.Untrusted as exc:
                    if problems is not None and root.contains(name, METADATA_NAME):
                        problems.append(str(exc))
                    continue
                try:
                    metadata_mtime = os.stat(METADATA_NAME, dir_fd=ckpt_fd,
                                             follow_symlinks=False).st_mtime
                finally:
                    os.close(ckpt_fd)
                marked = root.read(name, MARKER_NAME).decode(errors="replace").strip()
                found[name] = (marked, metadata_mtime)
            except (FileNotFoundError, NotADirectoryError, _trusted_files.Untrusted):
                continue
    return found


def filesystem_checkpoints(fallback_dir: str, job_id: str,
                           problems: Optional[List[str]] = None) -> Dict[str, float]:
    """{checkpoint id: .metadata mtime} of the complete checkpoints this
    module wrote for ``job_id`` under ``fallback_dir``. What another user
    could have written is left out, and why is added to ``problems``."""
    return {name: mtime for name, (marked, mtime) in _marked_checkpoints(fallback_dir, problems).items()
            if marked == job_id}


def retention_doomed(found: Dict[str, float], keep_last: int, current_id: str) -> List[str]:
    """Of ``found`` ({id: time}), those retention deletes once ``current_id``
    is there: all but the newest ``keep_last`` (never ``current_id``)."""
    if current_id not in found:
        return []
    newest = sorted(found, key=lambda c: (found[c], c), reverse=True)
    return [c for c in newest[keep_last:] if c != current_id]


def retain_filesystem(fallback_dir: str, job_id: str, keep_last: Optional[int], current_id: str) -> List[str]:
    """The same rule as :func:`retain` for the fallback directories (only
    those carrying this job's marker and a committed .metadata)."""
    if keep_last is None:
        return []
    doomed = retention_doomed(filesystem_checkpoints(fallback_dir, job_id), keep_last, current_id)
    if doomed:
        with _trusted_files.trusted_fallback_dir(fallback_dir) as root:
            fs = _trusted_files.TrustedFileSystem(root)
            for ckpt_id in doomed:
                fs.rm_file(os.path.join(fallback_dir, ckpt_id, METADATA_NAME))  # incomplete now
                root.remove_checkpoint(ckpt_id)
    return doomed
