"""What became of a save of :class:`MemoffloadWriter`, and what it does when
the node tier fails (``on_error``).

Every rank appends one :class:`_RankOutcome` to the write results it hands
DCP (where its shard went: the daemon, the fallback files, or nowhere and
why). The coordinator reads them in ``finish``: the checkpoint is published
only where every rank's shard is (``.metadata`` last), else the save is
skipped and nothing of it is visible. The :class:`SaveResult` rides back to
every rank on the Metadata that ``dcp.save`` returns (never in the stored
``.metadata``); :meth:`MemoffloadWriter.result` reads it.

Test hooks: with ``$MEMOFFLOAD_TEST_SAVE_PAUSE=<dir>`` a save stops at each
window named in ``<dir>/windows`` (one letter per window, docs/checkpoints.md
"What is lost, and when"): it creates ``<dir>/at-<window>-<rank>`` and waits
for ``<dir>/go-<window>``. Without the variable ``pause`` is None and the
writer does not call it (nor ``SaveJob._before_replicas``, window e).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ... import errors, logs

ON_ERROR = ("fallback", "skip", "raise")
DAEMON = "daemon"
FILESYSTEM = "filesystem"
SKIPPED = "skipped"
# The attribute of the Metadata dcp.save returns that carries the SaveResult.
RESULT_ATTR = "memoffload_result"
_OUTCOME_INDEX = MetadataIndex("memoffload/outcome")


@dataclass(frozen=True)
class SaveResult:
    """Where a save went: ``where`` is ``"daemon"``, ``"filesystem"`` (the
    fallback dir, ``path``) or ``"skipped"`` (nothing of it is visible; the
    previous checkpoint is still the latest). ``why``: why not the daemon;
    ``code``: the :class:`memoffload.StatusCode` of that cause."""

    checkpoint_id: str
    where: str
    path: str = ""
    why: str = ""
    code: int = 0

    @property
    def saved(self) -> bool:
        return self.where != SKIPPED


@dataclass(frozen=True)
class _RankOutcome:
    """One rank's write: where its shard went, and why not the daemon."""

    rank: int
    where: str
    why: str = ""
    code: int = 0


@dataclass(frozen=True)
class _SkipPlan:
    """The coordinator's answer when the save cannot go anywhere (no daemon
    and no fallback, or ``on_error="skip"``): nothing is written."""

    why: str
    code: int


def checked_on_error(on_error: str) -> str:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(map(repr, ON_ERROR))}, "
                         f"got {on_error!r}")
    return on_error


def outcome_result(outcome: _RankOutcome) -> WriteResult:
    return WriteResult(index=_OUTCOME_INDEX, size_in_bytes=0, storage_data=outcome)


def split_outcomes(results: List[List[WriteResult]]):
    """(every rank's results without its outcome, the outcomes)."""
    kept: List[List[WriteResult]] = []
    outcomes: List[_RankOutcome] = []
    for rank, rank_results in enumerate(results):
        mine = [wr.storage_data for wr in rank_results if isinstance(wr.storage_data, _RankOutcome)]
        outcomes.append(mine[0] if mine else _RankOutcome(rank, SKIPPED, "it reported nothing",
                                                          int(errors.StatusCode.INTERNAL)))
        kept.append([wr for wr in rank_results if not isinstance(wr.storage_data, _RankOutcome)])
    return kept, outcomes


# What the user must change (a setting, the job's code, who may use what):
# raised whatever on_error says, never sent to files or skipped.
_SETUP_ERRORS = (errors.InvalidArgument, errors.PermissionDenied, errors.Unauthenticated,
                 errors.FailedPrecondition, errors.AlreadyExists, errors.OutOfRange,
                 errors.Unimplemented, PermissionError)


def is_node_failure(exc: BaseException) -> bool:
    """A failure of the node tier (a daemon gone or full, a disk that
    failed), which ``on_error`` decides about. A wrong setting or a refusal
    (:data:`_SETUP_ERRORS`) and anything else (a bug) is raised."""
    return isinstance(exc, (errors.Error, OSError)) and not isinstance(exc, _SETUP_ERRORS)


def code_of(exc: BaseException) -> int:
    if isinstance(exc, errors.Error):
        return int(exc.code)
    return int(errors.StatusCode.UNAVAILABLE)


def as_error(why: str, code: int) -> errors.Error:
    return errors.error_from_status(int(code) or int(errors.StatusCode.UNKNOWN), why)


def warn_skipped(checkpoint_id: str, why: str, code: int) -> None:
    logs.log(logging.WARNING, f"checkpoint {checkpoint_id!r} was not saved: {why}; the "
             "previous checkpoint is still the latest, and the next save tries again",
             code or errors.StatusCode.UNAVAILABLE)


def unwrapped(exc: BaseException) -> BaseException:
    """The error to raise for DCP's CheckpointException (a BaseException
    that ``except Exception`` misses): the first failing rank's own
    exception, memoffload's with its code, when it is an Exception."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return exc
    for rank in sorted(failures):
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(inner, Exception):
            return inner
    return exc


# ---- test hooks ----------------------------------------------------------------


def _pause_at(root: Path) -> Callable[[str, int], None]:
    def pause(window: str, rank: int) -> None:
        try:
            wanted = (root / "windows").read_text()
        except FileNotFoundError:
            return
        if window not in wanted:
            return
        (root / f"at-{window}-{rank}").touch()
        deadline = time.monotonic() + 120
        while not (root / f"go-{window}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"test hook: nobody released window {window!r}")
            time.sleep(0.005)

    return pause


_PAUSE_DIR = os.environ.get("MEMOFFLOAD_TEST_SAVE_PAUSE", "")
pause: Optional[Callable[[str, int], None]] = _pause_at(Path(_PAUSE_DIR)) if _PAUSE_DIR else None
if pause is not None:  # (e): in the save's background work, before the replicas stream
    from .nodes.save import SaveJob

    SaveJob._before_replicas = staticmethod(lambda: pause("e", logs.rank() or 0))


def result_of(metadata: Any) -> Optional[SaveResult]:
    return getattr(metadata, RESULT_ATTR, None)
