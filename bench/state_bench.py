#!/usr/bin/env python3
"""Host memory and start-up of FSDP2 CPU-offloaded training with the state
in torch's memory vs in the node arena (``memoffload.torch.place_state``),
each against the other in the same run. CPU only (gloo); pinning and
rounding figures belong to the GPU kit's run.

Two ranks (mp.spawn) shard one decoder stack (``--layers`` x ``--dim``;
the defaults make 201 M parameters) with
``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))``, make
AdamW and train ``--steps`` steps. Runs alternate: torch, arena, torch,
arena, ... (``--rounds`` of each), each in fresh processes. Per run:

- ``state_bytes``: the exact bytes of the state the ranks hold (padded
  parameter shards and optimizer state tensors), summed over the ranks;
- ``held_bytes``: what holds them: with the arena, the daemon's blocks
  (page-rounded) plus what stayed in torch's memory; with torch, the same as
  state_bytes (torch's CPU allocator does not round like the pinned one);
- ``rss_anon``, ``rss_shmem``: the ranks' RssAnon and RssShmem after the
  last step, summed; ``node_bytes``: rss_anon plus the arena's used bytes
  (shared memory, counted once, not per rank that maps it);
- ``first_step_s``: from the rank function's start (after imports) to the end
  of the first optimizer step, the slower rank; ``place_s``: place_state's
  call (arena runs).

Prints one JSON object: per mode the median and spread of each figure, and
the ratios arena / torch of the medians.

    MEMOFFLOAD_BIN_DIR=build/bin .venv/bin/python bench/state_bench.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import torch_bench  # noqa: E402  (this folder)
import memoffload.torch as mot  # noqa: E402
from models import DecoderStack  # noqa: E402

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss() -> Dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    from memoffload.torch.state.fsdp import fsdp_params

    out = [fp._sharded_param_data for fp in fsdp_params(model)]
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out.append(getattr(value, "_local_tensor", value))
    return out


def rank_main(rank: int, port: int, mode: str, runtime_dir: str, out_dir: str, layers: int,
              dim: int, steps: int) -> None:
    start = time.perf_counter()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), MEMOFFLOAD_JOB_ID="state-bench")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = DecoderStack(layers=layers, dim=dim, heads=8)
    policy = CPUOffloadPolicy(pin_memory=False)
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    gc.collect()  # the unsharded parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    result: Dict[str, Any] = {"rank": rank, "mode": mode}
    placement = None
    if mode == "arena":
        t = time.perf_counter()
        placement = mot.place_state(model, opt, runtime_dir=runtime_dir, strict=True)
        result["place_s"] = time.perf_counter() - t
    batch = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(rank))
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(batch).backward()
        opt.step()
        if step == 0:
            result["first_step_s"] = time.perf_counter() - start
    opt.zero_grad(set_to_none=True)  # gradients are not state kept between steps
    gc.collect()
    state = _state_tensors(model, opt)
    result["state_bytes"] = sum(t.untyped_storage().nbytes() for t in state)
    if placement is not None:
        s = placement.stats()
        result["held_bytes"] = s["held_bytes"] + s["left_bytes"]
        result["placed_tensors"] = s["tensors"]
        result["left_tensors"] = s["left"]
    else:
        result["held_bytes"] = result["state_bytes"]
    # What the ranks' allocators keep of memory freed (the unsharded model,
    # a moved tensor's first copy) is returned, so that RssAnon is what is
    # in use; before: the same figures without that.
    result["before_trim"] = _rss()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    result.update(_rss())
    dist.barrier()
    if rank == 0:
        result["arena_used"] = mot.daemon_status(runtime_dir)["used_bytes"]
    Path(out_dir, f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def one_run(mode: str, runtime_dir: str, layers: int, dim: int, steps: int) -> Dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(_free_port(), mode, runtime_dir, out, layers, dim, steps),
                 nprocs=WORLD_SIZE)
        ranks = [json.loads(Path(out, f"{mode}-rank{r}.json").read_text())
                 for r in range(WORLD_SIZE)]
    arena_used = ranks[0].get("arena_used", 0)
    run = {
        "state_bytes": sum(r["state_bytes"] for r in ranks),
        "held_bytes": sum(r["held_bytes"] for r in ranks),
        "rss": sum(r["VmRSS"] for r in ranks),
        "rss_anon": sum(r["RssAnon"] for r in ranks),
        "rss_anon_untrimmed": sum(r["before_trim"]["RssAnon"] for r in ranks),
        "rss_shmem": sum(r["RssShmem"] for r in ranks),
        "arena_used": arena_used,
        "node_bytes": sum(r["RssAnon"] for r in ranks) + arena_used,
        "first_step_s": max(r["first_step_s"] for r in ranks),
    }
    if mode == "arena":
        run["place_s"] = max(r["place_s"] for r in ranks)
        run["left_tensors"] = sum(r["left_tensors"] for r in ranks)
    return run


def summarize(runs: List[Dict[str, float]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arena", default="", help="arena size (default: 1.25x the state + 256 MiB)")
    args = parser.parse_args()
    params = args.layers * (12 * args.dim * args.dim + 13 * args.dim) + 97 * args.dim * 2 + 97
    state_bytes = params * 4 * 3  # parameters and AdamW's two moments, fp32
    arena_mib = int(state_bytes * 1.25 / 2**20) + 256
    arena = args.arena or f"{arena_mib}MiB"
    with tempfile.TemporaryDirectory() as tmp:
        rt = os.path.join(tmp, "rt")
        os.mkdir(rt, 0o700)
        # The bench places state alone: all of the arena may be state's
        # (quotas.state_share, default half, would refuse strict placement).
        daemon = torch_bench.start_daemon(rt, arena=arena, chunk=f"{min(1024, arena_mib)}MiB",
                                          extra=["--state-share=1"])
        try:
            runs: Dict[str, List[Dict[str, float]]] = {"torch": [], "arena": []}
            for _ in range(args.rounds):
                for mode in ("torch", "arena"):
                    runs[mode].append(one_run(mode, rt, args.layers, args.dim, args.steps))
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    t, a = summarize(runs["torch"]), summarize(runs["arena"])
    ratio = {k: a[k]["median"] / t[k]["median"] for k in ("node_bytes", "rss", "first_step_s")
             if t[k]["median"]}
    ratio["held_vs_exact_arena"] = a["held_bytes"]["median"] / a["state_bytes"]["median"]
    print(json.dumps({"bench": "state", "parameters": params, "layers": args.layers,
                      "dim": args.dim, "steps": args.steps, "rounds": args.rounds, "arena": arena,
                      "torch": t, "arena_runs": a, "ratio_arena_over_torch": ratio}))


if __name__ == "__main__":
    main()
