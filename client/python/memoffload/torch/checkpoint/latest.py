"""``latest_checkpoint``: the newest complete checkpoint of a job, in the
daemon or the fallback directory; across the nodes of a job that spans
several (a collective there: :mod:`.nodes.load`); and the warning about
checkpoints under other job ids (a typo in the job id)."""

from __future__ import annotations

import difflib
import logging
import os
import re
from typing import Dict, Iterable, List, Optional, Set, Tuple

from ... import _C, errors, logs
from .nodes import link as _link
from .nodes import load as _node_load
from . import trusted_files as _trusted_files
from .store import (
    FALLBACK_DIR_ENV,
    JOB_ID_ENV,
    METADATA_NAME,
    REGION_PREFIX,
    _marked_checkpoints,
    attach,
    fallback_dir_of,
    filesystem_checkpoints,
    forget,
    job_id_of,
    runtime_dir_of,
    split_region_name,
    stored_checkpoints,
)


def latest_checkpoint(job_id: Optional[str] = None, runtime_dir: str = "",
                      fallback_dir: Optional[str] = None, *, node_safe: bool = False,
                      _files: Optional[Dict[str, float]] = None) -> Optional[str]:
    """The newest complete checkpoint of the job (in the daemon, or in the
    fallback directory when that one is newer), or None. ``node_safe``: only
    checkpoints whose every piece has a copy on another node
    (``MemoffloadWriter(replicas=1)``). In a job whose ranks are on several
    nodes (more ranks than ``$LOCAL_WORLD_SIZE``, which torchrun sets; when
    it is not set, the ranks' daemons tell) it is a collective (call it on
    every rank): the answer is the newest checkpoint every rank can load,
    from its own node or another, the same on every rank. Fallback checkpoints another user could have written
    are ignored, with one warning. When the job has none but this user has
    checkpoints under other job ids, one line names them (once per job id and
    process): a WARNING when one of them looks like ``job_id`` mistyped, else
    INFO (a new job's first start is no mistake)."""
    job = job_id_of(job_id)
    store, _ = attach(runtime_dir, job, -1, True)
    problems: List[str] = []
    fallback = fallback_dir_of(fallback_dir, job)
    # _files: the durable tier's checkpoints when it is not a local dir (the manager's URL)
    files = filesystem_checkpoints(fallback, job, problems) if _files is None else _files
    _trusted_files.warn_ignored(problems)
    link = _link.multi_node(runtime_dir, store) if _link.several_nodes() else None
    if link is not None:
        found = _node_load.newest_loadable(link, store, _node_load.local_summary(store, files),
                                           node_safe)
    else:
        found = _newest_here(store, files, node_safe)
    if found is None and job not in _warned_other_jobs:
        defaulted = not (fallback_dir or os.environ.get(FALLBACK_DIR_ENV, ""))
        others = _other_jobs(runtime_dir, job, fallback, defaulted)
        if others:
            _warned_other_jobs.add(job)
            close = similar_job_ids(job, others)
            if close:  # a typo in a restart's job id: its checkpoints would be missed
                logs.log(logging.WARNING,
                         f"latest_checkpoint: job {job!r} has no checkpoint, but this user has "
                         f"checkpoints under other job ids: {_describe(others)}; did you mean "
                         f"{' or '.join(repr(c) for c in close)}? A restart finds its checkpoints "
                         f"only under the job id that saved them (job_id= or ${JOB_ID_ENV}) "
                         "(logged once per job id)",
                         errors.StatusCode.NOT_FOUND)
            else:  # most likely the first start of a new job
                logs.log(logging.INFO,
                         f"latest_checkpoint: job {job!r} has no checkpoint yet (a new job?); "
                         f"this user's checkpoints are under other job ids: {_describe(others)} "
                         "(logged once per job id)",
                         errors.StatusCode.NOT_FOUND)
    return found


def similar_job_ids(job_id: str, others: Iterable[str]) -> List[str]:
    """The job ids of ``others`` that look like ``job_id`` mistyped: the same
    but for case, '-', '_' and '.', or close by difflib's ratio (0.75)."""
    def plain(text: str) -> str:
        return re.sub(r"[-_.]", "", text.lower())
    names = sorted(others)
    same = [o for o in names if plain(o) == plain(job_id)]
    close = difflib.get_close_matches(job_id, names, n=3, cutoff=0.75)
    return same + [c for c in close if c not in same]


def _newest_here(store: Optional[object], files: Dict[str, float], node_safe: bool) -> Optional[str]:
    best: Optional[Tuple[float, str]] = None
    if store is not None:
        try:
            for info in stored_checkpoints(store).values():
                if not info.complete or (node_safe and not info.node_safe):
                    continue
                if best is None or (info.committed_unix, info.checkpoint_id) > best:
                    best = (info.committed_unix, info.checkpoint_id)
        except errors.Unavailable:
            forget(store)
    if not node_safe:
        for ckpt_id, mtime in files.items():
            if best is None or (mtime, ckpt_id) > best:
                best = (mtime, ckpt_id)
    return None if best is None else best[1]


# ---- checkpoints under other job ids (a typo in the job id) ----------------

_warned_other_jobs: Set[str] = set()


def _other_jobs(runtime_dir: str, job_id: str, fallback_dir: str,
                defaulted: bool) -> Dict[str, List[Tuple[float, str, str]]]:
    """{other job id: [(time, checkpoint id, where)]}: the complete
    checkpoints of this uid under job ids other than ``job_id``, in the
    daemon (its node listing) and in the fallback directory (and, when that
    is the default ``memoffload-checkpoints/<job>``, in its siblings)."""
    found: Dict[str, List[Tuple[float, str, str]]] = {}
    where = f"in the daemon at {runtime_dir_of(runtime_dir)}"
    for other, when, ckpt_id in _daemon_checkpoints_of_uid(runtime_dir):
        if other != job_id:
            found.setdefault(other, []).append((when, ckpt_id, where))
    dirs = [fallback_dir]
    if defaulted:
        parent = os.path.dirname(fallback_dir)
        try:
            dirs += sorted(os.path.join(parent, n) for n in os.listdir(parent)
                           if os.path.join(parent, n) != fallback_dir)
        except OSError:
            pass
    for directory in dirs:
        try:
            marked_ones = _marked_checkpoints(directory)
        except OSError:  # a sibling this user may not read: not theirs
            continue
        for ckpt_id, (marked, mtime) in marked_ones.items():
            if marked != job_id:
                found.setdefault(marked, []).append((mtime, ckpt_id, f"in {directory}"))
    return found


def _daemon_checkpoints_of_uid(runtime_dir: str) -> List[Tuple[str, float, str]]:
    """[(job id, commit time, checkpoint id)] of this uid's complete
    checkpoints in the daemon, any job id; [] when it cannot be asked."""
    if not hasattr(_C, "node_regions"):
        return []
    try:
        listing = _C.node_regions(runtime_dir, REGION_PREFIX)
    except errors.Error:
        return []
    uid = os.geteuid()
    out = []
    for region in listing["regions"]:
        parts = split_region_name(region["name"])
        if (region["uid"] == uid and region["committed"] and parts is not None
                and parts[1] == METADATA_NAME):
            out.append((region["job_id"], float(region["committed_unix"]), parts[0]))
    return out


def _describe(others: Dict[str, List[Tuple[float, str, str]]]) -> str:
    """"'run-42' (3 checkpoints, the newest 'step-4' in the daemon at ...)", by job id."""
    parts = []
    for other in sorted(others):
        newest = max(others[other])
        count = len(others[other])
        parts.append(f"{other!r} ({count} checkpoint{'s' if count != 1 else ''}, "
                     f"the newest {newest[1]!r} {newest[2]})")
    return ", ".join(parts)
