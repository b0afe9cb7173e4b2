"""latest_checkpoint() with a job id that has nothing while the same user
has checkpoints under other job ids (a typo in the restart's job id): one
warning on the "memoffload" logger names them and where they are, instead
of a silent None that makes the restart train from scratch."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from memoffload import StatusCode
from memoffload.torch.checkpoint import latest, store
from memoffload.torch.checkpoint import MemoffloadWriter, latest_checkpoint


def _save(checkpoint_id: str, **writer_kw: Any) -> str:
    import torch.distributed.checkpoint as dcp

    writer = MemoffloadWriter(**writer_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's "single process" note
        dcp.save({"w": torch.arange(16.0)}, storage_writer=writer, checkpoint_id=checkpoint_id,
                 no_dist=True)
    return writer.last_mode


def _other_job_warnings(caplog) -> List[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "memoffload" and "under other job ids" in r.getMessage()]


@pytest.fixture
def clean_warned(monkeypatch):
    monkeypatch.setattr(latest, "_warned_other_jobs", set())
    monkeypatch.delenv("MEMOFFLOAD_JOB_ID", raising=False)
    monkeypatch.delenv("MEMOFFLOAD_CHECKPOINT_DIR", raising=False)


def test_a_job_id_with_nothing_names_the_users_other_job_ids_once(own_daemon, tmp_path, caplog,
                                                                   clean_warned):
    fallback = str(tmp_path / "ckpt")
    daemon_kw: Dict[str, Any] = dict(runtime_dir=own_daemon.runtime_dir, fallback_dir=fallback)
    try:
        assert _save("step-3", job_id="run-42", **daemon_kw) == "daemon"
        assert _save("step-4", job_id="run-42", **daemon_kw) == "daemon"
        # A job whose save fell back to files (no daemon where it looked).
        assert _save("step-2", job_id="run-7", runtime_dir=str(tmp_path / "nobody"),
                     fallback_dir=fallback) == "filesystem"
        caplog.set_level(logging.INFO, logger="memoffload")
        assert latest_checkpoint(job_id="run-42", **daemon_kw) == "step-4"
        assert not _other_job_warnings(caplog)  # the job has checkpoints: nothing to say

        assert latest_checkpoint(job_id="run-4", **daemon_kw) is None
        told = _other_job_warnings(caplog)
        assert len(told) == 1, [r.getMessage() for r in caplog.records]
        text = told[0].getMessage()
        assert told[0].levelno == logging.WARNING and told[0].code == StatusCode.NOT_FOUND
        assert "job 'run-4' has no checkpoint" in text, text
        assert "did you mean 'run-42'" in text, text
        assert "'run-42' (2 checkpoints, the newest 'step-4' in the daemon at " \
               f"{own_daemon.runtime_dir})" in text, text
        assert f"'run-7' (1 checkpoint, the newest 'step-2' in {fallback})" in text, text

        assert latest_checkpoint(job_id="run-4", **daemon_kw) is None
        assert len(_other_job_warnings(caplog)) == 1  # once per job id
    finally:
        store.forget_all()


def test_the_default_fallback_dirs_of_other_job_ids_are_named(tmp_path, monkeypatch, caplog,
                                                              clean_warned):
    """No daemon and no fallback_dir: checkpoints sit in
    ./memoffload-checkpoints/<job id>, so a typo looks in another directory;
    the job ids of its siblings are named."""
    monkeypatch.chdir(tmp_path)
    nobody = str(tmp_path / "nobody")
    assert _save("step-1", job_id="bert-base", runtime_dir=nobody) == "filesystem"
    caplog.set_level(logging.INFO, logger="memoffload")
    assert latest_checkpoint(job_id="bert_base", runtime_dir=nobody) is None
    told = _other_job_warnings(caplog)
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    where = Path(tmp_path, "memoffload-checkpoints", "bert-base")
    assert f"'bert-base' (1 checkpoint, the newest 'step-1' in {where})" in told[0].getMessage()


def test_a_new_jobs_first_latest_checkpoint_is_no_warning(tmp_path, monkeypatch, caplog, clean_warned):
    """Issue 39: the first start of a new job, by a user with checkpoints of
    other jobs, warned as if its job id were mistyped. A job id unlike every
    other one is told at INFO; one that looks mistyped still warns."""
    monkeypatch.chdir(tmp_path)
    nobody = str(tmp_path / "nobody")
    assert _save("step-9", job_id="llama-sft", runtime_dir=nobody) == "filesystem"
    caplog.set_level(logging.INFO, logger="memoffload")
    caplog.clear()  # the save's own fallback warning
    assert latest_checkpoint(job_id="bert-pretrain", runtime_dir=nobody) is None
    told = _other_job_warnings(caplog)
    assert [r.levelno for r in told] == [logging.INFO], [r.getMessage() for r in caplog.records]
    assert "job 'bert-pretrain' has no checkpoint yet (a new job?)" in told[0].getMessage()
    assert not [r for r in caplog.records if r.name == "memoffload" and r.levelno >= logging.WARNING], \
        [r.getMessage() for r in caplog.records]
    caplog.clear()
    assert latest_checkpoint(job_id="Llama_SFT", runtime_dir=nobody) is None
    told = _other_job_warnings(caplog)
    assert [r.levelno for r in told] == [logging.WARNING], [r.getMessage() for r in caplog.records]
    assert "did you mean 'llama-sft'?" in told[0].getMessage()


def test_similar_job_ids_are_typos_not_new_jobs():
    assert latest.similar_job_ids("run-4", ["run-42", "bert"]) == ["run-42"]
    assert latest.similar_job_ids("bert_base", ["bert-base", "run-7"]) == ["bert-base"]
    assert latest.similar_job_ids("gpt-neox-20b", ["llama-sft", "run-7"]) == []
