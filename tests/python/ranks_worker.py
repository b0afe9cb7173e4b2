"""One of several independent ranks (processes) that share one daemon and, on
a GPU, one device, started by mp.spawn from test_gpu_training.py. No process
group: each rank trains its own copy of one model with offload_layers next to
a plain copy, on its own batches, after a barrier so that all of them attach,
register the arena and offload at the same time. It writes what it found to
``<out_dir>/rank<r>.json`` and does not raise on a mismatch."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import DecoderStack  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def run(rank: int, device: str, runtime_dir: str, out_dir: str, job_id: str, steps: int,
        barrier) -> None:
    os.environ.update(MEMOFFLOAD_JOB_ID=job_id, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import memoffload.torch as mot

    result: Dict[str, Any] = {"rank": rank, "mismatches": []}
    try:
        torch.manual_seed(0)
        ref = DecoderStack(layers=4, dim=128, heads=4).to(device)
        model = copy.deepcopy(ref)
        handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=runtime_dir)
        barrier.wait(timeout=120)
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * rank + step)
            batch = torch.randint(0, 97, (4, 64), generator=gen).to(device)
            losses = []
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                loss = m(batch)
                loss.backward()
                losses.append(loss.detach())
            if device == "cuda":
                torch.cuda.synchronize()
            if not torch.equal(_bits(losses[0]), _bits(losses[1])):
                result["mismatches"].append(f"step {step}: loss")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if not torch.equal(_bits(p.grad), _bits(q.grad)):
                    result["mismatches"].append(f"step {step}: gradient of {name}")
            if step == 0:
                handle.flush()
                barrier.wait(timeout=120)  # every rank has offloaded once
                if rank == 0:
                    result["status_during"] = mot.daemon_status(runtime_dir)
                barrier.wait(timeout=120)
        handle.flush()
        result["stats"] = handle.stats()
        handle.remove()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
