"""Checkpoints saved by an earlier layout of the package still load (issue
39). A checkpoint's ``.metadata`` in the daemon is a pickle that names the
class of its storage entries, ``memoffload.torch.checkpoint._RegionItem``:
whatever module defines it, that name must keep importing.

The fixture (tests/python/fixtures/stop38_checkpoint) is checkpoint
``step-7`` of job ``fixture``, saved at stop 38 by the flat
``memoffload.torch`` layout: its two regions' bytes as they were in the
daemon (``.metadata`` and ``__0_0.distcp``) and the state dict it holds
(``expected.pt``). The test puts the regions into a fresh daemon, as they
would be after the save, and loads them with today's reader."""

from __future__ import annotations

import pickletools
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "stop38_checkpoint"
JOB = "fixture"


def _globals(blob: bytes) -> list:
    return [arg for op, arg, _ in pickletools.genops(blob) if isinstance(arg, str)]


def test_a_checkpoint_saved_by_the_flat_layout_loads(own_daemon):
    import torch.distributed.checkpoint as dcp
    import memoffload.torch.checkpoint as ckpt
    from memoffload import _C

    metadata = (FIXTURE / ".metadata").read_bytes()
    names = _globals(metadata)
    assert "memoffload.torch.checkpoint" in names and "_RegionItem" in names, names
    store = _C.RegionStore(runtime_dir=own_daemon.runtime_dir, job_id=JOB, rank=0, checksums=True,
                           rpc_timeout_ms=30000)
    for file_name in (".metadata", "__0_0.distcp"):
        blob = (FIXTURE / file_name).read_bytes()
        writer = store.create(f"dcp/step-7/{file_name}", len(blob), 0.0)
        writer.append(blob)
        writer.commit()
    expected = torch.load(FIXTURE / "expected.pt")
    state = {"model": {"w": torch.zeros(8, 4), "b": torch.zeros(5, dtype=torch.int64)},
             "extra": {"step": 0, "note": ""}}
    reader = ckpt.MemoffloadReader(job_id=JOB, runtime_dir=own_daemon.runtime_dir)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id="step-7", storage_reader=reader, no_dist=True)
    assert reader.last_mode == "daemon"
    assert torch.equal(state["model"]["w"], expected["model"]["w"])
    assert torch.equal(state["model"]["b"], expected["model"]["b"])
    assert state["extra"] == expected["extra"]
    assert ckpt.latest_checkpoint(job_id=JOB, runtime_dir=own_daemon.runtime_dir) == "step-7"
