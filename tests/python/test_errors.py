"""Errors say their status once, from the daemon to Python, across processes:
``str(err)`` is ``"CODE: message"`` however often the error was pickled
(DCP moves a rank's exception to the other ranks that way), and ``.code``
and the class survive the trip."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import memoffload
from conftest import free_port
from memoffload import StatusCode

WORKER = Path(__file__).resolve().parent / "errors_worker.py"
WORLD_SIZE = 2
CODE_NAMES = [c.name for c in StatusCode if c != StatusCode.OK]


def _status_names(text: str) -> list:
    """Every status name that starts a "NAME: " prefix in text."""
    return [name for name in CODE_NAMES for _ in range(text.count(f"{name}: "))]


@pytest.mark.parametrize("make", [
    lambda: memoffload.AlreadyExists("checkpoint 'step-2' exists"),
    lambda: memoffload.ResourceExhausted("region dcp/x does not fit"),
    lambda: memoffload.Error("region dcp/x does not fit", StatusCode.RESOURCE_EXHAUSTED),
    lambda: memoffload.error_from_status(8, "region dcp/x does not fit"),
], ids=["subclass", "subclass2", "base-with-code", "from-status"])
def test_an_error_says_its_status_once_after_pickling_and_copying(make):
    err = make()
    trips = [pickle.loads(pickle.dumps(err)),
             pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(err)))),
             copy.copy(err), copy.deepcopy(err)]
    for back in [err, *trips]:
        assert type(back) is type(err)
        assert back.code == err.code
        assert back.message == err.message
        assert str(back) == f"{err.code.name}: {err.message}", str(back)
        assert repr(back).count(err.code.name) <= 1, repr(back)



def test_dcp_save_errors_of_two_ranks_say_their_status_once_with_their_code(tiny_daemon, tmp_path):
    """The issue's two texts: ALREADY_EXISTS of a second save of "step-2", and
    RESOURCE_EXHAUSTED of a save that does not fit the (4 MiB) arena, as
    every rank of a 2-rank gloo job catches them from dcp.save."""
    cfg = {"out": str(tmp_path), "job_id": f"errors-{uuid.uuid4().hex[:8]}",
           "runtime_dir": tiny_daemon.runtime_dir, "fallback_dir": str(tmp_path / "fb"),
           "big_bytes": 8 << 20}
    port = free_port()
    procs = []
    for rank in range(WORLD_SIZE):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for rank, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {rank} did not finish")
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}: {err.decode()[-4000:]}"
    for rank in range(WORLD_SIZE):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, code, words in (("already_exists", "ALREADY_EXISTS", "checkpoint 'step-2'"),
                                  ("resource_exhausted", "RESOURCE_EXHAUSTED", "region")):
            seen = result[case]
            assert seen is not None, f"rank {rank}: the {case} save did not fail"
            failures = seen["failures"]
            assert failures, (rank, seen)
            for failure in failures.values():
                assert failure["code"] == code, (rank, case, failure)
                assert failure["text"].startswith(f"{code}: "), (rank, case, failure)
                assert words in failure["text"], (rank, case, failure)
                assert _status_names(failure["text"]) == [code], (rank, case, failure["text"])
            # The exception's whole text (its traceback lines included) names
            # the status once per failed rank, never twice in a row.
            assert f"{code}: {code}" not in seen["text"], (rank, case, seen["text"])
