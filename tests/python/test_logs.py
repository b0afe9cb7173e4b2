"""The native part's log lines (the C++ client's attach line, the torch
layer's warnings) reach the "memoffload" logger through the client's log
sink, labelled with the rank when it is known and never with "rank -1", and
nothing of memoffload is written to bare stderr."""

from __future__ import annotations

import logging
import socket

import pytest
import torch.distributed as dist

import memoffload.torch as mot
from memoffload import logs
from memoffload.torch.checkpoint import store

INSTANCE_LINE = "on memoffloadd instance"


def instance_records(caplog):
    return [r for r in caplog.records if r.name == "memoffload" and INSTANCE_LINE in r.getMessage()]


@pytest.fixture
def no_rank_env(monkeypatch):
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_the_attach_line_goes_to_the_logger_with_the_rank_not_to_stderr(
        own_daemon, no_rank_env, monkeypatch, caplog, capfd):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    caplog.set_level(logging.INFO, logger="memoffload")
    capfd.readouterr()
    try:
        off = mot.get_offloader(own_daemon.runtime_dir)
        assert off.stats()["connected"]
    finally:
        mot.forget_offloader(own_daemon.runtime_dir)
    err = capfd.readouterr().err
    assert "memoffload" not in err, err
    records = instance_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    record = records[0]
    assert record.getMessage().startswith("rank 5: session "), record.getMessage()
    assert own_daemon.runtime_dir in record.getMessage()
    assert record.levelno == logging.INFO
    assert (record.rank, record.local_rank) == (5, 1)


def test_without_a_known_rank_no_rank_is_named(own_daemon, no_rank_env, caplog, capfd):
    """A checkpoint session (rank -1 to the client) of a process with no
    rank anywhere: the line names none, and says so on no stream of its own."""
    caplog.set_level(logging.INFO, logger="memoffload")
    capfd.readouterr()
    region_store, why = store.attach(own_daemon.runtime_dir, "logs-test", -1, True)
    try:
        assert region_store is not None, why
    finally:
        store.forget_all()
    err = capfd.readouterr().err
    assert "memoffload" not in err, err
    records = instance_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert records[0].getMessage().startswith("session "), records[0].getMessage()
    assert records[0].rank is None and records[0].local_rank is None
    assert not any("rank -1" in r.getMessage() for r in caplog.records)


def test_the_local_rank_labels_a_line_when_the_rank_is_unknown(no_rank_env, monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_RANK", "2")
    caplog.set_level(logging.INFO, logger="memoffload")
    logs.log(logging.WARNING, "something")
    (record,) = [r for r in caplog.records if r.name == "memoffload"]
    assert record.getMessage() == "local rank 2: something"
    assert (record.rank, record.local_rank) == (None, 2)


def test_the_process_group_rank_labels_a_line(no_rank_env, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        caplog.set_level(logging.INFO, logger="memoffload")
        logs.log(logging.WARNING, "something")
    finally:
        dist.destroy_process_group()
    (record,) = [r for r in caplog.records if r.name == "memoffload"]
    assert record.getMessage() == "rank 0: something"
    assert record.rank == 0


def test_a_save_without_a_daemon_warns_once_per_cause_then_counts_the_repeats(
        tmp_path, monkeypatch, caplog):
    """Issue 39: with no daemon every save of a job logged its fallback
    warning (~400 characters), so a job without a daemon filled its log. Now
    one WARNING per cause per process every few minutes; the next one says
    how many it held back."""
    import time
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from memoffload.torch.checkpoint import MemoffloadWriter

    caplog.set_level(logging.WARNING, logger="memoffload")
    nobody = str(tmp_path / "nobody")

    def save(step: int) -> None:
        writer = MemoffloadWriter(job_id="no-daemon", runtime_dir=nobody,
                                  fallback_dir=str(tmp_path / "ckpt"), keep_last=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"w": torch.ones(4)}, storage_writer=writer, checkpoint_id=f"step-{step}",
                     no_dist=True)
        assert writer.last_mode == "filesystem"

    def told():
        return [r for r in caplog.records if "falls back to the filesystem" in r.getMessage()]

    for step in range(1, 5):
        save(step)
    assert len(told()) == 1, [r.getMessage() for r in caplog.records]
    assert told()[0].code == logs.StatusCode.UNAVAILABLE
    monkeypatch.setattr(logs, "REPEAT_SECONDS", 0.2)
    time.sleep(0.25)
    save(5)
    assert len(told()) == 2, [r.getMessage() for r in caplog.records]
    assert "(3 more like this held back" in told()[1].getMessage(), told()[1].getMessage()
    assert "step-5" in told()[1].getMessage()


def test_log_limited_keeps_causes_apart(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="memoffload")
    for _ in range(3):
        logs.log_limited("a", logging.WARNING, "cause a")
        logs.log_limited("b", logging.INFO, "cause b")
    assert [r.getMessage() for r in caplog.records] == ["cause a", "cause b"]
