#!/usr/bin/env python3
"""Benchmarks of the PyTorch integration, each against a baseline measured in
the same run. Prints one JSON object per line.

1. hooks: per saved tensor, what the training thread spends in memoffload's
   pack + unpack through the arena next to a hook that only clones the
   tensor (p50 and ratio per size); the group's RPCs (Reserve, Commit,
   Prefetch, Release), which overlap with compute, per group beside it.
2. step: CPU step time (forward + backward) of a small Transformer with
   offload_layers vs without.
3. checkpoint_step: offload_layers(checkpoint=True) vs checkpointing alone
   vs plain, same alternating scheme.
4. saved_sizes: how the bytes a small decoder saves for backward split by
   tensor size (no daemon): what a min_tensor_bytes threshold keeps in place.

    .venv/bin/python bench/torch_bench.py [--runtime-dir DIR]
        [--sizes 256,1024,...] [--no-step]

It imports the installed memoffload package (scripts/venv.sh).

Without --runtime-dir it starts $MEMOFFLOAD_BIN_DIR/memoffloadd (default
build/bin) in a temporary directory and stops it at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Sequence

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

import torch
from torch import nn

import memoffload.torch as mot
from memoffload.torch import _Counters, _make_pack, _ParamSkip, _unpack  # noqa: E402


def start_daemon(tmp: str, arena: str = "512MiB", chunk: str = "128MiB",
                 extra: Sequence[str] = ()) -> subprocess.Popen:
    """memoffloadd of $MEMOFFLOAD_BIN_DIR (default build/bin) in `tmp`, once it answers."""
    exe = os.path.join(os.environ.get("MEMOFFLOAD_BIN_DIR", os.path.join(REPO, "build", "bin")), "memoffloadd")
    proc = subprocess.Popen(
        [exe, f"--runtime-dir={tmp}", f"--arena-size={arena}", f"--chunk-size={chunk}",
         "--metrics-address=none", "--log-level=warn", *extra])
    for _ in range(200):
        try:
            mot.daemon_status(tmp)
            return proc
        except RuntimeError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("memoffloadd did not start")


def clone_pack(t: torch.Tensor) -> torch.Tensor:
    """The baseline: a saved-tensors hook that only clones (one copy)."""
    return t.clone()


def clone_unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def bench_hooks(runtime_dir: str, size_bytes: int, tensors: int, rounds: int,
                reserve_ahead: bool = False) -> dict:
    """Per saved tensor, what the training thread spends in pack + unpack
    (and in dropping the handle and the unpacked tensor, as autograd does in
    backward) for memoffload's hooks and for a clone-only hook, alternating
    rounds; p50 over rounds of each round's mean per tensor. The group's own
    work (Reserve, Commit, Prefetch, Release on the worker, which overlaps
    with compute in training) is outside the per-tensor time and reported
    per group: begin + close + prefetch wait + release wait.

    The group's Reserve is posted when it begins; CPU tensors packed before it
    returns are copied by the worker at close, the others by the training
    thread. ``reserve_ahead`` waits for the Reserve before the first pack (in
    the group time), as when the reservation is made before the forward: then
    every copy is the training thread's, one copy against the clone's one."""
    off = mot.get_offloader(runtime_dir)
    src = [torch.randn(size_bytes // 4) for _ in range(tensors)]
    ns = time.perf_counter_ns

    def ours() -> tuple:
        g0 = ns()
        ctx = mot.offload_activations(runtime_dir=runtime_dir, slot=size_bytes)
        ctx.__enter__()
        if reserve_ahead:
            off.flush()
        pack = _make_pack(off, ctx.key, 0, _ParamSkip([]), _Counters())
        t0 = ns()
        handles = [pack(t) for t in src]
        t1 = ns()
        ctx.__exit__(None, None, None)
        ctx.prefetch()
        off.flush()  # prefetch complete: issued a window ahead in training
        t2 = ns()
        out = [_unpack(h) for h in handles]
        del handles, out
        t3 = ns()
        off.flush()  # Release done
        t4 = ns()
        return (t1 - t0) + (t3 - t2), (t0 - g0) + (t2 - t1) + (t4 - t3)

    def clone() -> tuple:
        t0 = ns()
        handles = [clone_pack(t) for t in src]
        out = [clone_unpack(h) for h in handles]
        del handles, out
        return ns() - t0, 0

    times = {"memoffload": [], "clone": []}
    group_ns = []
    for fn in (ours, clone):  # warm-up (the first ours learns the group size)
        fn()
    before = off.stats()
    for _ in range(rounds):
        for name, fn in (("memoffload", ours), ("clone", clone)):
            per_tensor, group = fn()
            times[name].append(per_tensor / tensors)
            if name == "memoffload":
                group_ns.append(group)
    after = off.stats()
    m = statistics.median(times["memoffload"])
    c = statistics.median(times["clone"])
    return {
        "bench": "hooks",
        "tensor_bytes": size_bytes,
        "tensors_per_group": tensors,
        "reservation": "ahead" if reserve_ahead else "at_begin",
        "rounds": rounds,
        "memoffload_p50_us_per_tensor": round(m / 1e3, 2),
        "clone_p50_us_per_tensor": round(c / 1e3, 2),
        "ratio_vs_clone": float(f"{m / c:.3g}"),  # significant digits: never rounds to 0
        "group_p50_us": round(statistics.median(group_ns) / 1e3, 1),
        # Copies the training thread made (the group's reservation was in
        # place); the worker made the rest, inside group_p50_us.
        "caller_copy_fraction": round(
            (after["caller_copies"] - before["caller_copies"]) / (rounds * tensors), 3),
    }


def timed_step(model: nn.Module, x: torch.Tensor, handle=None) -> float:
    """Seconds of one forward + backward; with `handle`, until its worker
    is idle, so queued Releases are not pushed into the next step."""
    t0 = time.perf_counter()
    model(x).pow(2).mean().backward()
    if handle is not None:
        handle.flush()
    return time.perf_counter() - t0


def bench_step(runtime_dir: str, steps: int, warmup: int = 2) -> dict:
    """Two copies of one model, one with offload_layers installed once (as a
    training script does), timed in alternating steps after `warmup` steps
    each (the first offloaded step learns the groups' sizes and blocks on
    nothing else). Offloaded bytes and blocking RPCs are per-step deltas of
    the timed steps only; each offloaded step's time includes a flush, so
    Releases still queued at its end are not pushed into the next step."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
    plain_model = nn.TransformerEncoder(layer, 6)
    off_model = copy.deepcopy(plain_model)
    x = torch.randn(8, 128, 128)
    handle = mot.offload_layers(off_model.layers, min_tensor_bytes=64 << 10, runtime_dir=runtime_dir)

    def step(model: nn.Module) -> float:
        return timed_step(model, x, handle if model is off_model else None)

    for _ in range(warmup):
        step(plain_model)
        step(off_model)
    plain, offloaded, moved, blocking = [], [], [], []
    for _ in range(steps):
        plain.append(step(plain_model))
        before = handle.stats()
        offloaded.append(step(off_model))
        after = handle.stats()
        moved.append(after["offloaded_bytes"] - before["offloaded_bytes"])
        blocking.append(after["blocking_rpcs"] - before["blocking_rpcs"])
    s = handle.stats()
    handle.remove()
    p = statistics.median(plain)
    o = statistics.median(offloaded)
    return {
        "bench": "step",
        "model": "TransformerEncoder 6x(d=128, ff=512), batch 8x128, CPU",
        "torch_threads": torch.get_num_threads(),
        "timed_steps": steps,
        "plain_ms": round(p * 1e3, 1),
        "offload_ms": round(o * 1e3, 1),
        "ratio_vs_plain": round(o / p, 3),
        "offloaded_mib_per_step": round(statistics.median(moved) / (1 << 20), 2),
        "blocking_rpcs_in_timed_steps": sum(blocking),
        "skipped_bytes": s["skipped_bytes"],
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def bench_checkpoint_step(runtime_dir: str, steps: int, warmup: int = 2) -> dict:
    """The checkpointing recipe: offload_layers(checkpoint=True) against the
    same layers checkpointed without offload (torch.utils.checkpoint,
    non-reentrant) and against plain training, timed in alternating steps
    as bench_step."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
    plain_model = nn.TransformerEncoder(layer, 6)
    ckpt_model = copy.deepcopy(plain_model)
    off_model = copy.deepcopy(plain_model)
    for m in ckpt_model.layers:
        fwd = m.forward
        m.forward = lambda *a, fwd=fwd, **k: torch.utils.checkpoint.checkpoint(
            fwd, *a, use_reentrant=False, **k)
    x = torch.randn(8, 128, 128)
    handle = mot.offload_layers(off_model.layers, runtime_dir=runtime_dir, checkpoint=True)

    def step(model: nn.Module) -> float:
        return timed_step(model, x, handle if model is off_model else None)

    models = (plain_model, ckpt_model, off_model)
    for _ in range(warmup):
        for m in models:
            step(m)
    times = [[], [], []]
    moved = []
    for _ in range(steps):
        for i, m in enumerate(models):
            before = handle.stats()["handle"]["offloaded_bytes"]
            times[i].append(step(m))
            if m is off_model:
                moved.append(handle.stats()["handle"]["offloaded_bytes"] - before)
    handle.remove()
    p, c, o = (statistics.median(t) for t in times)
    return {
        "bench": "checkpoint_step",
        "model": "TransformerEncoder 6x(d=128, ff=512), batch 8x128, CPU",
        "timed_steps": steps,
        "plain_ms": round(p * 1e3, 1),
        "checkpoint_ms": round(c * 1e3, 1),
        "checkpoint_offload_ms": round(o * 1e3, 1),
        "ratio_vs_checkpoint": round(o / c, 3),
        "ratio_vs_plain": round(o / p, 3),
        "offloaded_mib_per_step": round(statistics.median(moved) / (1 << 20), 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def bench_saved_sizes(thresholds) -> list:
    """Saved-tensor bytes of tests/python/models.py's DecoderStack (4 layers,
    dim 64, batch 4x32, the tests' model) kept in place by each threshold."""
    sys.path.insert(0, os.path.join(REPO, "tests", "python"))
    from models import DecoderStack, tokens  # noqa: E402

    torch.manual_seed(0)
    model = DecoderStack(layers=4)
    sizes = []

    def pack(t):
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):  # parameters and their views stay
            sizes.append(t.numel() * t.element_size())
        return t

    x = model.embed(tokens())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in model.layers:
            x = layer(x)
    total = sum(sizes)
    out = []
    for threshold in thresholds:
        kept = sum(n for n in sizes if n < threshold)
        out.append({
            "bench": "saved_sizes", "min_tensor_bytes": threshold, "tensors": len(sizes),
            "saved_bytes": total, "kept_bytes": kept,
            "kept_fraction": round(kept / total, 3),
            "offloaded_tensors": sum(1 for n in sizes if n >= threshold),
        })
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-dir", default="")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default="4096,65536,1048576,16777216",
                        help="tensor sizes (bytes) of the hooks bench, comma-separated")
    parser.add_argument("--no-step", action="store_true", help="skip the step benches")
    parser.add_argument("--only-checkpoint", action="store_true",
                        help="run only the checkpoint_step bench")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    proc = None
    tmp = None
    runtime_dir = args.runtime_dir
    if not runtime_dir:
        tmp = tempfile.TemporaryDirectory(prefix="mo-bench-")
        runtime_dir = tmp.name
        proc = start_daemon(runtime_dir)
    print(json.dumps({"bench": "env", "torch": torch.__version__,
                      "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)}),
          flush=True)
    try:
        if args.only_checkpoint:
            print(json.dumps(bench_checkpoint_step(runtime_dir, args.steps)), flush=True)
            return 0
        sizes = [int(x) for x in args.sizes.split(",")]
        for size in sizes:
            tensors = max(2, min(64, (32 << 20) // size))
            for ahead in (False, True):
                print(json.dumps(bench_hooks(runtime_dir, size, tensors, args.rounds, ahead)),
                      flush=True)
        for row in bench_saved_sizes(sorted(set(sizes) | {1024, 1 << 20})):
            print(json.dumps(row), flush=True)
        if not args.no_step:
            print(json.dumps(bench_step(runtime_dir, args.steps)), flush=True)
            print(json.dumps(bench_checkpoint_step(runtime_dir, args.steps)), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
