"""Kernel settings a bench or a test changes for its run only: shared-memory
transparent huge pages and reserved hugetlbfs pages (issue 43).

``changed({path: value})`` writes each setting and gives the old value back
on every way out of the ``with`` (an exception, Ctrl-C, SIGTERM). Before it
writes anything it records the old values in ``STATE`` with its pid, so that
a run killed outright (SIGKILL) is undone by the next run on the node: every
``changed`` first calls ``restore_leftovers``, which gives back what runs no
longer alive left (never what a live run set). ``STATE`` lives in /run,
which a reboot empties, as it resets the settings themselves.

The daemon never changes these settings; docs/deploy.md says which to make.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from typing import Dict, Iterator, List

THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
THP_2M = "/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled"
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"
STATE = "/run/memoffload-sysknobs.json"


def read(path: str) -> str:
    """The setting: the selected word of a sysfs choice ("a [b] c" -> "b"),
    else the file's stripped contents; "" when the file is missing."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    if "[" in text and "]" in text:
        return text[text.index("[") + 1:text.index("]")]
    return text


def writable(path: str) -> bool:
    return os.path.exists(path) and os.access(path, os.W_OK)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _load_state() -> Dict[str, Dict[str, object]]:
    """path -> {"value": the value to give back, "pid": the run that changed it}."""
    try:
        with open(STATE) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(state, dict):
        return {}
    return {str(k): v for k, v in state.items()
            if isinstance(v, dict) and "value" in v and "pid" in v}


def _save_state(state: Dict[str, Dict[str, object]]) -> None:
    if not state:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(STATE)
        return
    tmp = f"{STATE}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, STATE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def restore_leftovers() -> List[str]:
    """Gives back the settings a killed run left changed (runs still alive
    keep theirs); returns what it restored ("path: value")."""
    done = []
    state = _load_state()
    for path, record in list(state.items()):
        if _alive(int(record["pid"])):
            continue
        value = str(record["value"])
        try:
            if writable(path) and read(path) != value:
                _write(path, value)
                done.append(f"{path}: {value}")
        except OSError:
            continue  # kept: the next run tries again
        del state[path]
    _save_state(state)
    return done


@contextlib.contextmanager
def changed(values: Dict[str, str]) -> Iterator[Dict[str, str]]:
    """Sets each path to its value for the ``with`` and restores the old
    ones on the way out; yields what each reads back (nr_hugepages may get
    fewer pages than asked). Nested, the outer's record of the first value
    stays the one a crash is undone to."""
    restore_leftovers()
    old = {path: read(path) for path in values}
    state = _load_state()
    recorded = [path for path in values if path not in state]
    for path in recorded:
        state[path] = {"value": old[path], "pid": os.getpid()}
    _save_state(state)
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signo, frame):  # a SIGTERM unwinds through the finally below
            raise SystemExit(128 + signo)

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        for path, value in values.items():
            _write(path, value)
        yield {path: read(path) for path in values}
    finally:
        failed = []
        for path, value in old.items():
            try:
                _write(path, value)
            except OSError:
                failed.append(path)
        state = _load_state()
        for path in recorded:
            if path not in failed:  # a failed restore keeps its record for the next run
                state.pop(path, None)
        _save_state(state)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
