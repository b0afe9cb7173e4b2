"""Activation checkpointing composed with offload (docs/torch.md,
"Checkpointing"): checkpointing stays in force (each checkpointed layer runs
twice per step), the arena receives exactly what the checkpoints keep, and
gradients are bit-identical to training without either."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

import memoffload.torch as mot
from conftest import assert_arena_empty, assert_same_grads, bit_equal, clone_model
from models import DecoderStack, tokens

BATCH, LENGTH, DIM = 4, 32, 64


def count_runs(model: DecoderStack) -> list:
    """runs[i]: how often layer i's body ran (forward and recomputation both
    call its submodules; the layer's own pre-hooks do not see a recompute)."""
    runs = [0] * len(model.layers)
    for i, layer in enumerate(model.layers):
        layer.qkv.register_forward_pre_hook(lambda m, a, i=i: runs.__setitem__(i, runs[i] + 1))
    return runs


def sgd_steps(model, ref, handle, daemon, steps, runs):
    """Trains both models; per step checks loss and gradients bit for bit,
    the layer runs and the bytes that went through the arena."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    per_step = []
    for _ in range(steps):
        t = tokens(BATCH, LENGTH)
        opt.zero_grad()
        opt_ref.zero_grad()
        runs[:] = [0] * len(runs)
        before = handle.stats()["handle"]
        loss = model(t)
        loss.backward()
        handle.flush()
        after = handle.stats()["handle"]
        loss_ref = ref(t)
        loss_ref.backward()
        assert bit_equal(loss, loss_ref)
        assert_same_grads(model, ref)
        opt.step()
        opt_ref.step()
        per_step.append(
            (list(runs), after["offloaded_bytes"] - before["offloaded_bytes"],
             after["prefetched_bytes"] - before["prefetched_bytes"])
        )
        assert_arena_empty(daemon)
    return per_step


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_option_keeps_checkpointing_and_offloads_inputs(daemon, reentrant):
    torch.manual_seed(20)
    model = DecoderStack(layers=4, dim=DIM)
    ref = clone_model(model)
    runs = count_runs(model)
    handle = mot.offload_layers(
        model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir,
        checkpoint=True, use_reentrant=reentrant,
    )
    for layer_runs, offloaded, prefetched in sgd_steps(model, ref, handle, daemon, 3, runs):
        # Every layer is checkpointed: forward + recomputation.
        assert layer_runs == [2, 2, 2, 2]
        # The groups hold what the checkpoints keep: each offloaded layer's
        # input (3 of 4 layers; fp32), nothing else.
        assert offloaded == 3 * BATCH * LENGTH * DIM * 4
        assert prefetched == offloaded
    handle.remove()
    assert handle.stats()["handle"]["groups_offloaded"] == 3 * 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_around_offloaded_layer_stays_in_force(daemon, reentrant, caplog):
    """A user's checkpoint around an offloaded layer: the layer steps aside
    (logged once) instead of switching the checkpoint off (non-reentrant: the
    layer used to run once per step) or sending the recomputation through
    the arena (reentrant)."""
    torch.manual_seed(21)
    caplog.set_level(logging.WARNING, logger="memoffload")
    model = DecoderStack(layers=4, dim=DIM)
    ref = clone_model(model)
    runs = count_runs(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)

    def forward(tokens_):
        x = model.embed(tokens_)
        for layer in model.layers:
            x = cp.checkpoint(layer, x, use_reentrant=reentrant)
        logits = model.head(x)
        return nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), tokens_[:, 1:].flatten()
        )

    model_forward = model.forward
    model.forward = forward
    try:
        for layer_runs, offloaded, _ in sgd_steps(model, ref, handle, daemon, 2, runs):
            assert layer_runs == [2, 2, 2, 2]
            assert offloaded == 0  # neither the recomputation nor anything else
    finally:
        model.forward = model_forward
    s = handle.stats()
    handle.remove()
    assert s["stepped_aside"] > 0
    # This handle's warnings (an earlier module's stager may log its abort
    # from a finalizer while this test runs).
    warnings = [r for r in caplog.records
                if r.name == "memoffload" and "staging/" not in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_inside_offloaded_layer_recomputes(daemon, reentrant):
    """checkpoint inside the layer's own forward: the checkpoint's hooks are
    the inner ones, so the region is recomputed and the group holds what the
    checkpoint keeps plus the rest of the layer."""
    torch.manual_seed(22)
    model = DecoderStack(layers=3, dim=DIM)
    for layer in model.layers:
        body = layer.forward
        layer.forward = lambda x, body=body: cp.checkpoint(body, x, use_reentrant=reentrant)
    ref = DecoderStack(layers=3, dim=DIM)
    ref.load_state_dict(model.state_dict())
    runs = count_runs(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    for layer_runs, offloaded, prefetched in sgd_steps(model, ref, handle, daemon, 2, runs):
        assert layer_runs == [2, 2, 2]
        assert offloaded == 2 * BATCH * LENGTH * DIM * 4  # the inputs of 2 of 3 layers
        assert prefetched == offloaded
    handle.remove()
