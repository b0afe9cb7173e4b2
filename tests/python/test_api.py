"""The options a new user asks for (enabled, select, offload_weights,
refusal of double wrapping, strict, per-step and per-handle stats, typed
stats) and the errors that carry the daemon's status code."""

from __future__ import annotations

import subprocess
import sys
import time
import typing

import pytest
import torch
from torch import nn

import memoffload
import memoffload.torch as mot
from conftest import assert_arena_empty, assert_same_grads, clone_model, step_both
from models import DecoderStack, tokens


def test_import_memoffload_does_not_import_torch():
    code = (
        "import sys, memoffload\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "e = memoffload.ResourceExhausted('full')\n"
        "assert isinstance(e, memoffload.Error) and isinstance(e, RuntimeError)\n"
        "assert e.code == memoffload.StatusCode.RESOURCE_EXHAUSTED == 8\n"
        "assert e.code.name == 'RESOURCE_EXHAUSTED'\n"
        "assert isinstance(memoffload.InvalidArgument('x'), ValueError)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_status_code_has_its_class():
    for code in memoffload.StatusCode:
        if code == memoffload.StatusCode.OK:
            continue
        err = memoffload.error_from_status(int(code), "m")
        assert err.code == code
        assert type(err) is not memoffload.Error  # a subclass per code
        assert err.message == "m"


def test_unreachable_daemon_raises_unavailable(tmp_path):
    with pytest.raises(memoffload.Unavailable) as raised:
        mot.daemon_status(str(tmp_path / "nobody-home"), timeout_ms=500)
    assert raised.value.code == memoffload.StatusCode.UNAVAILABLE
    assert int(raised.value.code) == 14


def test_native_errors_carry_codes(daemon):
    off = mot.get_offloader(daemon.runtime_dir)
    with pytest.raises(memoffload.FailedPrecondition) as raised:
        off.close_group(7_000_001)  # never opened
    assert raised.value.code == memoffload.StatusCode.FAILED_PRECONDITION
    off.begin_group(7_000_002, -1)
    with pytest.raises(memoffload.InvalidArgument) as raised:
        off.begin_group(7_000_002, -1)  # key in use
    assert isinstance(raised.value, ValueError)
    assert raised.value.code == memoffload.StatusCode.INVALID_ARGUMENT
    off.close_group(7_000_002)
    off.release_group(7_000_002)
    with pytest.raises(memoffload.NotFound) as raised:
        off.get(7_000_002, 0)
    assert raised.value.code == memoffload.StatusCode.NOT_FOUND
    del raised
    assert_arena_empty(daemon, off)


def test_stats_have_typed_last_skip_code(tiny_daemon):
    off = mot.get_offloader(tiny_daemon.runtime_dir)
    assert off.stats()["last_skip_code"] == memoffload.StatusCode.OK
    with mot.offload_activations(runtime_dir=tiny_daemon.runtime_dir):
        x = torch.randn(2 << 20, requires_grad=True)  # 8 MiB into a 4 MiB arena
        y = (x * 1.0).sin()
    y.sum().backward()
    off.flush()
    s = off.stats()
    assert isinstance(s["last_skip_code"], memoffload.StatusCode)
    assert s["last_skip_code"] == memoffload.StatusCode.RESOURCE_EXHAUSTED
    assert s["internal_errors"] == 0  # no background task threw
    assert_arena_empty(tiny_daemon, off)


def test_enabled_false_is_a_no_op(own_daemon):
    torch.manual_seed(30)
    model = DecoderStack(layers=3)
    ref = clone_model(model)
    handle = mot.offload_layers(
        model.layers, min_tensor_bytes=0, runtime_dir=own_daemon.runtime_dir, enabled=False
    )
    assert not handle.enabled
    step_both(model, ref, tokens())
    s = handle.stats()
    # The layers are wrapped even so (under torch.compile the graphs must not
    # depend on whether offload is on), and remove() unwraps them.
    handle.remove()
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    assert s["offloaded_bytes"] == 0 and s["handle"]["groups"] == 0
    assert own_daemon.status()["sessions"] == 0  # no attach at all
    with mot.offload_activations(runtime_dir=own_daemon.runtime_dir, enabled=False):
        y = torch.randn(64, 64, requires_grad=True).exp()
    y.sum().backward()
    assert own_daemon.status()["sessions"] == 0


@pytest.mark.parametrize(
    "select", [[0, 2], lambda i, layer: i % 2 == 0, "modules"], ids=["indices", "predicate", "modules"]
)
def test_select_layers(daemon, select):
    torch.manual_seed(31)
    model = DecoderStack(layers=4)
    ref = clone_model(model)
    if select == "modules":
        select = [model.layers[0], model.layers[2]]
    handle = mot.offload_layers(
        model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir, select=select
    )
    for _ in range(2):
        step_both(model, ref, tokens())
    handle.flush()
    own = handle.stats()["handle"]
    handle.remove()
    assert own["groups"] == own["groups_offloaded"] == 2 * 2  # layers 0 and 2, two steps
    assert own["offloaded_bytes"] > 0
    assert_arena_empty(daemon)


def test_select_errors(daemon):
    model = DecoderStack(layers=3)
    with pytest.raises(memoffload.InvalidArgument):
        mot.offload_layers(model.layers, num_layers=1, select=[0], runtime_dir=daemon.runtime_dir)
    with pytest.raises(memoffload.InvalidArgument):
        mot.offload_layers(model.layers, select=[5], runtime_dir=daemon.runtime_dir)
    with pytest.raises(memoffload.InvalidArgument):
        mot.offload_layers(model.layers, select=[nn.Linear(2, 2)], runtime_dir=daemon.runtime_dir)
    assert all("forward" not in layer.__dict__ for layer in model.layers)


def test_second_offload_layers_on_same_layers_is_refused(daemon):
    torch.manual_seed(32)
    model = DecoderStack(layers=3)
    ref = clone_model(model)
    first = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    with pytest.raises(memoffload.FailedPrecondition) as raised:
        mot.offload_layers(model.layers[1:], runtime_dir=daemon.runtime_dir)
    assert raised.value.code == memoffload.StatusCode.FAILED_PRECONDITION
    # The model's layer by its qualified name, not its index in the slice.
    assert "layer layers.1 (DecoderBlock) is already wrapped" in str(raised.value), raised.value
    with pytest.raises(memoffload.InvalidArgument) as raised:
        twice = MLP(8, 8)
        mot.offload_layers([twice, twice], runtime_dir=daemon.runtime_dir)
    assert "layer 1 of the layers passed (MLP) appears twice" in str(raised.value), raised.value
    step_both(model, ref, tokens())
    first.flush()
    assert first.stats()["handle"]["groups"] == 2  # wrapped once: one group per layer
    first.remove()
    again = mot.offload_layers(model.layers, runtime_dir=daemon.runtime_dir)  # after remove: fine
    again.remove()
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    assert_arena_empty(daemon)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("offload_weights", [False, True])
def test_autocast_weight_copies_stay_unless_asked(daemon, offload_weights):
    """Under bf16 autocast each Linear saves a bf16 copy of its weight: with
    offload_weights=False (the default) none of them goes to the arena."""
    torch.manual_seed(33)
    batch, dim, hidden = 48, 80, 112
    model = nn.Sequential(*[MLP(dim, hidden) for _ in range(3)])
    ref = clone_model(model)
    handle = mot.offload_layers(
        list(model), num_layers=3, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir,
        offload_weights=offload_weights,
    )
    x = torch.randn(batch, dim, requires_grad=True)  # so layer 0 saves up's weight too
    x_ref = x.detach().clone().requires_grad_()
    for m, inp in ((model, x), (ref, x_ref)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(inp).float().pow(2).mean()
        loss.backward()
    handle.flush()
    s = handle.stats()
    handle.remove()
    assert_same_grads(model, ref)
    assert torch.equal(x.grad, x_ref.grad)
    # Per layer, bf16: the input copy (batch x dim), the relu output saved by
    # relu and by down (one storage: batch x hidden), and the bf16 copies of
    # up's and down's weights (transposed views of them).
    activations = 3 * 2 * (batch * dim + batch * hidden)
    weights = 3 * 2 * (hidden * dim + dim * hidden)
    offloaded = s["handle"]["offloaded_bytes"]
    if offload_weights:
        assert offloaded == activations + weights
        assert s["kept_weight_copy_bytes"] == 0
    else:
        assert offloaded == activations
        assert s["kept_weight_copy_bytes"] == weights
    assert_arena_empty(daemon)


def test_strict_raises_without_daemon(tmp_path):
    runtime_dir = str(tmp_path / "nobody-home")
    model = DecoderStack(layers=3)
    try:
        with pytest.raises(memoffload.Unavailable) as raised:
            mot.offload_layers(model.layers, runtime_dir=runtime_dir, strict=True)
        assert raised.value.code == memoffload.StatusCode.UNAVAILABLE
        assert all("forward" not in layer.__dict__ for layer in model.layers)
    finally:
        mot.forget_offloader(runtime_dir)


def test_strict_raises_once_daemon_is_gone(own_daemon):
    torch.manual_seed(34)
    model = DecoderStack(layers=3)
    handle = mot.offload_layers(
        model.layers, min_tensor_bytes=0, runtime_dir=own_daemon.runtime_dir, strict=True
    )
    model(tokens()).backward()  # fine while the daemon is there
    handle.flush()
    own_daemon.kill()
    with pytest.raises(memoffload.Unavailable) as raised:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the worker notices at its next RPC
            model(tokens()).backward()
            handle.flush()
    assert raised.value.code == memoffload.StatusCode.UNAVAILABLE
    del raised
    handle.remove()


def test_step_stats_and_per_handle_stats(daemon):
    torch.manual_seed(35)
    a, b = DecoderStack(layers=3), DecoderStack(layers=4)
    ha = mot.offload_layers(a.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    hb = mot.offload_layers(b.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    ha.step_stats()
    hb.step_stats()
    rows = []
    for step in range(3):
        a(tokens()).backward()
        if step != 1:
            b(tokens()).backward()
        ha.flush()
        rows.append((ha.step_stats(), hb.step_stats()))
    ha.remove()
    hb.remove()
    for step, (da, db) in enumerate(rows):
        assert da["steps"] == 1 and da["handle"]["groups_offloaded"] == 2
        assert da["handle"]["prefetched_bytes"] == da["handle"]["offloaded_bytes"] > 0
        if step == 1:  # b did not run: its handle saw nothing, the process did
            assert db["steps"] == 0 and db["handle"]["offloaded_bytes"] == 0
            assert db["offloaded_bytes"] == da["handle"]["offloaded_bytes"]
        else:
            assert db["steps"] == 1 and db["handle"]["groups_offloaded"] == 3
            # process-wide: both handles' bytes
            assert da["offloaded_bytes"] == (
                da["handle"]["offloaded_bytes"] + db["handle"]["offloaded_bytes"]
            )
    # Same shapes every step: the same bytes per step.
    assert rows[0][0]["handle"]["offloaded_bytes"] == rows[2][0]["handle"]["offloaded_bytes"]
    assert_arena_empty(daemon)


def assert_shape(d: dict, shape) -> None:
    """`d` has exactly the keys of the TypedDict `shape`, each of its type."""
    hints = typing.get_type_hints(shape)
    assert sorted(d) == sorted(hints), set(d) ^ set(hints)
    for name, kind in hints.items():
        if typing.is_typeddict(kind):
            assert_shape(d[name], kind)
        else:
            assert type(d[name]) is kind, (name, d[name], kind)


def test_stats_match_their_typed_dicts(daemon):
    """stats() and step_stats() are HandleStats (and ["handle"] GroupStats),
    offload_activations.stats() is OffloadStats: the same keys and types
    whether offload is on or off (before: untyped, and a disabled handle's
    dict lacked blocking_rpcs, arena and copy counters, engine, ...)."""
    torch.manual_seed(36)
    model = DecoderStack(layers=3)
    for enabled in (True, False):
        handle = mot.offload_layers(model.layers, min_tensor_bytes=0,
                                    runtime_dir=daemon.runtime_dir, enabled=enabled)
        model(tokens()).backward()
        assert_shape(handle.stats(), mot.HandleStats)
        assert_shape(handle.step_stats(), mot.HandleStats)
        handle.remove()
        with mot.offload_activations(runtime_dir=daemon.runtime_dir, enabled=enabled) as block:
            loss = model(tokens())
        loss.backward()
        assert_shape(block.stats(), mot.OffloadStats)
    assert_arena_empty(daemon)


def test_first_step_stats_counts_from_the_handle(daemon):
    """step_stats() before any call counts since the handle was made, at the
    process level too (before: its first call returned the process's
    cumulative counters, everything earlier handles had moved)."""
    torch.manual_seed(37)
    first, second = DecoderStack(layers=3), DecoderStack(layers=3)
    h1 = mot.offload_layers(first.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    first(tokens()).backward()
    h1.flush()
    h1.remove()
    h2 = mot.offload_layers(second.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    second(tokens()).backward()
    h2.flush()
    d = h2.step_stats()
    h2.remove()
    assert d["offloaded_bytes"] == d["handle"]["offloaded_bytes"] > 0, d
    assert d["prefetched_bytes"] == d["handle"]["prefetched_bytes"], d
    assert d["groups"] == d["handle"]["groups"] == 2, d
    assert_arena_empty(daemon)
