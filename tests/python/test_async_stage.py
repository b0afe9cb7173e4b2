"""``dcp.async_save`` with MemoffloadWriter as its own AsyncStager: the
staged copy lands in a region that becomes the checkpoint (no second copy,
no staging buffer of torch's), against a real daemon.

In this process: the staged copy is taken when async_save returns (training
may change the tensors from then on), the checkpoint is what was staged, bit
for bit, and holds one copy of the state; no staging region is left behind,
nor after a staged state that is never saved; without a daemon the staged
copy is torch's and the save falls back as it always did. In a process of
its own: a save SIGKILLed half-way leaves no complete checkpoint. Real FSDP2
(gloo, world size 2, stage_worker.py): sharded model and optimizer state
saved asynchronously while training goes on, loaded back bit for bit.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import memoffload.torch as mot
import stage_worker
from conftest import free_port
from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter, latest_checkpoint
from memoffload.torch.checkpoint.frames import frames

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))


def _regions(runtime_dir: str, job: str):
    store = mot._C.RegionStore(runtime_dir, job)
    try:
        return {r["name"]: r for r in store.list("")}
    finally:
        store.close()


def test_the_staged_copy_is_the_checkpoint(daemon):
    job = f"stage-{uuid.uuid4().hex[:8]}"
    model = _model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    writer = MemoffloadWriter(job_id=job, runtime_dir=daemon.runtime_dir)
    fut = dcp.async_save({"model": model.state_dict(), "step": 3}, storage_writer=writer,
                         checkpoint_id="step-3")
    # The copy is taken: training may change the tensors now.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    fut.result()
    state_bytes = sum(v.numel() * v.element_size() for v in saved.values())
    assert writer.last_staged == {"tensors": len(saved), "bytes": state_bytes, "outside": 0}
    assert writer.last_mode == "daemon"
    writer.close()
    regions = _regions(daemon.runtime_dir, job)
    assert sorted(regions) == ["dcp/step-3/.metadata", "dcp/step-3/__0_0.distcp",
                               "dcp/step-3/__0_1.distcp"], sorted(regions)
    # One copy of the state: the staged region is the checkpoint's data (each
    # tensor inside the torch.save record that the durable tier writes out).
    data = regions["dcp/step-3/__0_0.distcp"]
    framed = sum(len(f) for v in saved.values() for f in frames(v.dtype, tuple(v.shape)))
    assert state_bytes + framed <= data["size_bytes"] < state_bytes + framed + len(saved) * 64 + 4096, data
    assert latest_checkpoint(job_id=job, runtime_dir=daemon.runtime_dir) == "step-3"
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    state = {"model": fresh.state_dict()}
    dcp.load(state, storage_reader=MemoffloadReader(job_id=job, runtime_dir=daemon.runtime_dir),
             checkpoint_id="step-3")
    for key, value in state["model"].items():
        assert torch.equal(value, saved[key]), key


def test_a_staged_state_never_saved_leaves_nothing(daemon):
    job = f"stage-{uuid.uuid4().hex[:8]}"
    writer = MemoffloadWriter(job_id=job, runtime_dir=daemon.runtime_dir)
    before = daemon.status()["used_bytes"]
    writer.stage({"model": _model().state_dict()})
    assert daemon.status()["used_bytes"] > before
    writer.stage({"model": _model().state_dict()})  # the first staged region is aborted
    writer.close()
    assert daemon.status()["used_bytes"] == before
    assert _regions(daemon.runtime_dir, job) == {}


def test_without_a_daemon_staging_and_saving_fall_back(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="memoffload")
    missing = tmp_path / "none"
    missing.mkdir(mode=0o700)
    model = _model()
    writer = MemoffloadWriter(job_id="fallback", runtime_dir=str(missing),
                              fallback_dir=str(tmp_path / "ckpt"))
    dcp.async_save({"model": model.state_dict()}, storage_writer=writer,
                   checkpoint_id="step-1").result()
    writer.close()
    assert writer.last_mode == "filesystem"
    assert any("async checkpoint staging" in r.getMessage() for r in caplog.records)
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    state = {"model": fresh.state_dict()}
    dcp.load(state, storage_reader=MemoffloadReader(job_id="fallback", runtime_dir=str(missing),
                                                    fallback_dir=str(tmp_path / "ckpt")),
             checkpoint_id="step-1")
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value), key


KILLED = """
import os, signal, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from memoffload.torch.checkpoint import MemoffloadWriter
torch.manual_seed(0)
model = torch.nn.Linear(512, 512)
writer = MemoffloadWriter(job_id=sys.argv[2], runtime_dir=sys.argv[1])
dcp.async_save({"model": model.state_dict()}, storage_writer=writer, checkpoint_id="good").result()
def die(region, written):
    os.kill(os.getpid(), signal.SIGKILL)   # half-way: data staged and committed, no .metadata
writer._after_append = die
dcp.async_save({"model": model.state_dict(), "step": 1}, storage_writer=writer,
               checkpoint_id="killed").result()
"""


def test_a_save_killed_half_way_leaves_no_complete_checkpoint(daemon):
    job = f"stage-{uuid.uuid4().hex[:8]}"
    proc = subprocess.run([sys.executable, "-c", KILLED, daemon.runtime_dir, job], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert latest_checkpoint(job_id=job, runtime_dir=daemon.runtime_dir) == "good"
    names = sorted(_regions(daemon.runtime_dir, job))
    assert "dcp/killed/.metadata" not in names, names
    assert not any(n.startswith("staging/") for n in names), names
    # The next save collects what the dead one left.
    writer = MemoffloadWriter(job_id=job, runtime_dir=daemon.runtime_dir)
    dcp.async_save({"model": _model().state_dict()}, storage_writer=writer,
                   checkpoint_id="next").result()
    writer.close()
    assert "killed" in writer.last_collected
    assert not any(n.startswith("dcp/killed/") for n in _regions(daemon.runtime_dir, job))



def test_fsdp2_async_save_while_training_loads_back_bit_for_bit(daemon, tmp_path):
    job = f"stage-{uuid.uuid4().hex[:8]}"
    mp.spawn(stage_worker.run, args=(2, free_port(), daemon.runtime_dir, str(tmp_path), job),
             nprocs=2)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["mismatches"] == [], r
        assert r["mode"] == "daemon", r
        assert r["staged"]["tensors"] > 0 and r["staged"]["outside"] == 0, r


def test_a_checkpoint_that_can_never_fit_goes_to_the_fallback(tmp_path, caplog):
    """Issue 41: the staged copy falls back to torch's memory with one
    warning naming the limit; the save meets the same limit when it makes
    its region (before any rank writes) and goes to the fallback dir whole,
    loadable, where it raised DCP's CheckpointException at every save."""
    from conftest import Daemon

    caplog.set_level(logging.WARNING, logger="memoffload")
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    d = Daemon(rt, "64MiB", "16MiB", ["--regions-job-max-bytes=256KiB"]).start()
    try:
        model = _model()
        files = tmp_path / "files"
        writer = MemoffloadWriter(job_id="limited", runtime_dir=d.runtime_dir,
                                  fallback_dir=str(files))
        for step in (1, 2, 3):
            fut = dcp.async_save({"model": model.state_dict()}, storage_writer=writer,
                                 checkpoint_id=f"step-{step}")
            result = writer.result(fut)
            assert result.where == "filesystem" and result.path == str(files / f"step-{step}")
            assert "regions.job_max_bytes" in result.why and result.code == 8, result
        writer.close()
        staging = [r.getMessage() for r in caplog.records
                   if "staging into the daemon failed" in r.getMessage()]
        assert len(staging) == 1 and "regions.job_max_bytes" in staging[0], staging
        falls_back = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
        assert len(falls_back) == 1 and "can never fit" in falls_back[0], falls_back
        assert latest_checkpoint(job_id="limited", runtime_dir=d.runtime_dir,
                                 fallback_dir=str(files)) == "step-3"
        fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
        state = {"model": fresh.state_dict()}
        dcp.load(state, storage_reader=MemoffloadReader(job_id="limited", runtime_dir=d.runtime_dir,
                                                        fallback_dir=str(files)),
                 checkpoint_id="step-3")
        for key, value in model.state_dict().items():
            assert torch.equal(state["model"][key], value), key
        assert d.status()["used_bytes"] == 0
    finally:
        d.stop()


def test_staging_goes_on_after_the_daemon_restarts(own_daemon, caplog):
    """The staging session is attached again after a restart, like the
    saving one: the staged copy is the checkpoint again, not torch's."""
    job = f"stage-{uuid.uuid4().hex[:8]}"
    writer = MemoffloadWriter(job_id=job, runtime_dir=own_daemon.runtime_dir)
    state = {"x": torch.arange(1 << 18, dtype=torch.float32)}
    dcp.async_save(state, storage_writer=writer, checkpoint_id="step-1").result()
    assert writer.last_staged["tensors"] == 1
    own_daemon.stop()
    own_daemon.start()
    caplog.set_level(logging.WARNING, logger="memoffload")
    dcp.async_save(state, storage_writer=writer, checkpoint_id="step-2").result()
    assert writer.last_mode == "daemon"
    assert writer.last_staged.get("tensors") == 1, writer.last_staged
    assert not [r for r in caplog.records if "staging into the daemon failed" in r.getMessage()]
    writer.close()


def test_closing_one_writer_leaves_the_others_staging(daemon, caplog):
    """Writers (and readers) of one job and rank share the process's
    RegionStore: one writer's close() must not close it under the others."""
    job = f"stage-{uuid.uuid4().hex[:8]}"
    first = MemoffloadWriter(job_id=job, runtime_dir=daemon.runtime_dir)
    second = MemoffloadWriter(job_id=job, runtime_dir=daemon.runtime_dir)
    dcp.async_save({"a": torch.ones(1 << 16)}, storage_writer=first, checkpoint_id="a-1").result()
    dcp.async_save({"b": torch.ones(1 << 16)}, storage_writer=second, checkpoint_id="b-1").result()
    first.close()
    caplog.set_level(logging.WARNING, logger="memoffload")
    dcp.async_save({"b": torch.ones(1 << 16)}, storage_writer=second, checkpoint_id="b-2").result()
    assert second.last_staged.get("tensors") == 1, second.last_staged
    assert not [r for r in caplog.records if "staging into the daemon failed" in r.getMessage()]
    second.close()


def test_a_daemon_dead_since_a_save_never_raises_into_training(own_daemon, tmp_path, monkeypatch,
                                                                caplog):
    """Issue 41: the daemon SIGKILLed between a save's stage and its write,
    and still down for the two saves after it: no save raises (the next
    async_save used to raise in the training thread, aborting the dead
    daemon's staged region), each lands whole in the fallback dir, and once
    the daemon is back the next save is in it again."""
    from memoffload.torch.checkpoint import outcome

    job = f"stage-{uuid.uuid4().hex[:8]}"
    files = tmp_path / "files"
    writer = MemoffloadWriter(job_id=job, runtime_dir=own_daemon.runtime_dir,
                              fallback_dir=str(files))
    state = {"x": torch.arange(1 << 16, dtype=torch.float32)}
    monkeypatch.setattr(outcome, "pause",
                        lambda window, rank: own_daemon.kill() if window == "b" else None)
    assert writer.result(dcp.async_save(state, storage_writer=writer,
                                        checkpoint_id="step-1")).where == "filesystem"
    monkeypatch.setattr(outcome, "pause", None)
    caplog.set_level(logging.WARNING, logger="memoffload")
    for step in (2, 3):
        state["x"] += 1
        pending = dcp.async_save(state, storage_writer=writer, checkpoint_id=f"step-{step}")
        saved = writer.result(pending)
        assert saved.where == "filesystem" and saved.path == str(files / f"step-{step}"), saved
    assert latest_checkpoint(job_id=job, runtime_dir=own_daemon.runtime_dir,
                             fallback_dir=str(files)) == "step-3"
    loaded = {"x": torch.zeros(1 << 16)}
    dcp.load(loaded, storage_reader=MemoffloadReader(job_id=job, runtime_dir=own_daemon.runtime_dir,
                                                     fallback_dir=str(files)),
             checkpoint_id="step-3")
    assert torch.equal(loaded["x"], state["x"])
    own_daemon.start()
    assert writer.result(dcp.async_save(state, storage_writer=writer,
                                        checkpoint_id="step-4")).where == "daemon"
    writer.close()


def test_the_save_hooks_are_off_without_their_variable():
    """Issue 41: the windows' pause hooks cost nothing unless
    $MEMOFFLOAD_TEST_SAVE_PAUSE is set: the writer tests `pause is None`."""
    code = ("from memoffload.torch.checkpoint import outcome\n"
            "from memoffload.torch.checkpoint.nodes.save import SaveJob\n"
            "assert outcome.pause is None and SaveJob._before_replicas is None\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MEMOFFLOAD_TEST_SAVE_PAUSE"}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


def test_without_a_fallback_a_save_without_a_daemon_is_skipped_once_said(tmp_path, caplog,
                                                                         monkeypatch):
    """fallback_dir=False: "fallback" then means "skip": nothing written
    anywhere, one WARNING per save, the future resolves normally. A wrong
    on_error is a ValueError at once."""
    missing = tmp_path / "none"
    missing.mkdir(mode=0o700)
    monkeypatch.chdir(tmp_path)  # where the default fallback dir would be
    with pytest.raises(ValueError, match="on_error must be one of"):
        MemoffloadWriter(job_id="nofb", runtime_dir=str(missing), on_error="ignore")
    caplog.set_level(logging.WARNING, logger="memoffload")
    writer = MemoffloadWriter(job_id="nofb", runtime_dir=str(missing), fallback_dir=False)
    pending = dcp.async_save({"model": _model().state_dict()}, storage_writer=writer,
                             checkpoint_id="step-1")
    saved = writer.result(pending)
    writer.close()
    assert saved.where == "skipped" and not saved.saved and saved.code == 14, saved
    assert "no memoffload daemon reachable" in saved.why, saved
    skipped = [r.getMessage() for r in caplog.records if "was not saved" in r.getMessage()]
    assert len(skipped) == 1 and "'step-1'" in skipped[0], skipped
    assert list(tmp_path.iterdir()) == [missing], list(tmp_path.iterdir())
