"""``memoffload.torch.place_state``: a rank's FSDP2 CPU-offloaded shards and
its optimizer's state in the node arena, against a real daemon.

Real FSDP2 on CPU (gloo, world size 2, mp.spawn, state_worker.py): AdamW and
an LR scheduler train a placed and an unplaced copy of the same model, bit
for bit equal after every step, with the daemon counting exactly what the
placement holds. In this process (no FSDP): a CPU optimizer's state
(ZeRO-offload style), a quota that refuses (training goes on, ``strict``
raises), no daemon, and a rank killed with its state in the arena.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import memoffload
import memoffload.torch as mot
import state_worker
from conftest import Daemon, bin_dir, free_port
from models import DecoderStack, tokens

WORLD_SIZE = 2
STEPS = 5
KINDS = ["fsdp2", "cpu", "fsdp2_keep_grads", "cpu_keep_grads", "fsdp2_keep_grads_resume",
         "cpu_keep_grads_resume"]
MIN_BYTES = 4096



@pytest.fixture(scope="module")
def runs(daemon, tmp_path_factory):
    assert dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo"
    out = tmp_path_factory.mktemp("state")
    job = f"state-{uuid.uuid4().hex[:8]}"
    mp.spawn(state_worker.run,
             args=(WORLD_SIZE, free_port(), KINDS, daemon.runtime_dir, str(bin_dir()), str(out),
                   job, STEPS, MIN_BYTES),
             nprocs=WORLD_SIZE)
    return job, {k: [json.loads((out / f"{k}-rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
                 for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_training_is_bit_identical_with_the_state_in_the_arena(runs, kind):
    _, results = runs
    for r in results[kind]:
        assert r["mismatches"] == [], r["mismatches"][:10]
        # Every optimizer state tensor of at least MIN_BYTES is in the arena
        # after the first step and stayed; AdamW's step scalars are not.
        assert r["states"] == 3 * r["params"], r
        assert 0 < r["big_states"] < 2 * r["params"] + 1, r
        assert r["states_held"] == r["big_states"], r
        assert r["final"]["left_reasons"].get("under min_bytes", 0) >= r["params"], r
        assert r["final"]["refused"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_stay_in_the_arena_only_when_the_trainer_keeps_them(runs, kind):
    _, results = runs
    for r in results[kind]:
        assert r["big_grads"] > 0, r
        if "_keep_grads" in kind:
            # zero_grad(set_to_none=False): placed once, then added into in place;
            # also after a resume (issue 42: DCP's get_state_dict on a fresh
            # optimizer dropped its dummy step's gradients, which stopped
            # gradient placement for the rest of the run).
            assert r["grads_held"] == r["big_grads"], r
            assert "gradients made anew each step" not in r["final"]["left_reasons"], r
        else:
            # set_to_none=True makes them anew: seen so at the second step, never copied.
            assert r["grads_held"] == 0, r
            assert r["final"]["left_reasons"].get("gradients made anew each step", 0) == 1, r


def test_fsdp2_shards_are_placed_before_the_first_step_and_stay(runs):
    _, results = runs
    for r in results["fsdp2"]:
        assert r["params_held_before"] == r["big_params"] > 0, r
        assert r["params_held"] == r["big_params"], r
        assert r["placed_before_step"]["tensors"] == r["big_params"]
        # Optimizer state (AdamW: exp_avg, exp_avg_sq) came with the first
        # step; gradients, when kept, only from the second.
        assert r["placed_after_step"]["tensors"] == r["big_params"] + r["big_states"], r
    # The plain CPU model's parameters stay where they are (no FSDP2).
    for r in results["cpu"]:
        assert r["params_held"] == 0 and r["placed_before_step"]["tensors"] == 0


def test_the_daemon_counts_exactly_what_is_placed(runs):
    job, results = runs
    for kind in KINDS:
        rank0 = results[kind][0]
        mine = [s for s in rank0["sessions"] if s["job_id"] == job]
        by_rank = {int(s["rank"]): s for s in mine}
        assert sorted(by_rank) == [0, 1], mine
        for r in results[kind]:
            f = r["final"]
            assert int(by_rank[r["rank"]]["held_bytes"]) == f["held_bytes"], (kind, by_rank, f)
            # Exact but for the page rounding of each tensor.
            assert f["bytes"] <= f["held_bytes"] < f["bytes"] + f["tensors"] * 4096
        # What the two placements hold is what the daemon holds as committed.
        assert rank0["status_committed"] == sum(r["final"]["held_bytes"] for r in results[kind])
        assert rank0["status_after"]["used_bytes"] == 0, rank0["status_after"]


def test_an_untested_torch_is_refused_not_patched(runs):
    _, results = runs
    msg = results["fsdp2"][0]["untested_refusal"]
    assert msg is not None and msg.startswith("FAILED_PRECONDITION"), msg
    assert "tested with torch" in msg and torch.__version__ in msg


@pytest.mark.gpu
def test_fsdp2_on_a_gpu_trains_the_same_from_registered_arena_shards(own_daemon, tmp_path):
    """FSDP2 over NCCL with CPUOffloadPolicy(pin_memory=True), one rank: the
    placed shards are CUDA-registered (is_pinned), training is bit-identical."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    job = f"state-gpu-{uuid.uuid4().hex[:8]}"
    mp.spawn(state_worker.run,
             args=(1, free_port(), ["fsdp2"], own_daemon.runtime_dir, str(bin_dir()),
                   str(tmp_path), job, STEPS, MIN_BYTES, "cuda"),
             nprocs=1)
    r = json.loads((tmp_path / "fsdp2-rank0.json").read_text())
    assert r["mismatches"] == [], r["mismatches"][:10]
    assert r["params_held"] == r["big_params"] > 0, r
    assert r["params_pinned"] == r["params_held"], r
    assert r["final"]["unpinned_bytes"] == 0, r["final"]


# ---- in this process: a CPU optimizer's state, no FSDP ----


def _train_cpu(placement_args=None, steps=3):
    """A plain CPU model and AdamW; with placement_args, place_state on it."""
    torch.manual_seed(0)
    model = DecoderStack(layers=1, dim=128, heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    placement = mot.place_state(None, opt, **placement_args) if placement_args is not None else None
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(tokens(batch=2, length=16))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, placement, losses


@pytest.fixture
def small_quota_daemon(tmp_path):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    d = Daemon(rt, "64MiB", "16MiB", ["--session-max-bytes=256KiB"]).start()
    yield d
    d.stop()


def test_a_quota_refusal_is_said_once_and_training_goes_on(small_quota_daemon, caplog):
    d = small_quota_daemon
    caplog.set_level(logging.WARNING, logger="memoffload")
    _, opt, placement, losses = _train_cpu({"runtime_dir": d.runtime_dir, "min_bytes": 4096})
    _, _, _, ref_losses = _train_cpu()
    assert losses == ref_losses
    s = placement.stats()
    assert s["refused"] >= 1 and s["left_reasons"].get("RESOURCE_EXHAUSTED", 0) >= 1, s
    assert 0 < s["held_bytes"] <= 256 * 1024, s
    warnings = [r.getMessage() for r in caplog.records if "place_state" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "session limit" in warnings[0], warnings[0]
    with pytest.raises(memoffload.ResourceExhausted, match="session limit"):
        _train_cpu({"runtime_dir": d.runtime_dir, "min_bytes": 4096, "strict": True}, steps=1)


def test_it_says_what_it_placed_and_what_it_left_and_why(daemon, caplog):
    """Issue 39: place_state(model, opt) on a model that is not FSDP2 with
    CPUOffloadPolicy placed nothing of the model and said nothing. One INFO
    line at the start and one after the optimizer's first step (which makes
    its state) say what is in the arena and what stays in torch's memory,
    and why; later steps say nothing more."""
    caplog.set_level(logging.INFO, logger="memoffload")
    torch.manual_seed(0)
    model = DecoderStack(layers=1, dim=128, heads=4)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    placement = mot.place_state(model, opt, runtime_dir=daemon.runtime_dir, job_id="told",
                                min_bytes=4096)
    for _ in range(3):
        opt.zero_grad()
        model(tokens(batch=2, length=16)).backward()
        opt.step()
    told = [r for r in caplog.records if r.getMessage().startswith("place_state ")]
    assert [r.levelno for r in told] == [logging.INFO, logging.INFO], [r.getMessage() for r in told]
    start, after = (r.getMessage() for r in told)
    assert start.startswith("place_state at the start: 0 tensors (0.0 MiB) in the arena (session "), start
    n = len(list(model.parameters()))
    assert f"model not FSDP2 with CPUOffloadPolicy: {n} ({params * 4 / 2**20:.1f} MiB)" in start, start
    placed = placement.stats()["tensors"]
    assert placed > 0
    assert after.startswith(f"place_state after the optimizer's first step: {placed} tensors"), after
    assert "under min_bytes:" in after, after  # AdamW's step scalars
    s = placement.stats()
    assert s["left_reasons"]["model not FSDP2 with CPUOffloadPolicy"] == n, s


def test_without_a_daemon_it_says_so_and_strict_raises(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="memoffload")
    missing = tmp_path / "none"
    missing.mkdir(mode=0o700)
    _, _, placement, losses = _train_cpu({"runtime_dir": str(missing)})
    _, _, _, ref_losses = _train_cpu()
    assert losses == ref_losses
    s = placement.stats()
    assert s["tensors"] == 0 and s["session_id"] is None and s["left_reasons"]["no daemon"] > 0, s
    assert any("no memoffloadd session" in r.getMessage() for r in caplog.records)
    with pytest.raises(memoffload.Unavailable):
        mot.place_state(runtime_dir=str(missing), strict=True)


def _train_conv(fused, runtime_dir=None, steps=3):
    """A channels_last conv (its AdamW states are channels_last too) and
    AdamW, with place_state when runtime_dir is given."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(32, 32, 3).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    placement = (mot.place_state(None, opt, runtime_dir=runtime_dir, job_id="conv", min_bytes=4096)
                 if runtime_dir is not None else None)
    x = torch.randn(2, 32, 8, 8).to(memory_format=torch.channels_last)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    return model, opt, placement


@pytest.mark.parametrize("fused", [False, True])
def test_a_placed_state_keeps_its_layout(daemon, fused):
    """AdamW(fused=True) walks a parameter and its states as flat memory: a
    channels_last parameter's exp_avg placed contiguous trained wrongly."""
    ref, ref_opt, _ = _train_conv(fused)
    model, opt, placement = _train_conv(fused, daemon.runtime_dir)
    st = opt.state[model.weight]
    assert placement.holds(st["exp_avg"]) and placement.holds(st["exp_avg_sq"])
    assert st["exp_avg"].stride() == ref_opt.state[ref.weight]["exp_avg"].stride()
    assert torch.equal(model.weight, ref.weight)
    assert torch.equal(st["exp_avg_sq"], ref_opt.state[ref.weight]["exp_avg_sq"])


def test_state_replaced_by_load_state_dict_is_placed_again(daemon):
    """The state tensors optimizer.load_state_dict makes (a resume) are
    placed at the next step, also those that reuse a dead tensor's id."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    placement = mot.place_state(None, opt, runtime_dir=daemon.runtime_dir, job_id="reload",
                                min_bytes=4096)

    def big_states():
        return [v for st in opt.state.values() for k, v in st.items()
                if k != "step" and v.numel() * v.element_size() >= 4096]

    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        assert len(big_states()) == 16 and all(placement.holds(v) for v in big_states())
        sd = opt.state_dict()
        opt.load_state_dict({"state": {k: {kk: vv.clone() for kk, vv in v.items()}
                                       for k, v in sd["state"].items()},
                             "param_groups": sd["param_groups"]})
        del sd
    # Until the next step the loaded state is torch's; the placed one died.
    assert placement.stats()["tensors"] == 0, placement.stats()


KILLED = """
import sys, torch, memoffload.torch as mot
torch.manual_seed(0)
model = torch.nn.Linear(512, 512)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
placement = mot.place_state(None, opt, runtime_dir=sys.argv[1], job_id="killed")
model(torch.randn(4, 512)).sum().backward()
opt.step()
print(placement.stats()["held_bytes"], flush=True)
sys.stdin.read()
"""


def test_a_killed_rank_s_state_is_freed_within_a_second(own_daemon):
    d = own_daemon
    proc = subprocess.Popen([sys.executable, "-c", KILLED, d.runtime_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        held = int(proc.stdout.readline())
        assert held >= 2 * 512 * 512 * 4  # exp_avg and exp_avg_sq of the weight
        assert d.status()["committed_bytes"] >= held
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 1.0
        while d.status()["used_bytes"] != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.status()["used_bytes"] == 0, d.status()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
