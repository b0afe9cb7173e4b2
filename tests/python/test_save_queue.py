"""Issue 41: a second save while one is in flight waits for it, on every
rank, and says so; never two saves' collectives interleaved (which hung the
process for good), never a staged copy of the first dropped by the second.
Also: a wait past ``wait_previous_s`` gives up with DeadlineExceeded naming
the save in flight, and the saves after it run."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import memoffload
from conftest import free_port
from memoffload.torch.checkpoint import MemoffloadWriter, latest_checkpoint

WORKER = Path(__file__).resolve().parent / "inflight_worker.py"


def test_a_second_async_save_waits_for_the_first_on_every_rank(daemon, tmp_path):
    job = f"queue-{uuid.uuid4().hex[:8]}"
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), daemon.runtime_dir, job, str(tmp_path), "1.0"],
        env=dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)))
        for rank in range(2)]
    try:
        codes = [p.wait(timeout=90) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("two saves in flight hung the ranks")
    assert codes == [0, 0]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["first"] == r["second"] == "daemon", r
        assert r["first_loaded"] and r["second_loaded"], r
        waited = [line for line in r["log"] if "waited" in line and "'first'" in line]
        assert len(waited) == 1 and waited[0].startswith("WARNING"), r["log"]
        # The training thread waited in stage() for the first save's end.
        assert r["second_started_s"] > 0.5, r
    assert latest_checkpoint(job_id=job, runtime_dir=daemon.runtime_dir) == "second"


def test_a_save_between_its_reset_and_its_collectives_holds_the_next(daemon):
    """DCP's ``save`` calls the writer's ``reset()`` (where the saving thread
    claims the save) before ``_save_state_dict``: a second stage() that looks
    in between still waits (CI once saw a second save start 34 ms in)."""
    job = f"queue-{uuid.uuid4().hex[:8]}"
    writer = MemoffloadWriter(job_id=job, runtime_dir=daemon.runtime_dir, keep_last=None)
    reset = writer.reset
    claimed, released = threading.Event(), threading.Event()

    def held_reset(checkpoint_id: Any = None) -> None:
        reset(checkpoint_id)
        if checkpoint_id == "first":
            claimed.set()
            time.sleep(0.5)
            released.set()

    writer.reset = held_reset
    first = dcp.async_save({"x": torch.ones(1024)}, storage_writer=writer, checkpoint_id="first")
    assert claimed.wait(30)
    second = dcp.async_save({"x": torch.full((1024,), 2.0)}, storage_writer=writer,
                            checkpoint_id="second")
    assert released.is_set(), "the second save started while the first was in its reset()"
    assert writer.result(first).where == writer.result(second).where == "daemon"
    writer.close()
    assert latest_checkpoint(job_id=job, runtime_dir=daemon.runtime_dir) == "second"


def test_a_wait_past_its_limit_says_which_save_is_in_flight(daemon, caplog):
    """The save in flight here is held inside DCP's save on another thread
    (its finish blocked); the next save gives up after wait_previous_s with
    DeadlineExceeded (an Exception) before any collective, and once the
    first is over the next one runs."""
    job = f"queue-{uuid.uuid4().hex[:8]}"
    writer = MemoffloadWriter(job_id=job, runtime_dir=daemon.runtime_dir, wait_previous_s=0.3)
    release = threading.Event()
    finish = writer.finish

    def held_finish(*args, **kwargs):
        release.wait(30)
        finish(*args, **kwargs)

    writer.finish = held_finish
    first = dcp.async_save({"x": torch.ones(1024)}, storage_writer=writer, checkpoint_id="held")
    time.sleep(0.2)
    with pytest.raises(memoffload.DeadlineExceeded) as raised:
        dcp.async_save({"x": torch.ones(1024)}, storage_writer=writer, checkpoint_id="late")
    assert "'held' was still being saved" in str(raised.value), raised.value
    release.set()
    assert writer.result(first).where == "daemon"
    writer.finish = finish
    caplog.set_level(logging.WARNING, logger="memoffload")
    after = dcp.async_save({"x": torch.ones(1024)}, storage_writer=writer, checkpoint_id="after")
    assert writer.result(after).where == "daemon"
    writer.close()
    assert latest_checkpoint(job_id=job, runtime_dir=daemon.runtime_dir) == "after"
