"""CheckpointManager's rules for the durable tier, one process against a real
daemon (issue 44, found by an adversarial review): a save that falls back to
files while the daemon is down keeps the durable tier's retention, not the
node's; a publish that fails in an object store leaves no checkpoint behind
(no empty ``.metadata`` that every later restore would load); two jobs that
share a durable dir never write over, nor remove, each other's checkpoints."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch

from conftest import Daemon
from memoffload import errors
from memoffload.torch.checkpoint import CheckpointManager, MemoffloadReader
from memoffload.torch.checkpoint import persist as _persist

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state() -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(32, 32)}


def manager(rt: str, job: str, durable: str, **kw) -> CheckpointManager:
    kw.setdefault("async_save", False)
    kw.setdefault("persist_share", 1.0)
    return CheckpointManager(state(), job, runtime_dir=rt, durable_dir=durable, node_every=1,
                             **kw)


def ids(path: Path) -> list:
    return sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) if path.exists() else []


def test_a_save_while_the_daemon_is_down_keeps_the_durable_retention(tmp_path):
    d = Daemon(tmp_path / "rt", "256MiB", "16MiB").start()
    durable = tmp_path / "durable"
    try:
        m = manager(d.runtime_dir, "rules-a", str(durable), durable_every=1, keep_last_node=1,
                    keep_last_durable=None)
        for step in (1, 2, 3):
            m.step(step)
            m.wait_persisted()
        assert ids(durable) == ["step-1", "step-2", "step-3"]
        d.kill()
        assert m.step(4).where == "filesystem"  # the daemon is down: to the durable dir whole
        # keep_last_durable=None: nothing of the durable tier is deleted (it was pruned to
        # keep_last_node=1 before).
        assert ids(durable) == ["step-1", "step-2", "step-3", "step-4"]
        m.close()
    finally:
        d.stop()


def test_a_publish_that_fails_in_an_object_store_leaves_no_checkpoint(tmp_path, monkeypatch,
                                                                        caplog):
    d = Daemon(tmp_path / "rt", "256MiB", "16MiB").start()
    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    try:
        m = manager(d.runtime_dir, "rules-b", url, durable_every=1)

        def refuse(*_a, **_k):
            raise errors.FailedPrecondition("test: the metadata cannot be made")

        monkeypatch.setattr(_persist, "durable_metadata", refuse)
        with caplog.at_level(logging.WARNING, logger="memoffload"):
            m.step(1)
            m.wait_persisted()
        assert "was not persisted" in caplog.text, caplog.text
        assert not list(bucket.glob("**/.metadata")), list(bucket.rglob("*"))
        assert m.status()["durable"] == [] and m.status()["partial"] == []
        monkeypatch.undo()
        m.step(2)  # the next durable save goes through
        m.close()
        assert ids(bucket) == ["step-2"] and m.status()["durable"] == ["step-2"]
    finally:
        d.stop()


def test_two_jobs_sharing_a_durable_dir_never_touch_each_others_checkpoints(tmp_path, caplog):
    d = Daemon(tmp_path / "rt", "256MiB", "16MiB").start()
    durable = tmp_path / "shared"
    try:
        a = manager(d.runtime_dir, "rules-job-a", str(durable), durable_every=2)
        b = manager(d.runtime_dir, "rules-job-b", str(durable), durable_every=2)
        for step in (1, 2):
            a.step(step)
        a.close()
        for step in (1, 2):
            b.step(step)
        with caplog.at_level(logging.WARNING, logger="memoffload"):
            b.close()
        assert "already exists (job 'rules-job-a')" in caplog.text, caplog.text
        assert ids(durable) == ["step-2"] and a.status()["durable"] == ["step-2"]
        assert b.status()["durable"] == [] and b.status()["partial"] == []
        # Job a's checkpoint is intact, and job b's restore neither loads nor removes it.
        sd = state()
        reader = MemoffloadReader(job_id="rules-job-a", runtime_dir=str(tmp_path / "none"),
                                  fallback_dir=str(durable))
        import torch.distributed.checkpoint as dcp

        dcp.load(sd, storage_reader=reader, checkpoint_id="step-2")
        assert reader.last_mode == "filesystem"
        b2 = manager(d.runtime_dir, "rules-job-b", str(durable), durable_every=2)
        assert b2.restore() == 2 and b2.last_restore["tier"] == "daemon"  # its own, from the node
        b2.close()
        assert ids(durable) == ["step-2"] and a.status()["durable"] == ["step-2"]
    finally:
        d.stop()
