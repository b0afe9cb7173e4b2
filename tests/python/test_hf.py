"""A real transformers.Trainer with MemoffloadCallback on a tiny
LlamaForCausalLM built from a LlamaConfig here (no download, no tokenizer),
on random token ids."""

from __future__ import annotations

import copy
import os
import logging
import subprocess
import sys

import pytest
import torch

import memoffload
import memoffload.torch as mot
from conftest import assert_arena_empty, bit_equal
from memoffload.step_log import LOGGED_KEYS

import transformers  # noqa: E402 - pinned in scripts/requirements-test.txt: no skip

STEPS = 3


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 12, length: int = 32, vocab: int = 128) -> None:
        gen = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, vocab, (n, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> "transformers.LlamaForCausalLM":
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def make_trainer(model, tmp_path, callbacks, **args) -> "transformers.Trainer":
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=7,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **args,
    )
    return transformers.Trainer(
        model=model, args=targs, train_dataset=RandomTokens(), callbacks=callbacks
    )


def run_trainer(model, tmp_path, callbacks, **args) -> "transformers.Trainer":
    trainer = make_trainer(model, tmp_path, callbacks, **args)
    trainer.train()
    return trainer


def train(model, tmp_path, callbacks, **args):
    """The step log entries (those with a loss)."""
    trainer = run_trainer(model, tmp_path, callbacks, **args)
    return [h for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_callback_is_exact_and_logs_counters(daemon, tmp_path):
    model = tiny_llama()
    ref = copy.deepcopy(model)
    callback = mot.MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    logs = train(model, tmp_path / "off", [callback])
    logs_ref = train(ref, tmp_path / "ref", [])
    assert callback.handle is None  # removed at the end of training
    assert len(logs) == len(logs_ref) == STEPS
    assert [h["loss"] for h in logs] == [h["loss"] for h in logs_ref]
    # The logged loss is rounded: the trained weights must match bit for bit.
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert bit_equal(p, q), name
    for h in logs:  # every step offloaded and read back, nothing kept in memory
        assert set(LOGGED_KEYS) <= set(h), h
        assert h["memoffload/offloaded_bytes"] > 0, h
        assert h["memoffload/prefetched_bytes"] > 0, h
        assert h["memoffload/skipped_bytes"] == 0 and h["memoffload/skipped_share"] == 0.0, h
    assert_arena_empty(daemon)


COUNTERS = ("offloaded_bytes", "prefetched_bytes", "skipped_bytes", "blocking_rpcs")


def test_logged_differences_sum_to_the_counters_and_a_second_trainer_starts_from_zero(
        daemon, tmp_path, caplog):
    """Each log holds what changed since the previous one: over a training
    the entries sum to the session's counters (and to callback.totals), the
    arena is held during a step and empty at its log, and a second Trainer
    in the same process logs the same per-step numbers as the first (before:
    the process's cumulative counters, so the second started where the first
    ended). One summary line at the epoch's end and one at train end."""
    off = mot.get_offloader(daemon.runtime_dir)
    runs = []
    for run in range(2):
        callback = mot.MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
        before = off.stats()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="memoffload"):
            trainer = run_trainer(tiny_llama(), tmp_path / str(run), [callback])
        off.flush()
        after = off.stats()
        entries = [h for h in trainer.state.log_history if "memoffload/offloaded_bytes" in h]
        # One per step, and the train summary log (what the last step left).
        assert len(entries) == STEPS + 1, trainer.state.log_history
        for name in COUNTERS:
            logged = sum(h[f"memoffload/{name}"] for h in entries)
            assert logged == after[name] - before[name], (name, entries)
            assert logged == callback.totals[f"memoffload/{name}"], (name, callback.totals)
        for h in entries[:STEPS]:
            assert h["memoffload/offloaded_bytes"] > 0, h
            assert h["memoffload/arena_held_bytes"] == 0, h  # released by the step's backward
            assert h["memoffload/arena_peak_bytes"] >= h["memoffload/offloaded_bytes"], h
        lines = [r.getMessage() for r in caplog.records if r.name == "memoffload"]
        assert len([m for m in lines if "epoch 1: 3 steps, offloaded " in m]) == 1, lines
        assert len([m for m in lines if "training: 3 steps, offloaded " in m]) == 1, lines
        runs.append(entries)
    first, second = runs
    for name in ("offloaded_bytes", "prefetched_bytes"):
        assert [h[f"memoffload/{name}"] for h in second] == [h[f"memoffload/{name}"] for h in first]
    assert_arena_empty(daemon)


def test_reporting_integrations_see_the_keys_when_the_callback_goes_first(daemon, tmp_path):
    """report_to's integrations are callbacks the Trainer puts before the
    user's: they log before MemoffloadCallback adds its keys. Put first (the
    documented workaround, also when it is in callbacks= as well), a callback
    that logs like an integration sees them in every step's log."""

    class Reporter(transformers.TrainerCallback):  # a stand-in for WandbCallback & co.
        def __init__(self) -> None:
            self.seen = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs))

    reporter = Reporter()
    callback = mot.MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    trainer = make_trainer(tiny_llama(), tmp_path, [reporter, callback])
    trainer.callback_handler.callbacks.insert(0, callback)
    trainer.train()
    steps = [h for h in reporter.seen if "loss" in h]
    assert len(steps) == STEPS
    assert all(h["memoffload/offloaded_bytes"] > 0 for h in steps), steps
    logged = sum(h["memoffload/offloaded_bytes"] for h in trainer.state.log_history
                 if "memoffload/offloaded_bytes" in h)
    assert logged == callback.totals["memoffload/offloaded_bytes"] > 0


def test_disabled_callback_trains_and_logs_zeros(daemon, tmp_path):
    """MemoffloadCallback(enabled=False), the A/B switch (before: a KeyError
    at the first log, a disabled handle's stats() had no blocking_rpcs)."""
    callback = mot.MemoffloadCallback(enabled=False, runtime_dir=daemon.runtime_dir)
    logs = train(tiny_llama(), tmp_path, [callback])
    assert len(logs) == STEPS
    for h in logs:
        assert {k: h[k] for k in LOGGED_KEYS} == {k: 0 for k in LOGGED_KEYS}, h


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("flag", ["gradient_checkpointing", "activation_checkpointing"])
def test_trainer_refuses_gradient_checkpointing(daemon, tmp_path, flag):
    """No composition with HF checkpointing in this version: it refuses at
    train begin, never trains with checkpointing silently switched off."""
    model = tiny_llama()
    callback = mot.MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    before = mot.get_offloader(daemon.runtime_dir).stats()
    with pytest.raises(memoffload.InvalidArgument) as refused:
        train(model, tmp_path, [callback], **{flag: True})
    assert refused.value.code == memoffload.StatusCode.INVALID_ARGUMENT
    assert callback.handle is None
    # Refused before any step: nothing went through the arena.
    assert mot.get_offloader(daemon.runtime_dir).stats()["offloaded_bytes"] == before["offloaded_bytes"]


def test_import_memoffload_torch_does_not_import_transformers():
    code = (
        "import sys, memoffload.torch as mot\n"
        "from memoffload.torch import *\n"
        "assert 'transformers' not in sys.modules, 'imported by memoffload.torch'\n"
        "cb = mot.MemoffloadCallback\n"  # the callback itself loads it, lazily
        "assert 'transformers' in sys.modules\n"
        "import transformers; assert issubclass(cb, transformers.TrainerCallback)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_trainer_with_callback_checkpoint_recipe_recomputes_and_offloads(daemon, tmp_path):
    """What the refusal points to: gradient_checkpointing=False and
    MemoffloadCallback(checkpoint=True). Each decoder layer runs twice per
    step (checkpointing in force), its checkpoint input goes through the
    arena, and the trained weights equal a plain run's bit for bit."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    calls = {"n": 0}

    def count(_module, _inputs):
        calls["n"] += 1

    for layer in model.model.layers:  # a submodule sees the recompute too
        layer.mlp.register_forward_pre_hook(count)
    callback = mot.MemoffloadCallback(
        min_tensor_bytes=0, checkpoint=True, runtime_dir=daemon.runtime_dir
    )
    logs = train(model, tmp_path / "ckpt", [callback])
    logs_ref = train(ref, tmp_path / "ref", [])
    assert [h["loss"] for h in logs] == [h["loss"] for h in logs_ref]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert bit_equal(p, q), name
    layers = len(model.model.layers)
    assert calls["n"] == 2 * layers * STEPS, calls
    assert all(h["memoffload/offloaded_bytes"] > 0 for h in logs), logs
    assert_arena_empty(daemon)


class _Weights(transformers.TrainerCallback):
    """The model's parameters when training begins (after the callbacks
    before it restored them)."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.at_begin = {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_checkpoints_through_the_manager_logs_its_figures_and_resumes(daemon, tmp_path):
    options = {"job_id": f"hf-{tmp_path.name}", "runtime_dir": daemon.runtime_dir,
               "node_every": 1, "durable_every": 2, "durable_dir": str(tmp_path / "durable")}
    model = tiny_llama()
    callback = mot.MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir,
                                      checkpoints=options)
    trainer = run_trainer(model, tmp_path / "a", [callback])
    assert callback.checkpoints.restored is None
    final = callback.checkpoints.final
    assert final["memoffload/ckpt_node_step"] == STEPS and final["memoffload/ckpt_persisted_step"] == 2
    assert final["memoffload/ckpt_persisted_bytes"] > 0, final
    logged = [h for h in trainer.state.log_history if "memoffload/ckpt_node_step" in h]
    assert logged, trainer.state.log_history  # the figures join the logs
    assert sorted(p.name for p in (tmp_path / "durable").iterdir()) == [".memoffload-persisting",
                                                                         "step-2"]
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    # A new run of the job: restored at train begin, saves numbered on from it.
    again = mot.MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir,
                                   checkpoints=options)
    probe = _Weights()
    run_trainer(tiny_llama(), tmp_path / "b", [again, probe])
    assert again.checkpoints.restored == STEPS
    assert all(bit_equal(probe.at_begin[n], trained[n]) for n in trained)
    assert again.checkpoints.final["memoffload/ckpt_node_step"] == 2 * STEPS
    assert "step-4" in os.listdir(tmp_path / "durable")
    # Without restoring, saves are numbered past the job's newest: no id is reused.
    fresh = mot.MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir,
                                   checkpoints={**options, "restore": False})
    run_trainer(tiny_llama(), tmp_path / "c", [fresh])
    assert fresh.checkpoints.restored is None
    assert fresh.checkpoints.final["memoffload/ckpt_node_step"] == 3 * STEPS
