"""The daemon's share for placed state (``quotas.state_share``, issue 42)
with a small arena: ``place_state`` on a model and optimizer bigger than
half the arena places what the job's share allows (the default 0.5 of the
usable arena, the job having no limit), the rest stays in torch's memory
with one WARNING naming the limit, training stays bit for bit that of a
run without memoffload, and ``offload_layers`` of the same job in the same
process still offloads its activations into the rest of the arena.

With the arena first come, first served (before the share), the state took
all of it and the activations were skipped."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import memoffload
import memoffload.torch as mot
from conftest import Daemon, bit_equal, clone_model

MIB = 1 << 20
ARENA = 16 * MIB
SHARE = ARENA // 2  # quotas.state_share 0.5 of the usable arena
JOB = "share"


class Stack(nn.Module):
    """Six 512x512 layers: 6 MiB of weights, 12 MiB of AdamW moments and
    6 MiB of kept gradients, each tensor 1 MiB (a block each)."""

    def __init__(self, layers: int = 6, dim: int = 512) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU())
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.fixture
def small_arena(tmp_path):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    d = Daemon(rt, "16MiB", "4MiB").start()
    yield d
    mot.forget_offloader(d.runtime_dir)
    d.stop()


def _train(model, opt, steps, batches):
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=False)  # gradients kept: placed too, while they fit
        loss = model(batches[step])
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def test_state_gets_its_share_and_activations_the_rest(small_arena, caplog):
    d = small_arena
    caplog.set_level(logging.WARNING, logger="memoffload")
    torch.manual_seed(0)
    model = Stack()
    ref = clone_model(model)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
    assert state_bytes > ARENA / 2  # weights, gradients and two moments
    gen = torch.Generator().manual_seed(1)
    steps = 4
    batches = [torch.randn(64, 512, generator=gen) for _ in range(steps)]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    placement = mot.place_state(None, opt, runtime_dir=d.runtime_dir, job_id=JOB, min_bytes=4096)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=d.runtime_dir,
                                job_id=JOB)
    losses = _train(model, opt, steps, batches)
    handle.flush()

    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = _train(ref, opt_ref, steps, batches)
    assert all(bit_equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert bit_equal(p, q), name
        assert bit_equal(p.grad, q.grad), name
        for key, value in opt.state[p].items():
            assert bit_equal(value, opt_ref.state[q][key]), (name, key)

    # The state holds its share (1 MiB blocks: all of it), the rest is left.
    s = placement.stats()
    assert SHARE - MIB < s["held_bytes"] <= SHARE, s
    assert s["refused"] >= 1 and s["left_reasons"].get("RESOURCE_EXHAUSTED", 0) >= 1, s
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "place_state" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "quotas.state_share" in warnings[0], warnings[0]
    assert f"of its {SHARE // MIB}.00 MiB share" in warnings[0], warnings[0]

    # The daemon counts it as placed state, not as groups, in the job's
    # state session; the activations went to the job's activations session.
    status = d.status()
    assert status["state_bytes"] == s["held_bytes"] and status["state_blocks"] == s["tensors"], (
        status, s)
    mine = {x["kind"]: x for x in d.sessions() if x["job_id"] == JOB}
    assert sorted(mine) == ["activations", "state"], mine
    assert int(mine["state"]["held_bytes"]) == s["held_bytes"], mine
    assert int(mine["state"]["blocks"]) == s["tensors"] and int(mine["state"]["groups"]) == 0, mine

    # Activations were offloaded every step, none skipped for want of room.
    h = handle.stats()
    assert h["offloaded_bytes"] > 0 and h["skipped_bytes"] == 0, h
    assert h["prefetched_bytes"] == h["offloaded_bytes"], h
    handle.remove()
    placement.remove()


def test_max_bytes_caps_one_rank_below_the_share(small_arena, caplog):
    """place_state(max_bytes=) lowers what this rank places below the job's
    share: the session limit, named in the one WARNING."""
    d = small_arena
    caplog.set_level(logging.WARNING, logger="memoffload")
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    placement = mot.place_state(None, opt, runtime_dir=d.runtime_dir, job_id=JOB, min_bytes=4096,
                                max_bytes=3 * MIB)
    gen = torch.Generator().manual_seed(1)
    _train(model, opt, 2, [torch.randn(64, 512, generator=gen) for _ in range(2)])
    s = placement.stats()
    assert 2 * MIB < s["held_bytes"] <= 3 * MIB, s
    assert d.status()["state_bytes"] == s["held_bytes"]
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "place_state" in r.getMessage()]
    assert len(warnings) == 1 and "session limit" in warnings[0], warnings
    with pytest.raises(memoffload.InvalidArgument, match="max_bytes"):
        mot.place_state(None, opt, runtime_dir=d.runtime_dir, max_bytes=0)
    placement.remove()
