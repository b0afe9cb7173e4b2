"""A forward whose graph is dropped without backward (issue 30, item 1).

A skipped step (NaN loss, Lightning's training_step returning None), an
exception between forward and backward, or an eval pass with grad enabled
drops the autograd graph without running backward. Its offloaded groups must
go back to the arena as the graph dies, whatever `min_tensor_bytes`, by
reference counting alone: with the garbage collector off as well as on.

The models keep small saved *outputs* in place (LayerNorm's mean and rstd,
RMSNorm's rsqrt: below the default 16 KiB): a pack hook that returned those
as they are made a cycle through the autograd graph that the garbage
collector cannot see, and the arena leaked every group of such a forward.
"""

from __future__ import annotations

import gc
from typing import Iterator

import pytest
import torch
from torch import nn

import memoffload.torch as mot
from conftest import assert_arena_empty, clone_model, step_both
from models import DecoderStack, tokens

MIN_BYTES = [mot.DEFAULT_MIN_TENSOR_BYTES, 1 << 20, 0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # rsqrt saves its output: a small kept-in-place saved output.
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RMSBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


class RMSStack(nn.Module):
    """A Llama-like stack (RMSNorm + MLP). With `batch()`, every layer saves
    tensors of 2 MiB (offloaded whatever MIN_BYTES) and a small saved output
    (rsqrt's, 4 KiB: kept in place but with min_tensor_bytes=0)."""

    def __init__(self, layers: int = 4, dim: int = 128) -> None:
        super().__init__()
        self.layers = nn.ModuleList(RMSBlock(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def batch() -> torch.Tensor:
    return torch.randn(4, 256, 128)


@pytest.fixture
def d(own_daemon):
    """A daemon per test: what one test leaks does not fail the next."""
    return own_daemon


@pytest.fixture(params=["gc", "no_gc"])
def gc_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test with the garbage collector on, and off: the groups must
    go back by reference counting alone."""
    was_enabled = gc.isenabled()
    if request.param == "no_gc":
        gc.disable()
    try:
        yield request.param
    finally:
        if was_enabled:
            gc.enable()


def handle_live(handle: mot.OffloadHandle) -> int:
    handle.flush()
    return handle.stats()["handle"]["groups_live"]


def assert_held(daemon, handle: mot.OffloadHandle, groups: int) -> None:
    """Between forward and drop: the groups are in the arena and the handle
    counts them as live (so an arena left empty after the drop means they
    were released, not that they never got there)."""
    assert handle_live(handle) == groups
    assert daemon.status()["groups"] == groups, daemon.status()


@pytest.mark.parametrize("min_bytes", MIN_BYTES)
def test_skipped_backward_releases_groups(d, gc_mode, min_bytes):
    torch.manual_seed(0)
    model = RMSStack(layers=4)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=min_bytes, runtime_dir=d.runtime_dir)
    try:
        for _ in range(3):  # three skipped steps (e.g. a NaN loss each)
            loss = model(batch())
            assert_held(d, handle, 3)  # all layers but the last
            del loss
            assert_arena_empty(d)
            assert handle_live(handle) == 0
        # A step that does run backward afterwards is still exact.
        step_both(model, ref, batch())
        assert handle_live(handle) == 0
        assert_arena_empty(d)
    finally:
        handle.remove()


@pytest.mark.parametrize("min_bytes", MIN_BYTES)
def test_decoder_stack_skipped_backward(d, gc_mode, min_bytes):
    """nn.LayerNorm's saved mean and rstd are not differentiable outputs;
    softmax's saved output is (256 KiB here: in place with 1 MiB), and the
    MLP's 1 MiB activations are offloaded whatever `min_bytes`."""
    torch.manual_seed(1)
    model = DecoderStack(layers=4, dim=256)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=min_bytes, runtime_dir=d.runtime_dir)
    try:
        for _ in range(2):
            loss = model(tokens(length=64))
            assert_held(d, handle, 3)
            del loss
            assert_arena_empty(d)
            assert handle_live(handle) == 0
        step_both(model, ref, tokens(length=64))
        assert_arena_empty(d)
    finally:
        handle.remove()


class Skip(Exception):
    pass


def forward_then_raise(model: nn.Module) -> None:
    loss = model(batch())
    if loss is not None:  # e.g. a check of the loss, or a collective, fails
        raise Skip("between forward and backward")


def test_exception_between_forward_and_backward(d, gc_mode):
    torch.manual_seed(2)
    model = RMSStack(layers=4)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, runtime_dir=d.runtime_dir)
    try:
        for _ in range(2):
            with pytest.raises(Skip):
                forward_then_raise(model)
            # The traceback (and the frame holding the loss) is gone here.
            handle.flush()  # the copies (and their counts) are the worker's
            assert handle.stats()["handle"]["groups_offloaded"] > 0
            assert_arena_empty(d)
            assert handle_live(handle) == 0
        step_both(model, ref, batch())
        assert_arena_empty(d)
    finally:
        handle.remove()


def test_eval_with_grad_enabled(d, gc_mode):
    torch.manual_seed(3)
    model = RMSStack(layers=4)
    handle = mot.offload_layers(model.layers, runtime_dir=d.runtime_dir)
    try:
        model.eval()
        total = 0.0
        for _ in range(3):  # an eval loop that forgot torch.no_grad()
            loss = model(batch())
            assert loss.requires_grad
            assert_held(d, handle, 3)
            total += loss.item()
            del loss
            assert_arena_empty(d)
            assert handle_live(handle) == 0
        assert total > 0
        assert handle.stats()["handle"]["groups"] == 9
    finally:
        handle.remove()


def test_offload_activations_block_dropped(d, gc_mode):
    torch.manual_seed(4)
    model = RMSStack(layers=2)
    with mot.offload_activations(
        min_tensor_bytes=mot.DEFAULT_MIN_TENSOR_BYTES, runtime_dir=d.runtime_dir
    ):
        loss = model(batch())
    mot.get_offloader(d.runtime_dir).flush()
    assert d.status()["groups"] == 1
    del loss
    assert_arena_empty(d)


def test_group_with_nothing_offloaded_is_released(d, gc_mode):
    """A group whose saved tensors all stay in place has no entry whose drop
    would release it: it goes at close (its unused reservation, made at begin
    with the size learned from the previous, bigger step, went back there
    already; the group itself stayed in the offloader, counted live)."""
    torch.manual_seed(6)
    model = RMSStack(layers=2)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=64 << 10, runtime_dir=d.runtime_dir)
    try:
        step_both(model, ref, batch())  # the slot learns its size
        assert handle.stats()["handle"]["groups_offloaded"] == 1
        assert_arena_empty(d)
        small = torch.randn(1, 4, 128)  # every saved tensor below 64 KiB
        loss = model(small)
        assert_arena_empty(d)
        assert handle_live(handle) == 0
        del loss
        step_both(model, ref, small)
        assert_arena_empty(d)
        assert handle_live(handle) == 0
    finally:
        handle.remove()


def test_groups_live_per_handle(d):
    """stats()["handle"]["groups_live"] counts one handle's groups not yet
    released; the top level counts the process's."""
    torch.manual_seed(5)
    a = DecoderStack(layers=3)
    b = DecoderStack(layers=4)
    ha = mot.offload_layers(a.layers, runtime_dir=d.runtime_dir)
    hb = mot.offload_layers(b.layers, runtime_dir=d.runtime_dir)
    try:
        loss_a = a(tokens())
        loss_b = b(tokens())
        assert handle_live(ha) == 2 and handle_live(hb) == 3
        assert ha.stats()["groups_live"] == 5
        loss_a.backward()
        assert handle_live(ha) == 0 and handle_live(hb) == 3
        del loss_b
        assert handle_live(hb) == 0
        assert hb.stats()["groups_live"] == 0
        assert_arena_empty(d)
    finally:
        ha.remove()
        hb.remove()
