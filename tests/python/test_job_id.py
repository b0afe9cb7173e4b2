"""job_id= names the session a trainer attaches: the process's offloaders are
keyed by (runtime dir, job id), and `memoffloadctl --json sessions` shows the
job id passed (before: only $MEMOFFLOAD_JOB_ID set it, every session was job
`torch`). The callbacks' job_id= is tested with their recipes
(test_docs_recipes.py)."""

from __future__ import annotations

import pytest
import torch

import memoffload
import memoffload.torch as mot


def stack() -> torch.nn.Sequential:
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])


def step(model: torch.nn.Module) -> None:
    model(torch.randn(8, 64)).square().mean().backward()


def test_job_id_names_the_session_memoffloadctl_shows(own_daemon, monkeypatch):
    monkeypatch.delenv("MEMOFFLOAD_JOB_ID", raising=False)
    rt = own_daemon.runtime_dir
    a, b, plain = stack(), stack(), stack()
    handle_a = mot.offload_layers(list(a), runtime_dir=rt, job_id="run-a", min_tensor_bytes=0)
    handle_plain = mot.offload_layers(list(plain), runtime_dir=rt, min_tensor_bytes=0)
    step(a)
    with mot.offload_activations(runtime_dir=rt, job_id="run-b") as block:
        loss = b(torch.randn(8, 64)).square().mean()
    loss.backward()
    assert own_daemon.jobs() == ["run-a", "run-b", "torch"]

    # One offloader (session) per (runtime dir, job id): a handle's top-level
    # counters are its own job's session's.
    assert mot.get_offloader(rt, "run-a") is mot.get_offloader(rt, "run-a")
    assert mot.get_offloader(rt, "run-a") is not mot.get_offloader(rt, "run-b")
    assert mot.get_offloader(rt) is mot.get_offloader(rt, "torch")
    s = handle_a.stats()
    assert s["offloaded_bytes"] == s["handle"]["offloaded_bytes"] > 0, s
    assert handle_plain.stats()["offloaded_bytes"] == 0
    assert block.stats()["offloaded_bytes"] > 0

    # Without job_id=: $MEMOFFLOAD_JOB_ID, the same session as naming it.
    monkeypatch.setenv("MEMOFFLOAD_JOB_ID", "from-env")
    assert mot.get_offloader(rt) is mot.get_offloader(rt, "from-env")
    assert "from-env" in own_daemon.jobs()

    for bad in ("", 7):
        with pytest.raises(memoffload.InvalidArgument):
            mot.offload_layers(list(stack()), runtime_dir=rt, job_id=bad)
        with pytest.raises(memoffload.InvalidArgument):
            mot.offload_activations(runtime_dir=rt, job_id=bad, enabled=False)
    handle_a.remove()
    handle_plain.remove()

    # forget_offloader(rt, job) drops that job's offloader only.
    kept = mot.get_offloader(rt, "run-b")
    mot.forget_offloader(rt, "run-a")
    assert mot.get_offloader(rt, "run-b") is kept
