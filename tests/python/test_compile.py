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

import torch

import memoffload.torch as mot
from conftest import assert_arena_empty, step_both
from models import DecoderStack, tokens

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
