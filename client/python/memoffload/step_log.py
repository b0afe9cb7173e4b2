"""What the framework callbacks (:mod:`memoffload.hf`, :mod:`memoffload.lightning`)
log: per-step differences of a handle's counters and a summary line.

Each log entry (:meth:`StepLog.take`) has the keys of :data:`LOGGED_KEYS`:

- ``memoffload/offloaded_bytes``, ``memoffload/prefetched_bytes``,
  ``memoffload/skipped_bytes``: bytes of the callback's layers moved into the
  arena, read back, and kept in memory (no space, no daemon) since the
  previous entry. Over a training they sum to the handle's cumulative
  counters (``stats()["handle"]``).
- ``memoffload/skipped_share``: ``skipped / (offloaded + skipped)`` over the
  same interval (0.0 when nothing was saved).
- ``memoffload/blocking_rpcs``: RPCs the training thread waited for in the
  interval (the process's session; 1 at the attach, then 0).
- ``memoffload/arena_held_bytes``: a gauge, the arena bytes the process's
  session holds at the time of the entry (0 between steps unless graphs are
  kept alive).
- ``memoffload/arena_peak_bytes``: the most arena bytes the session held at
  once in the interval.

Torch is not imported here; the handle brings it.
"""

from __future__ import annotations

import logging
from typing import Any, Dict

from . import logs

__all__ = ["LOGGED_KEYS", "StepLog"]

_PREFIX = "memoffload/"
# Counters logged as differences: (log key, stats() level, name there).
_DELTAS = (
    ("offloaded_bytes", "handle", "offloaded_bytes"),
    ("prefetched_bytes", "handle", "prefetched_bytes"),
    ("skipped_bytes", "handle", "skipped_bytes"),
    ("blocking_rpcs", "session", "blocking_rpcs"),
)
LOGGED_KEYS = tuple(
    _PREFIX + name
    for name in (
        "offloaded_bytes",
        "prefetched_bytes",
        "skipped_bytes",
        "skipped_share",
        "blocking_rpcs",
        "arena_held_bytes",
        "arena_peak_bytes",
    )
)


def _share(skipped: int, offloaded: int) -> float:
    total = skipped + offloaded
    return skipped / total if total else 0.0


def _size(n: int) -> str:
    if abs(n) < 1024:
        return f"{n} B"
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"  # not reached


class StepLog:
    """Turns ``handle``'s cumulative counters into log entries: each
    :meth:`take` covers what happened since the previous one (the first since
    the StepLog was made), and :meth:`summary` one line over an epoch or the
    whole training. Reads wait for the handle's queued work (``flush()``), so
    an entry taken after a step's backward holds all of that step."""

    def __init__(self, handle: Any, step: int = 0) -> None:
        self._handle = handle
        self._held = 0
        self._peak = {"log": 0, "epoch": 0, "run": 0}
        now = self._counters()  # also ends the peak window before this StepLog
        self._at = {"log": now, "epoch": now, "run": now}
        self._step = {"epoch": step, "run": step}
        self._peak = {scope: self._held for scope in self._peak}

    def _counters(self) -> Dict[str, int]:
        self._handle.flush()
        s = self._handle.stats()
        self._held = int(s["arena_held_bytes"])
        peak = self._handle._take_arena_held_peak()
        for scope in self._peak:
            self._peak[scope] = max(self._peak[scope], peak)
        levels = {"handle": s["handle"], "session": s}
        return {key: int(levels[level][name]) for key, level, name in _DELTAS}

    def _entry(self, now: Dict[str, int], since: Dict[str, int], scope: str) -> Dict[str, Any]:
        d = {key: now[key] - since[key] for key in now}
        out: Dict[str, Any] = {_PREFIX + key: value for key, value in d.items()}
        out[_PREFIX + "skipped_share"] = _share(d["skipped_bytes"], d["offloaded_bytes"])
        out[_PREFIX + "arena_held_bytes"] = self._held
        out[_PREFIX + "arena_peak_bytes"] = self._peak[scope]
        return {key: out[key] for key in LOGGED_KEYS}

    def take(self) -> Dict[str, Any]:
        """The log entry since the previous :meth:`take`."""
        now = self._counters()
        entry = self._entry(now, self._at["log"], "log")
        self._at["log"] = now
        self._peak["log"] = self._held
        return entry

    def pending(self) -> bool:
        """Whether a counter moved since the previous :meth:`take`."""
        return self._counters() != self._at["log"]

    def totals(self) -> Dict[str, Any]:
        """The entry over the whole training so far (the sums of every
        :meth:`take`'s differences)."""
        return self._entry(self._counters(), self._at["run"], "run")

    def summary(self, what: str, step: int, scope: str = "epoch",
                level: int = logging.INFO) -> str:
        """Logs (to the ``memoffload`` logger) and returns one line over the
        current epoch (``scope="epoch"``, which then starts anew at ``step``)
        or the whole training (``"run"``); ``what`` names it, ``step`` is the
        framework's optimizer step now."""
        now = self._counters()
        e = self._entry(now, self._at[scope], scope)
        steps = step - self._step[scope]
        line = (
            f"{what}: {steps} step{'' if steps == 1 else 's'}, "
            f"offloaded {_size(e[_PREFIX + 'offloaded_bytes'])}, "
            f"prefetched {_size(e[_PREFIX + 'prefetched_bytes'])}, "
            f"skipped {_size(e[_PREFIX + 'skipped_bytes'])} "
            f"({e[_PREFIX + 'skipped_share']:.1%}), "
            f"arena peak {_size(e[_PREFIX + 'arena_peak_bytes'])}, "
            f"held now {_size(self._held)}, "
            f"blocking RPCs {e[_PREFIX + 'blocking_rpcs']}"
        )
        if scope == "epoch":
            self._at["epoch"] = now
            self._step["epoch"] = step
            self._peak["epoch"] = self._held
        logs.log(level, line)
        return line

