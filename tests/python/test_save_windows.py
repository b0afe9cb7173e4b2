"""Issue 41: a save never takes training down. The table of outcomes of
docs/checkpoints.md ("What is lost, and when"), one test per cell: a real
daemon SIGKILLed in each window of a ``dcp.async_save`` (the save stopped
there by the writer's test hook), for each ``on_error``, in each layout.

Windows: (a) before the save's set-up, (b) between stage and write, (c)
during the write, (d) during the commit, (e) during replication (two nodes
only; the daemon of the node the replica goes to). Each cell is one of: "daemon" (landed in the daemon), "filesystem"
(landed whole in the fallback dir, loadable bit for bit), "skipped" (one
WARNING, nothing visible, the previous checkpoint still the latest) or
"raised" (on_error="raise": memoffload's own error, an Exception, with the
daemon's code). In every cell the next save lands in the daemon once it is
back.

Each layout runs all its cells in one set of rank processes
(save_windows_worker.py), the test killing and restarting daemons between
them; the per-cell tests read what the ranks recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import Daemon, free_port

WORKER = Path(__file__).resolve().parent / "save_windows_worker.py"
MODES = ("fallback", "skip", "raise")

# layout -> (ranks, nodes, windows)
LAYOUTS = {
    "one rank": (1, 1, "abcd"),
    "two ranks, one daemon": (2, 1, "abcd"),
    "two nodes, a replica": (2, 2, "abcde"),
}


def expected(layout: str, window: str, mode: str) -> str:
    """The table: where a save goes when the daemon dies in ``window``."""
    ranks, _, _ = LAYOUTS[layout]
    if window == "e":  # the save is over; its replica is what the kill takes
        return "daemon"
    if mode == "raise":
        return "raised"
    if mode == "skip":
        return "skipped"
    if window in "ab" or ranks == 1:
        return "filesystem"
    return "skipped"  # (c), (d): DCP's coordinator cannot move other ranks' shards


def _wait(path: Path, procs: List[subprocess.Popen], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a rank exited ({p.returncode}) before {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear in {timeout_s} s")
        time.sleep(0.005)


def _run_layout(base: Path, layout: str) -> Dict[str, Any]:
    ranks, nodes, windows = LAYOUTS[layout]
    cells = [(w, m) for w in windows for m in MODES]
    pause = base / "pause"
    pause.mkdir()
    daemons = []
    key = base / "replication-key"
    key.write_text("k1 " + "5a" * 32 + "\n")
    key.chmod(0o400)
    for node in range(nodes):
        rt = base / f"rt{node}"
        rt.mkdir(mode=0o700)
        daemons.append(Daemon(rt, "64MiB", "16MiB", [f"--replication-key-file={key}"]).start())
    nowhere = base / "nowhere"
    nowhere.mkdir(mode=0o700)
    out = base / "out"
    out.mkdir()
    cfg = {"world": ranks, "cells": cells, "job": "windows", "out": str(out),
           "fallback": str(base / "fallback"), "nowhere": str(nowhere),
           "replicas": 1 if nodes > 1 else 0,
           "runtime_dirs": [daemons[r * nodes // ranks].runtime_dir for r in range(ranks)]}
    (base / "cfg.json").write_text(json.dumps(cfg))
    port = free_port()
    procs = []
    for rank in range(ranks):
        node = rank * nodes // ranks
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), MEMOFFLOAD_TEST_SAVE_PAUSE=str(pause),
                   GLOO_SOCKET_IFNAME="lo", MEMOFFLOAD_REPLICATION_ADDRESS=f"127.0.0.{2 + node}",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(ranks // nodes))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(base / "cfg.json")],
                                      env=env))
    try:
        for k, (window, _) in enumerate(cells):
            (pause / "windows").write_text(window)
            (pause / f"cell-{k}").touch()
            for rank in ([0] if window == "d" else range(ranks)):
                _wait(pause / f"at-{window}-{rank}", procs)
            killed = daemons[1 if window == "e" else 0]  # (e): the replica's node
            killed.kill()
            (pause / f"go-{window}").touch()
            for rank in range(ranks):
                _wait(pause / f"saved-{k}-{rank}", procs)
            (pause / "windows").write_text("")
            for f in pause.glob("at-*"):
                f.unlink()
            (pause / f"go-{window}").unlink()
            killed.start()
            (pause / f"up-{k}").touch()
            for rank in range(ranks):  # its next save, not paused, is over too
                _wait(pause / f"done-{k}-{rank}", procs)
        for p in procs:
            assert p.wait(timeout=120) == 0, "a rank failed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        for d in daemons:
            d.stop()
    return {rank: json.loads((out / f"rank{rank}.json").read_text())["cells"]
            for rank in range(ranks)}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    runs: Dict[str, Any] = {}

    def get(layout: str) -> Dict[int, List[Dict[str, Any]]]:
        if layout not in runs:
            runs[layout] = _run_layout(tmp_path_factory.mktemp("windows"), layout)
        return runs[layout]

    return get


CELLS = [(layout, w, m) for layout, (_, _, windows) in LAYOUTS.items() for w in windows
         for m in MODES]


@pytest.mark.parametrize("layout,window,mode", CELLS,
                         ids=[f"{lay}-{w}-{m}" for lay, w, m in CELLS])
def test_a_daemon_killed_in_each_window(recorded, layout, window, mode):
    by_rank = recorded(layout)
    want = expected(layout, window, mode)
    warnings = 0
    for rank, cells in by_rank.items():
        cell = next(c for c in cells if c["window"] == window and c["mode"] == mode)
        assert cell["where"] == want, (rank, cell)
        if window == "e":
            assert cell["node_safe"] is False, cell
        if want == "raised":
            assert cell["memoffload_error"] and not cell.get("base"), cell
            assert cell["code"] == 14, cell  # UNAVAILABLE: the daemon is gone
        if want == "filesystem":
            assert cell["latest"] == "cell" and cell["loaded_from"] == "filesystem", cell
        else:
            assert cell["latest"] == "prev", cell  # nothing of it is visible
        assert cell["bit_exact"], cell
        assert cell["next"] == "daemon", cell
        warnings += sum("was not saved" in line for line in cell["warnings"])
    assert warnings == (1 if want == "skipped" else 0), by_rank
