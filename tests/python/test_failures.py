"""Failure behaviour: the daemon dies mid-step, the arena is too small, the
daemon is absent. Training goes on with exact gradients in every case."""

from __future__ import annotations

import logging
import time

import torch

import memoffload.torch as mot
from memoffload import StatusCode
from conftest import assert_arena_empty, clone_model, step_both
from models import DecoderStack, tokens


def test_daemon_killed_mid_step(own_daemon):
    torch.manual_seed(0)
    model = DecoderStack(layers=5)
    ref = clone_model(model)
    handle = mot.offload_layers(
        model.layers, min_tensor_bytes=0, runtime_dir=own_daemon.runtime_dir
    )
    step_both(model, ref, tokens())  # step 1: normal
    kill = {"armed": True}

    def killer(module, args, out):
        if kill["armed"]:
            kill["armed"] = False
            handle.flush()  # groups 0..2 are committed in the arena
            own_daemon.kill()

    hook = model.layers[2].register_forward_hook(killer)
    before = handle.stats()
    step_both(model, ref, tokens())  # daemon killed after layer 2's forward
    s = handle.stats()
    assert s["prefetched_bytes"] > before["prefetched_bytes"]  # read back from the mapping
    assert s["skipped_bytes"] > before["skipped_bytes"]  # later groups stayed in memory
    assert s["last_skip_code"] == StatusCode.UNAVAILABLE
    assert not s["connected"]
    step_both(model, ref, tokens())  # without a daemon
    hook.remove()

    # The daemon comes back in the same runtime dir: a new session is attached.
    own_daemon.start()
    time.sleep(1.1)  # the reconnect interval
    before = handle.stats()
    step_both(model, ref, tokens())
    step_both(model, ref, tokens())
    s = handle.stats()
    handle.remove()
    assert s["reconnects"] == before["reconnects"] + 1
    assert s["connected"]
    assert s["offloaded_bytes"] > before["offloaded_bytes"]
    assert_arena_empty(own_daemon)


def test_arena_too_small_for_a_group(tiny_daemon):
    """4 MiB arena: the layer with a 6 MiB activation is skipped, the small
    layers are offloaded, gradients are exact."""

    class Wide(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.up = torch.nn.Linear(64, width)
            self.down = torch.nn.Linear(width, 64)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(1)
    layers = torch.nn.Sequential(Wide(64), Wide(6144), Wide(64), Wide(64))
    ref = clone_model(layers)
    handle = mot.offload_layers(
        list(layers), num_layers=4, min_tensor_bytes=0, runtime_dir=tiny_daemon.runtime_dir
    )
    for _ in range(2):
        step_both(layers, ref, torch.randn(256, 64), lambda m, x: m(x).pow(2).mean())
    s = handle.stats()
    handle.remove()
    assert s["skipped_bytes"] >= 2 * 256 * 6144 * 4
    assert s["offloaded_bytes"] > 0  # the small layers went through the arena
    assert s["groups_skipped"] >= 2
    assert s["last_skip_code"] == StatusCode.RESOURCE_EXHAUSTED
    assert_arena_empty(tiny_daemon)


def test_no_daemon_at_all(tmp_path):
    runtime_dir = str(tmp_path / "nobody-home")
    torch.manual_seed(2)
    model = DecoderStack(layers=3)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=runtime_dir)
    step_both(model, ref, tokens())
    s = handle.stats()
    handle.remove()
    mot.forget_offloader(runtime_dir)
    assert s["offloaded_bytes"] == 0 and s["skipped_bytes"] > 0
    assert not s["connected"]


def memoffload_records(caplog):
    return [r for r in caplog.records if r.name == "memoffload"]


def test_failure_logged_once_but_counted(tmp_path, capfd, caplog, monkeypatch):
    """Two steps without a daemon, a reconnect attempt between them: one
    record on the "memoffload" logger (with the rank and the code), nothing
    on bare stderr, every failure counted."""
    monkeypatch.setenv("RANK", "3")
    caplog.set_level(logging.INFO, logger="memoffload")
    runtime_dir = str(tmp_path / "nobody-home")
    torch.manual_seed(3)
    model = DecoderStack(layers=3)
    ref = clone_model(model)
    capfd.readouterr()
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=runtime_dir)
    step_both(model, ref, tokens())
    first = handle.stats()
    time.sleep(1.1)  # past the reconnect interval: the next step tries again
    step_both(model, ref, tokens())
    handle.flush()
    s = handle.stats()
    handle.remove()
    mot.forget_offloader(runtime_dir)
    err = capfd.readouterr().err
    assert "memoffload" not in err, err
    records = memoffload_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.WARNING
    assert records[0].code == StatusCode.UNAVAILABLE
    assert records[0].rank == 3
    assert s["last_skip_code"] == StatusCode.UNAVAILABLE
    assert s["rpc_errors"] > first["rpc_errors"] >= 1  # the second attempt failed too
    assert s["skipped_bytes"] > first["skipped_bytes"] > 0


def test_tensor_without_copy_engine_is_kept_and_counted(daemon, caplog):
    """A tensor on a device no engine handles (here: meta; on a machine
    without the CUDA engine: CUDA tensors) stays where it is, counted in
    skipped_bytes, logged once; it never raises inside a forward."""
    off = mot.get_offloader(daemon.runtime_dir)
    before = off.stats()
    caplog.set_level(logging.INFO, logger="memoffload")
    for key in (6_000_001, 6_000_002):
        # min_tensor_bytes: not the 0-dim scalars `* 2` and `* 1` save.
        with mot.offload_activations(min_tensor_bytes=1024, runtime_dir=daemon.runtime_dir) as ctx:
            x = torch.empty(64, 64, device="meta", requires_grad=True)
            h = x * 2
            y = h * h  # saves h twice: one storage
            c = torch.randn(64, 64, requires_grad=True) * 1  # a CPU one goes through
            z = c * c
        z.sum().backward()
        del y, h, x, z, c, ctx
    off.flush()
    s = off.stats()
    mot.logs.forward(mot._C)
    assert s["skipped_bytes"] - before["skipped_bytes"] == 2 * 64 * 64 * 4
    assert s["offloaded_bytes"] - before["offloaded_bytes"] == 2 * 64 * 64 * 4
    # No engine for the device: the tensor cannot reach the arena.
    assert s["last_skip_code"] == StatusCode.UNAVAILABLE
    records = [r for r in memoffload_records(caplog) if r.code == StatusCode.UNAVAILABLE]
    assert len(records) == 1, [r.getMessage() for r in memoffload_records(caplog)]
    assert_arena_empty(daemon)


def _restart(d) -> None:
    """The daemon dies and a new instance starts on the same runtime dir,
    while the trainer makes no call."""
    d.kill()
    d.start()


def test_daemon_restarted_between_steps(own_daemon, caplog, capfd):
    """Restart between two steps: the next step's first call finds its
    session gone (UNAVAILABLE), the client attaches again, and offload goes
    on in the same run; `connected` and `reconnects` say so, and the
    "memoffload" logger (not bare stderr) names the restarted daemon (by its
    runtime dir) once."""
    caplog.set_level(logging.INFO, logger="memoffload")
    capfd.readouterr()
    torch.manual_seed(0)
    model = DecoderStack(layers=4)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=own_daemon.runtime_dir)
    step_both(model, ref, tokens())
    step_both(model, ref, tokens())
    handle.flush()
    before = handle.stats()
    assert before["connected"]
    first = "\n".join(r.getMessage() for r in memoffload_records(caplog))
    caplog.clear()
    # This process attached to other daemons before (the shared fixtures):
    # none of that is reported as a restart of this one.
    assert "(was " not in first, first
    assert "memoffloadd instance" in first and str(own_daemon.runtime_dir) in first, first
    _restart(own_daemon)
    time.sleep(1.1)  # the reconnect interval
    for _ in range(3):
        step_both(model, ref, tokens())  # never raises, gradients exact
    handle.flush()
    s = handle.stats()
    assert s["reconnects"] == before["reconnects"] + 1, s
    assert s["connected"], s
    # Offloaded again on the new instance (not everything skipped).
    assert own_daemon.status()["sessions"] >= 1
    after_reconnect = handle.stats()
    step_both(model, ref, tokens())
    handle.flush()
    assert handle.stats()["offloaded_bytes"] > after_reconnect["offloaded_bytes"]
    handle.remove()
    assert_arena_empty(own_daemon)
    restarted = [r for r in memoffload_records(caplog) if "(was " in r.getMessage()]
    assert len(restarted) == 1 and str(own_daemon.runtime_dir) in restarted[0].getMessage(), restarted
    assert restarted[0].levelno == logging.WARNING
    err = capfd.readouterr().err
    assert "memoffload" not in err, err


def test_daemon_restarted_between_forward_and_backward(own_daemon):
    """Restart after forward, before backward: backward reads the committed
    groups from the process's own mapping; gradients are bit-identical and
    the next steps offload to the new instance."""
    torch.manual_seed(0)
    model = DecoderStack(layers=4)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=own_daemon.runtime_dir)
    step_both(model, ref, tokens())  # sizes learned
    for m in (model, ref):
        for p in m.parameters():
            p.grad = None
    batch = tokens()
    loss = model(batch)
    handle.flush()  # every group committed in the arena
    before = handle.stats()
    _restart(own_daemon)
    loss.backward()  # must not raise
    loss_ref = ref(batch)
    loss_ref.backward()
    assert torch.equal(loss.detach().view(-1).view(torch.uint8), loss_ref.detach().view(-1).view(torch.uint8))
    for (name, pa), pb in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(pa.grad.view(-1).view(torch.uint8), pb.grad.view(-1).view(torch.uint8)), name
    s = handle.stats()
    assert s["prefetched_bytes"] > before["prefetched_bytes"], s  # read back from the mapping
    time.sleep(1.1)  # the reconnect interval
    for _ in range(2):
        step_both(model, ref, tokens())
    handle.flush()
    s = handle.stats()
    assert s["reconnects"] == before["reconnects"] + 1, s
    assert s["connected"], s
    assert s["offloaded_bytes"] > before["offloaded_bytes"], s
    handle.remove()
    assert_arena_empty(own_daemon)
