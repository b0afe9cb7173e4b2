"""Layers compiled with torch.compile (inductor on CPU) under offload_layers.

The compiled forward is one autograd Function whose saved tensors (what
AOTAutograd's partitioner keeps for backward) go through the saved-tensor
hooks at the compiled region's boundary, so they are offloaded like an eager
layer's. The first run on a machine compiles C++ kernels (about a minute on
2 busy cores); inductor's cache (/tmp/torchinductor_$USER) makes later runs
take seconds.
"""

from __future__ import annotations

import copy

import pytest
import torch

import memoffload.torch as mot
from conftest import assert_arena_empty, step_both
from models import DecoderStack

STEPS = 3


def compiled_stack(model: DecoderStack) -> DecoderStack:
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, backend="inductor")
    return model


def offloaded_per_step(handle, model, ref, steps):
    """Trains both on the same batches (bit-exact check per step) and returns
    (bytes offloaded, tensors added to groups) of each step."""
    deltas = []
    for step in range(steps):
        before = handle.stats()
        gen = torch.Generator().manual_seed(40 + step)
        step_both(model, ref, torch.randint(0, 97, (2, 16), generator=gen))
        handle.flush()
        after = handle.stats()
        deltas.append(
            (
                after["offloaded_bytes"] - before["offloaded_bytes"],
                after["tensors"] - before["tensors"],
            )
        )
    return deltas


def test_compiled_layers_offload_bit_exact(daemon):
    torch.manual_seed(3)
    eager = DecoderStack(layers=3, dim=32, heads=4)
    model = compiled_stack(copy.deepcopy(eager))
    ref = compiled_stack(copy.deepcopy(eager))  # the same compiled model, no offload
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    before = handle.stats()
    compiled = offloaded_per_step(handle, model, ref, STEPS)
    s = handle.stats()
    handle.remove()
    assert all(nbytes > 0 for nbytes, _ in compiled), compiled  # every step offloaded
    assert s["prefetched_bytes"] > before["prefetched_bytes"], s
    assert s["skipped_bytes"] == before["skipped_bytes"], s
    # The compiled graphs ran (not an eager fallback): dynamo compiled frames.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0

    # What is offloaded under compile is what the compiled graph saves: the
    # partitioner recomputes cheap ops in backward, so it saves fewer tensors
    # than the same layers in eager mode (bytes after storage dedup: <=).
    eager_ref = copy.deepcopy(eager)
    eager_handle = mot.offload_layers(
        eager.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir
    )
    (eager_bytes, eager_tensors), = offloaded_per_step(eager_handle, eager, eager_ref, 1)
    eager_handle.remove()
    nbytes, ntensors = compiled[-1]
    print(f"per step: compiled {ntensors} tensors {nbytes} B, eager {eager_tensors} tensors {eager_bytes} B")
    assert 0 < ntensors < eager_tensors
    assert 0 < nbytes <= eager_bytes
    assert_arena_empty(daemon)


def _compile_whole(model: DecoderStack) -> torch.nn.Module:
    return torch.compile(model, backend="inductor")


def _compile_in_place(model: DecoderStack) -> torch.nn.Module:
    for layer in model.layers:
        layer.compile(backend="inductor")
    return model


@pytest.mark.parametrize("compile_", [_compile_whole, _compile_in_place], ids=["whole", "in_place"])
def test_compile_beyond_per_layer_offloads_without_recompiles_bit_exact(daemon, compile_):
    """Issue 30 item 2: `torch.compile(model)` and `layer.compile()` around
    offloaded layers. Before, Dynamo traced into the wrapper ("does not know
    how to trace method begin_group"), recompiled every step on
    `len(self._chain)` until the recompile limit and fell back to eager, and
    the whole-model case was not bit-identical to the same compiled model
    without offload. Now: no error, no new graph after step 2, bit-identical
    to the same compiled model with offload disabled (same graph breaks: one
    per layer call), and every step offloads."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(5)
    eager = DecoderStack(layers=3, dim=32, heads=4)
    model_eager, ref_eager = copy.deepcopy(eager), copy.deepcopy(eager)
    handle = mot.offload_layers(
        model_eager.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir
    )
    ref_handle = mot.offload_layers(
        ref_eager.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir, enabled=False
    )
    model, ref = compile_(model_eager), compile_(ref_eager)
    graphs = []
    offloaded = []
    for step in range(4):
        before = handle.stats()["offloaded_bytes"]
        gen = torch.Generator().manual_seed(60 + step)
        step_both(model, ref, torch.randint(0, 97, (2, 16), generator=gen))
        handle.flush()
        offloaded.append(handle.stats()["offloaded_bytes"] - before)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    handle.remove()
    ref_handle.remove()
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[-1] == graphs[1], f"new graphs after step 2 (recompiles): {graphs}"
    assert all(n > 0 for n in offloaded), offloaded
    assert_arena_empty(daemon)
