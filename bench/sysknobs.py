"""Kernel settings a bench or a test changes for its run only: shared-memory
transparent huge pages and reserved hugetlbfs pages (issue 43).

``changed({path: value})`` writes each setting and gives the old value back
on every way out of the ``with`` (an exception, Ctrl-C, SIGTERM). Before it
writes anything it records the old values in ``STATE``, so that a run killed
outright (SIGKILL, a lost machine) is undone by the next one: every
``changed`` first calls ``restore_leftovers``. ``STATE`` lives in /run, which
a reboot empties, as it resets the settings themselves.

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


def _load_state() -> Dict[str, str]:
    try:
        with open(STATE) as f:
            state = json.load(f)
        return {str(k): str(v) for k, v in state.items()} if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_state(state: Dict[str, str]) -> None:
    if not state:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(STATE)
        return
    tmp = f"{STATE}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, STATE)


def restore_leftovers() -> List[str]:
    """Gives back the settings a killed run left changed; returns what it
    restored ("path: value")."""
    done = []
    state = _load_state()
    for path, value in list(state.items()):
        if writable(path) and read(path) != value:
            _write(path, value)
            done.append(f"{path}: {value}")
        del state[path]
    _save_state(state)
    return done


@contextlib.contextmanager
def changed(values: Dict[str, str]) -> Iterator[Dict[str, str]]:
    """Sets each path to its value for the ``with`` and restores the old
    ones on the way out; yields what each reads back (nr_hugepages may get
    fewer pages than asked)."""
    restore_leftovers()
    old = {path: read(path) for path in values}
    _save_state({**_load_state(), **old})
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
        for path, value in old.items():
            with contextlib.suppress(OSError):
                _write(path, value)
        state = _load_state()
        for path in old:
            state.pop(path, None)
        _save_state(state)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
