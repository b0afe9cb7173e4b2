"""offload_layers against a real daemon: exact gradients and arena bookkeeping."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

import memoffload.torch as mot
from conftest import assert_arena_empty, assert_same_grads, bit_equal, clone_model
from models import DecoderBlock, DecoderStack, tokens, transformer_encoder


def assert_committed_matches(daemon, offloaded: int, groups: int) -> None:
    """Between forward and backward the daemon holds what stats() says was
    offloaded in that forward: committed, nothing reserved or being read.
    Each group's bytes are placed at 256-byte offsets and the daemon rounds a
    group to its page size, hence the slack."""
    s = daemon.status()
    assert s["reserved_bytes"] == 0 and s["read_bytes"] == 0, s
    assert offloaded <= s["committed_bytes"] <= offloaded + groups * 64 * 1024, (offloaded, s)
    assert s["groups"] == groups, s


def train_compare(model, ref, batches, loss_fn, handle, daemon):
    """Trains `model` (offloaded) and `ref` (plain) on the same batches with SGD
    and checks loss and gradients bit for bit after every step, and through
    the daemon's GetStatus that each step's bytes went through the arena."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for batch in batches:
        opt.zero_grad()
        opt_ref.zero_grad()
        before = handle.stats()
        loss = loss_fn(model, batch)
        handle.flush()
        mid = handle.stats()
        offloaded = mid["offloaded_bytes"] - before["offloaded_bytes"]
        assert_committed_matches(daemon, offloaded, mid["groups_offloaded"] - before["groups_offloaded"])
        loss.backward()
        handle.flush()
        after = handle.stats()
        assert after["prefetched_bytes"] - before["prefetched_bytes"] == offloaded
        assert after["skipped_bytes"] == before["skipped_bytes"], after["last_skip_reason"]
        loss_ref = loss_fn(ref, batch)
        loss_ref.backward()
        assert bit_equal(loss, loss_ref)
        assert_same_grads(model, ref)
        opt.step()
        opt_ref.step()
        assert_arena_empty(daemon)
    return handle.stats()


def test_transformer_encoder_exact(daemon):
    torch.manual_seed(0)
    model = transformer_encoder(layers=3)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    before = handle.stats()
    batches = [torch.randn(4, 16, 64) for _ in range(3)]
    s = train_compare(model, ref, batches, lambda m, x: m(x).pow(2).mean(), handle, daemon)
    handle.remove()
    assert s["offloaded_bytes"] > before["offloaded_bytes"]
    assert s["prefetched_bytes"] - before["prefetched_bytes"] == (
        s["offloaded_bytes"] - before["offloaded_bytes"]
    )
    assert s["groups_offloaded"] - before["groups_offloaded"] == 2 * 3  # 2 of 3 layers, 3 steps
    assert s["deduplicated"] > before["deduplicated"]
    assert s["kept_param_bytes"] > 0


@pytest.mark.parametrize(
    "num_layers,window", [(None, 1), (4, 1), (1, 1), (2, 0), (3, 2), (0, 1)]
)
def test_decoder_stack_exact(daemon, num_layers, window):
    torch.manual_seed(1)
    model = DecoderStack(layers=4)
    ref = clone_model(model)
    handle = mot.offload_layers(
        model.layers,
        num_layers=num_layers,
        prefetch_window=window,
        min_tensor_bytes=4096,
        runtime_dir=daemon.runtime_dir,
    )
    before = handle.stats()
    batches = [tokens() for _ in range(3)]
    s = train_compare(model, ref, batches, lambda m, t: m(t), handle, daemon)
    handle.remove()
    groups = 3 if num_layers is None else num_layers
    assert s["groups"] - before["groups"] == groups * 3
    if groups:
        assert s["offloaded_bytes"] > before["offloaded_bytes"]
        assert s["kept_small_bytes"] > 0  # the bool causal mask and small tensors
    else:
        assert s["offloaded_bytes"] == before["offloaded_bytes"]


def test_no_blocking_rpc_after_first_step(daemon):
    torch.manual_seed(2)
    model = DecoderStack(layers=4)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    seen = []
    for _ in range(5):
        model(tokens()).backward()
        seen.append(handle.stats()["blocking_rpcs"])
    handle.flush()
    handle.remove()
    assert seen[1:] == [seen[0]] * 4, seen
    assert_arena_empty(daemon)


def test_reserved_before_forward_in_steady_state(daemon):
    """From step 2 on each group is reserved at its layer's start: the arena
    shows the reservation while the layer runs."""
    torch.manual_seed(3)
    model = DecoderStack(layers=3)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    seen = []

    def probe(module, args):
        handle.flush()
        seen.append(daemon.status()["reserved_bytes"])

    hook = model.layers[1].norm1.register_forward_pre_hook(probe)  # inside the group
    for _ in range(2):
        model(tokens()).backward()
    hook.remove()
    handle.remove()
    # Step 1: layer 1 is not reserved yet (size unknown); step 2: it is.
    assert seen[0] == 0
    assert seen[1] > 0
    assert_arena_empty(daemon)


def test_gradient_accumulation_two_graphs_alive(daemon):
    torch.manual_seed(4)
    model = DecoderStack(layers=3)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    a, b = tokens(), tokens()
    la, lb = model(a), model(b)  # both graphs alive, each with its own groups
    handle.flush()
    assert daemon.status()["committed_bytes"] > 0
    lb.backward()
    la.backward()
    ref(a).backward()
    ref(b).backward()
    handle.remove()
    assert_same_grads(model, ref)
    assert_arena_empty(daemon)


def test_graph_dropped_without_backward_releases(daemon):
    torch.manual_seed(5)
    model = DecoderStack(layers=3)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    loss = model(tokens())
    handle.flush()
    assert daemon.status()["used_bytes"] > 0
    del loss
    handle.remove()
    assert_arena_empty(daemon)
    with pytest.raises(RuntimeError, match="boom"):
        with torch.enable_grad():
            h2 = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
            try:
                x = model.embed(tokens())
                x = model.layers[0](x)
                raise RuntimeError("boom")
            finally:
                h2.remove()
    del x
    assert_arena_empty(daemon)


def test_retain_graph_two_backwards(daemon):
    torch.manual_seed(6)
    model = DecoderStack(layers=3)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    before = handle.stats()
    t = tokens()
    loss = model(t)
    loss.backward(retain_graph=True)
    handle.flush()
    assert daemon.status()["used_bytes"] > 0  # kept in the arena while the graph lives
    loss.backward()
    loss_ref = ref(t)
    loss_ref.backward(retain_graph=True)
    loss_ref.backward()
    assert_same_grads(model, ref)
    s = handle.stats()
    assert s["rereads"] > before["rereads"]  # the second backward read the arena again
    del loss
    handle.remove()
    assert_arena_empty(daemon)


def test_double_backward(daemon):
    torch.manual_seed(7)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    ref = clone_model(model)
    handle = mot.offload_layers(list(model), min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    before = handle.stats()
    x = torch.randn(16, 32)
    for m in (model, ref):
        loss = m(x).pow(2).sum()
        g = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        sum(gi.pow(2).sum() for gi in g).backward()
    handle.flush()
    s = handle.stats()
    handle.remove()
    assert_same_grads(model, ref)
    offloaded = s["offloaded_bytes"] - before["offloaded_bytes"]
    assert offloaded > 0
    assert s["groups_offloaded"] - before["groups_offloaded"] == 3  # all but the last layer
    # The first backward read every group back; the second (create_graph)
    # reached into the same saved tensors again.
    assert s["prefetched_bytes"] - before["prefetched_bytes"] >= offloaded
    assert_arena_empty(daemon)


class CheckpointedBlock(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inner = DecoderBlock(64, 4)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cp.checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return torch.tanh(self.out(y)) + y


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_inside_offloaded_layer(daemon, reentrant):
    torch.manual_seed(8)
    model = nn.Sequential(*[CheckpointedBlock(reentrant) for _ in range(3)])
    ref = clone_model(model)
    handle = mot.offload_layers(list(model), min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    before = handle.stats()
    x = torch.randn(2, 16, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    model(x).pow(2).mean().backward()
    ref(x_ref).pow(2).mean().backward()
    handle.remove()
    assert_same_grads(model, ref)
    assert torch.equal(x.grad, x_ref.grad)
    assert handle.stats()["offloaded_bytes"] > before["offloaded_bytes"]
    assert_arena_empty(daemon)


def test_hf_callback_without_transformers(daemon):
    torch.manual_seed(9)
    model = DecoderStack(layers=3)
    ref = clone_model(model)
    cb = mot.MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    logs0 = {}
    cb.on_train_begin(None, None, None, model=model)
    assert cb.handle is not None
    cb.on_log(None, None, None, logs=logs0)
    t = tokens()
    model(t).backward()
    ref(t).backward()
    cb.handle.flush()
    logs = {}
    cb.on_log(None, None, None, logs=logs)
    cb.on_train_end(None, None, None)
    offloaded = logs["memoffload/offloaded_bytes"] - logs0["memoffload/offloaded_bytes"]
    assert offloaded > 0
    assert logs["memoffload/prefetched_bytes"] - logs0["memoffload/prefetched_bytes"] == offloaded
    assert "forward" not in model.layers[0].__dict__
    assert_same_grads(model, ref)
    assert_arena_empty(daemon)


def test_no_grad_forward_offloads_nothing(daemon):
    model = DecoderStack(layers=3)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    before = handle.stats()
    with torch.no_grad():
        model(tokens())
    handle.remove()
    assert handle.stats()["groups"] == before["groups"]


@pytest.mark.parametrize("window", [0, 1, 2])
def test_prefetch_window_brings_groups_back_ahead(daemon, window):
    """When backward reaches the last layer, its group and `window` groups
    before it are on their way back, and no other."""
    torch.manual_seed(10)
    model = DecoderStack(layers=4)
    handle = mot.offload_layers(
        model.layers, num_layers=4, prefetch_window=window, min_tensor_bytes=0,
        runtime_dir=daemon.runtime_dir,
    )
    seen = {}

    def probe(grad):
        handle.flush()  # every prefetch issued so far has run
        seen["prefetched"] = handle.stats()["prefetched_bytes"]
        seen["read"] = daemon.status()["read_bytes"]

    def add_probe(module, args, out):
        out.register_hook(probe)  # after the handle's hook on the same output

    hook = model.layers[3].register_forward_hook(add_probe)
    before = handle.stats()
    loss = model(tokens())
    handle.flush()
    offloaded = handle.stats()["offloaded_bytes"] - before["offloaded_bytes"]
    loss.backward()
    hook.remove()
    handle.flush()
    s = handle.stats()
    handle.remove()
    per_group = offloaded // 4  # four layers of the same shapes
    assert per_group * 4 == offloaded
    assert seen["prefetched"] - before["prefetched_bytes"] == (window + 1) * per_group
    assert seen["read"] >= (window + 1) * per_group
    assert s["prefetched_bytes"] - before["prefetched_bytes"] == offloaded
    assert_arena_empty(daemon)
