#!/usr/bin/env python3
"""Step time with offload vs without, for the recipes of docs/torch.md, each
against its baseline measured in the same run. CPU only. Prints one JSON
object per recipe.

- fsdp2 / fsdp1: world size 2 (gloo, mp.spawn), the tests' worker
  (tests/python/fsdp_worker.py): each rank alternates a step (forward +
  backward) of the offloaded and of the plain sharded model.
- hf: transformers.Trainer on a tiny LlamaForCausalLM, rounds of one run
  with MemoffloadCallback and one without (order alternating); the time of
  each optimizer step from a callback, ratio of the runs' medians per round.
- compile: torch.compile'd layers, alternating steps of the offloaded and
  the plain compiled model.

Ratios are medians of the per-step ratio (offloaded / plain) after warm-up
(hf: of the per-round ratio), with min and max.

    MEMOFFLOAD_BIN_DIR=build/bin .venv/bin/python bench/torch_recipes_bench.py [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import fsdp_worker  # noqa: E402
import torch_bench  # noqa: E402  (this folder)
import memoffload.torch as mot  # noqa: E402
from models import DecoderStack  # noqa: E402

WARMUP = 2
# The decoder stack of fsdp and compile (tests/python/models.py): layers,
# hidden size, batch, sequence length. The first compile of these shapes takes
# a minute or two on 2 cores (inductor caches it in /tmp/torchinductor_$USER).
LAYERS, DIM, BATCH, SEQ = 4, 128, 4, 128
HF_ROUNDS = 5


def start_daemon(runtime_dir: str) -> subprocess.Popen:
    return torch_bench.start_daemon(runtime_dir, arena="256MiB", chunk="64MiB")


def summary(name: str, pairs: list, extra: dict) -> dict:
    timed = pairs[WARMUP:]
    ratios = [off / plain for off, plain in timed]
    return {
        "recipe": name,
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "offload_step_ms": round(1e3 * statistics.median(o for o, _ in timed), 2),
        "plain_step_ms": round(1e3 * statistics.median(p for _, p in timed), 2),
        "timed_steps": len(timed),
        **extra,
    }


def bench_fsdp(runtime_dir: str, steps: int) -> list:
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        bin_dir = str(Path(os.environ.get("MEMOFFLOAD_BIN_DIR", REPO / "build" / "bin")).resolve())
        kinds = ["fsdp2", "fsdp1"]
        mp.spawn(fsdp_worker.run, args=(2, port, kinds, runtime_dir, bin_dir, out, "bench", steps,
                                         True, (LAYERS, DIM, BATCH, SEQ)), nprocs=2)
        results = []
        for kind in kinds:
            rank0 = json.loads(Path(out, f"{kind}-rank0.json").read_text())
            assert rank0["mismatches"] == [], rank0["mismatches"]
            stats = rank0["stats"]
            offloaded = stats["offloaded_bytes"] - rank0["stats_before"]["offloaded_bytes"]
            results.append(summary(kind, rank0["step_seconds"], {
                "model": f"{LAYERS}x DecoderBlock d{DIM}, batch {BATCH}x{SEQ}, world size 2",
                "offloaded_bytes_per_step_rank0": offloaded // steps}))
        return results


def bench_compile(runtime_dir: str, steps: int) -> dict:
    torch.manual_seed(0)
    plain = DecoderStack(layers=LAYERS, dim=DIM, heads=4)
    model = copy.deepcopy(plain)
    for m in (plain, model):
        for i, layer in enumerate(m.layers):
            m.layers[i] = torch.compile(layer)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=runtime_dir)
    before = handle.stats()["offloaded_bytes"]
    pairs = []
    for step in range(steps):
        batch = torch.randint(0, 97, (BATCH, SEQ))
        times = []
        for m in (model, plain):
            start = time.perf_counter()
            m(batch).backward()
            if m is model:
                handle.flush()
            times.append(time.perf_counter() - start)
        pairs.append(times)
    offloaded = handle.stats()["offloaded_bytes"] - before
    handle.remove()
    return summary("compile", pairs, {"model": f"{LAYERS}x DecoderBlock d{DIM} compiled, batch {BATCH}x{SEQ}",
                                      "offloaded_bytes_per_step": offloaded // steps})


def bench_hf(runtime_dir: str, steps: int) -> dict:
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.start)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, 128, (BATCH * steps, SEQ),
                                     generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=DIM, intermediate_size=4 * DIM,
                                      num_hidden_layers=LAYERS, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=SEQ)

    def run(offload: bool, out: str) -> list:
        torch.manual_seed(0)
        timer = StepTimer()
        callbacks = [timer]
        if offload:
            callbacks.append(mot.MemoffloadCallback(min_tensor_bytes=0, runtime_dir=runtime_dir))
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=BATCH, max_steps=steps, logging_steps=steps,
            report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
        trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args,
                                       train_dataset=Tokens(), callbacks=callbacks)
        with contextlib.redirect_stdout(sys.stderr):  # its log lines: stdout is JSON only
            trainer.train()
        return timer.times

    with tempfile.TemporaryDirectory() as out:
        before = mot.get_offloader(runtime_dir).stats()["offloaded_bytes"]
        pairs = []  # per round: (median offloaded step, median plain step)
        for r in range(HF_ROUNDS):
            order = (True, False) if r % 2 == 0 else (False, True)
            medians = {offload: statistics.median(run(offload, out)[WARMUP:]) for offload in order}
            pairs.append((medians[True], medians[False]))
        offloaded = mot.get_offloader(runtime_dir).stats()["offloaded_bytes"] - before
    ratios = [o / p for o, p in pairs]
    return {
        "recipe": "hf",
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "offload_step_ms": round(1e3 * statistics.median(o for o, _ in pairs), 2),
        "plain_step_ms": round(1e3 * statistics.median(p for _, p in pairs), 2),
        "rounds": HF_ROUNDS,
        "steps_per_run": steps,
        "model": f"LlamaForCausalLM {LAYERS} layers hidden {DIM}, batch {BATCH}x{SEQ}",
        "offloaded_bytes_per_step": offloaded // (HF_ROUNDS * steps),
        "note": "per round one Trainer run with the callback and one without (order alternates); "
                "ratio of their median step times",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", choices=["fsdp", "hf", "compile"], action="append")
    args = parser.parse_args()
    only = args.only or ["fsdp", "hf", "compile"]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        runtime_dir = os.path.join(tmp, "rt")
        os.mkdir(runtime_dir, 0o700)
        daemon = start_daemon(runtime_dir)
        try:
            info = {"torch": torch.__version__, "cpus": os.cpu_count(),
                    "load_avg_start": round(os.getloadavg()[0], 2)}
            print(json.dumps(info), flush=True)
            if "fsdp" in only:
                for r in bench_fsdp(runtime_dir, args.steps):
                    print(json.dumps(r), flush=True)
            if "hf" in only:
                print(json.dumps(bench_hf(runtime_dir, args.steps)), flush=True)
            if "compile" in only:
                print(json.dumps(bench_compile(runtime_dir, args.steps)), flush=True)
            print(json.dumps({"load_avg_end": round(os.getloadavg()[0], 2)}), flush=True)
        finally:
            mot.forget_offloader(runtime_dir)
            daemon.terminate()
            daemon.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
