"""One rank of a real FSDP run on CPU (gloo), started by mp.spawn from
test_fsdp.py and bench/torch_recipes_bench.py; on a GPU (NCCL, FSDP2 only)
from test_gpu_training.py.

Each rank builds the same small decoder stack twice from one seed, shards both
the same way (FSDP2 ``fully_shard`` or FSDP1 ``FullyShardedDataParallel`` with
one unit per layer), puts ``offload_layers`` on one of them and trains both on
the same batches. After every step it compares, bit for bit, the loss, every
local gradient shard and every local parameter shard of the two, and writes
what it found to ``<out_dir>/<kind>-rank<r>.json``; it does not raise on a
mismatch, so the test reports all of them.

Rank 0 also asks the daemon for its sessions (``memoffloadctl --json
sessions``) while both ranks are attached, and again after both removed their
handles and dropped their graphs.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import DecoderStack  # noqa: E402


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself (FSDP1)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return _local(t).detach().contiguous().reshape(-1).view(torch.uint8)


def _shard(model: DecoderStack, kind: str) -> nn.Module:
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # device_id="cpu": without it torch 2.13's FSDP1 refuses a CPU-only
        # machine ("FSDP needs a non-CPU accelerator device").
        cpu = torch.device("cpu")
        for i, layer in enumerate(model.layers):
            model.layers[i] = FSDP(layer, device_id=cpu)
        return FSDP(model, device_id=cpu)
    raise ValueError(f"unknown kind {kind!r}")


def sessions(bin_dir: str, runtime_dir: str) -> List[Dict[str, Any]]:
    out = subprocess.run(
        [os.path.join(bin_dir, "memoffloadctl"), "--runtime-dir", runtime_dir, "--json", "sessions"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out).get("sessions", [])


def run(
    rank: int,
    world_size: int,
    port: int,
    kinds: List[str],
    runtime_dir: str,
    bin_dir: str,
    out_dir: str,
    job_id: str,
    steps: int,
    offload: bool = True,
    shape: Tuple[int, int, int, int] = (3, 32, 2, 16),
    device: str = "cpu",
) -> None:
    """mp.spawn entry: one process group, then each of ``kinds`` in turn
    (one interpreter start for all of them: that is most of the time).
    ``device`` "cuda": NCCL, rank r on GPU r (FSDP2 only)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MEMOFFLOAD_JOB_ID=job_id,
    )
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for kind in kinds:
            result: Dict[str, Any] = {"kind": kind, "rank": rank, "mismatches": [], "step_seconds": []}
            try:
                _train(rank, world_size, kind, runtime_dir, bin_dir, steps, offload, shape, result,
                       device)
            finally:
                Path(out_dir, f"{kind}-rank{rank}.json").write_text(json.dumps(result, default=str))
    finally:
        dist.destroy_process_group()


def _train(
    rank: int,
    world_size: int,
    kind: str,
    runtime_dir: str,
    bin_dir: str,
    steps: int,
    offload: bool,
    shape: Tuple[int, int, int, int],
    result: Dict[str, Any],
    device: str = "cpu",
) -> None:
    """``shape``: layers, hidden size, batch, sequence length."""
    import memoffload.torch as mot

    torch.manual_seed(0)
    layers, dim, batch_size, seq = shape
    base = DecoderStack(layers=layers, dim=dim, heads=4).to(device)
    model = _shard(copy.deepcopy(base), kind)
    ref = _shard(base, kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    handle = None
    if offload:
        # The FSDP1 root forwards attribute reads to the wrapped module,
        # so model.layers is the list of per-layer FSDP units.
        handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=runtime_dir)
        result["stats_before"] = handle.stats()
    mismatches = result["mismatches"]
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 + step * world_size + rank)
        batch = torch.randint(0, 97, (batch_size, seq), generator=gen).to(device)
        times = []
        for m in (model, ref):
            start = time.perf_counter()
            loss = m(batch)
            loss.backward()
            if m is model:
                loss_off = loss
            else:
                loss_ref = loss
            times.append(time.perf_counter() - start)
        result["step_seconds"].append(times)
        if not torch.equal(_bits(loss_off), _bits(loss_ref)):
            mismatches.append(f"step {step}: loss {loss_off.item()} != {loss_ref.item()}")
        pairs = list(zip(model.named_parameters(), ref.parameters()))
        for (name, p), q in pairs:
            if (p.grad is None) != (q.grad is None) or (
                p.grad is not None and not torch.equal(_bits(p.grad), _bits(q.grad))
            ):
                mismatches.append(f"step {step}: gradient of {name}")
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad(set_to_none=True)
        for (name, p), q in pairs:
            if not torch.equal(_bits(p), _bits(q)):
                mismatches.append(f"step {step}: parameter {name}")
        result["params_compared"] = len(pairs)
        if step == 0 and offload:
            dist.barrier()  # both ranks attached and offloading
            if rank == 0:
                result["sessions_during"] = sessions(bin_dir, runtime_dir)
            dist.barrier()
    if handle is not None:
        handle.flush()
        result["stats"] = handle.stats()
        handle.remove()
        handle.flush()
    del loss_off, loss_ref, loss
    dist.barrier()  # both ranks dropped their graphs
    if rank == 0 and offload:
        result["sessions_after"] = sessions(bin_dir, runtime_dir)
    dist.barrier()
