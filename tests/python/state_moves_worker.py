"""One rank of FSDP2 training whose daemon restarts under it (issue 42),
started by mp.spawn from test_state_moves.py.

Each rank trains a placed and an unplaced copy of the same FSDP2 model
(``CPUOffloadPolicy``, AdamW, gradients kept: ``zero_grad(set_to_none=False)``)
on the same batches, step after step, compared bit for bit, until the test
writes ``<out>/stop`` (the ranks agree on the step to stop at). After every
step it appends to ``<out>/progress-rank<r>.jsonl`` what the placement holds
(shards, optimizer states, gradients), its session, and how many of the
arena chunks it mapped at step 1 it still maps; at the end it writes
``<out>/result-rank<r>.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Set

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import DecoderStack, tokens  # noqa: E402
from state_worker import _bits, _shard, _states  # noqa: E402


def chunk_inodes() -> Set[int]:
    """Inodes of the arena chunks this process maps now: the
    ``memfd:memoffload-chunk-N (deleted)`` mappings of /proc/self/smaps."""
    out = set()
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split(None, 5)
            # A mapping's header: "start-end perms offset dev inode path".
            if (len(parts) == 6 and "-" in parts[0] and not parts[0].endswith(":")
                    and parts[5].rstrip().endswith("(deleted)")
                    and "memfd:memoffload-chunk-" in parts[5]):
                out.add(int(parts[4]))
    return out


def run(rank: int, world_size: int, port: int, runtime_dir: str, out_dir: str, job_id: str,
        max_steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), MEMOFFLOAD_JOB_ID=job_id)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result: Dict[str, Any] = {"rank": rank, "mismatches": []}
    try:
        _train(rank, runtime_dir, Path(out_dir), max_steps, result)
    finally:
        Path(out_dir, f"result-rank{rank}.json").write_text(json.dumps(result, default=str))
        dist.destroy_process_group()


def _train(rank: int, runtime_dir: str, out: Path, max_steps: int, result: Dict[str, Any]) -> None:
    import memoffload.torch as mot
    from memoffload.torch.state import rehome

    rehome.REATTACH_S = 0.0  # a new session is tried at every step
    torch.manual_seed(0)
    base = DecoderStack(layers=2, dim=128, heads=4)
    model = _shard(copy.deepcopy(base), "fsdp2", "cpu")
    ref = _shard(base, "fsdp2", "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    placement = mot.place_state(model, opt, runtime_dir=runtime_dir, min_bytes=4096)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(rank)
    first: Set[int] = set()
    progress = open(out / f"progress-rank{rank}.jsonl", "w")
    for step in range(max_steps):
        batch = tokens(batch=2, length=16).random_(0, 97, generator=gen)
        losses: List[torch.Tensor] = []
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad(set_to_none=False)
            loss = m(batch)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        if not torch.equal(_bits(losses[0]), _bits(losses[1])):
            result["mismatches"].append(f"step {step}: loss")
        for i, (p, q) in enumerate(zip(params, ref.parameters())):
            if not torch.equal(_bits(p), _bits(q)) or not torch.equal(_bits(p.grad), _bits(q.grad)):
                result["mismatches"].append(f"step {step}: parameter or gradient {i}")
        for i, (a, b) in enumerate(zip(_states(opt), _states(opt_ref))):
            if not torch.equal(_bits(a), _bits(b)):
                result["mismatches"].append(f"step {step}: optimizer state {i}")
        if step == 1:
            first = chunk_inodes()
        st = placement.stats()
        progress.write(json.dumps({
            "step": step,
            "session_id": st["session_id"],
            "moves": st["moves"],
            "tensors": st["tensors"],
            "held_bytes": st["held_bytes"],
            "shards": sum(placement.holds(p) for p in params),
            "states": sum(placement.holds(t) for t in _states(opt)),
            "grads": sum(placement.holds(p.grad) for p in params),
            "first_chunks_mapped": len(first & chunk_inodes()),
            "time": time.time(),
        }) + "\n")
        progress.flush()
        stop = torch.tensor([int(rank == 0 and (out / "stop").exists())])
        dist.all_reduce(stop)
        if stop.item():
            break
        time.sleep(0.03)
    result["steps"] = step + 1
    result["final"] = placement.stats()
