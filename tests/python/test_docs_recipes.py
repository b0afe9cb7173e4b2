"""The Trainer, Lightning and FSDP2 ``place_state`` recipes of
docs/torch_frameworks.md run verbatim: the exact text of the first python
block under each heading, against a real daemon named by
MEMOFFLOAD_RUNTIME_DIR (as a user's environment would), with the `model` /
`train_dataset` and `module` / `loader` the first two call "yours" from
test_hf.py and test_lightning.py. The place_state recipe is a whole program:
it runs in a process of its own, on the CPU here and on a GPU in the GPU kit
(the `gpu` case)."""

from __future__ import annotations

import csv
import io
import re
from contextlib import redirect_stdout
from typing import Dict, Iterator

import pytest

import memoffload.torch as mot
from conftest import REPO, assert_arena_empty
from memoffload.step_log import LOGGED_KEYS


def recipe(heading: str) -> str:
    text = (REPO / "docs" / "torch_frameworks.md").read_text()
    assert f"\n{heading}\n" in text, f"docs/torch_frameworks.md has no heading {heading!r}"
    section = text[text.index(f"\n{heading}\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block under {heading!r}"
    return match.group(1)


@pytest.fixture
def user_env(daemon, monkeypatch, tmp_path) -> Iterator[None]:
    """The daemon is the default one, the working directory a fresh one."""
    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", daemon.runtime_dir)
    monkeypatch.chdir(tmp_path)
    mot.forget_offloader()  # the default runtime dir now means this daemon
    try:
        yield
    finally:
        mot.forget_offloader()


def run(code: str, namespace: Dict) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(code, "docs/torch_frameworks.md", "exec"), namespace)
    return out.getvalue()


def test_hugging_face_recipe_runs_verbatim(daemon, user_env):
    from test_hf import RandomTokens, tiny_llama

    namespace = {"__name__": "__recipe__", "model": tiny_llama(), "train_dataset": RandomTokens()}
    printed = run(recipe("## Hugging Face Trainer"), namespace)
    callback, trainer = namespace["callback"], namespace["trainer"]
    entries = [h for h in trainer.state.log_history if LOGGED_KEYS[0] in h]
    assert len(entries) == 3 + 1  # each step, and the train summary log
    assert entries[0]["memoffload/offloaded_bytes"] > 0, entries
    for key in ("memoffload/offloaded_bytes", "memoffload/prefetched_bytes"):
        assert sum(h[key] for h in entries) == callback.totals[key] > 0
    assert "memoffload/offloaded_bytes" in printed
    assert "llama-finetune" in daemon.jobs()
    off = mot.get_offloader(None, "llama-finetune")
    del namespace, callback, trainer
    assert_arena_empty(daemon, off)


def test_lightning_recipe_runs_verbatim(daemon, user_env, tmp_path):
    from test_lightning import Stack, batches

    # Batches of 128: each saved activation (32 KiB) is above the default
    # min_tensor_bytes, which the recipe keeps.
    namespace = {"__name__": "__recipe__", "module": Stack(), "loader": batches(128)}
    printed = run(recipe("## Lightning"), namespace)
    callback = namespace["callback"]
    # What a user reads: the CSV the recipe's logger wrote, one row per step.
    with open(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get(LOGGED_KEYS[0])]
    assert len(rows) == 3, rows
    for key in ("memoffload/offloaded_bytes", "memoffload/prefetched_bytes"):
        assert sum(int(r[key]) for r in rows) == callback.totals[key] > 0
    assert all(int(r["memoffload/arena_peak_bytes"]) > 0 for r in rows), rows
    assert "memoffload/offloaded_bytes" in printed
    assert "lightning-run" in daemon.jobs()
    off = mot.get_offloader(None, "lightning-run")
    del namespace, callback
    assert_arena_empty(daemon, off)


PLACE_STATE = "## Model and optimizer state in the arena (`place_state`)"


def _run_place_state_recipe(daemon, tmp_path) -> dict:
    import ast
    import os
    import subprocess
    import sys

    program = tmp_path / "recipe.py"
    program.write_text(recipe(PLACE_STATE))
    env = dict(os.environ, MEMOFFLOAD_RUNTIME_DIR=daemon.runtime_dir)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    stats = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    return stats


def test_the_fsdp2_place_state_recipe_runs_verbatim_on_the_cpu(daemon, tmp_path):
    """Issue 39: the recipe wrote CPUOffloadPolicy() (pin_memory=True), with
    which fully_shard fails on a machine without a GPU."""
    stats = _run_place_state_recipe(daemon, tmp_path)
    assert stats["tensors"] >= 8 and stats["bytes"] > 4 * 512 * 512 * 4, stats  # the 4 weights' shards
    assert stats["session_id"] is not None and stats["refused"] == 0, stats


@pytest.mark.gpu
def test_the_fsdp2_place_state_recipe_runs_verbatim_on_a_gpu(daemon, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    stats = _run_place_state_recipe(daemon, tmp_path)
    assert stats["tensors"] >= 8 and stats["unpinned_bytes"] == 0, stats
