"""One rank of ``place_state`` under real FSDP2 on CPU (gloo), started by
mp.spawn from test_state.py.

Each rank builds the same small decoder stack twice from one seed, shards
both with ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))``
(``kind`` "fsdp2"), or keeps both whole on the CPU (``kind`` "cpu": a
ZeRO-offload style CPU optimizer, no FSDP), makes an AdamW and an LR
scheduler for each, calls ``place_state`` on one, and trains both on the same
batches. After every step it compares, bit for bit, the loss, every local
parameter shard and every optimizer state tensor, and records what the
placement holds. It writes ``<out_dir>/<kind>-rank<r>.json`` and does not
raise on a mismatch, so the test reports all of them.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_worker import sessions  # noqa: E402
from models import DecoderStack, tokens  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().contiguous().reshape(-1).view(torch.uint8)


def _shard(model: nn.Module, kind: str, device: str) -> nn.Module:
    if kind == "cpu":
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    # Pinned shards where there is a GPU to copy them to (FSDP2's default).
    policy = CPUOffloadPolicy(pin_memory=device == "cuda")
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage under a tensor (a DTensor's local one): what a
    placement would move (FSDP2's padded shard, not the narrowed view)."""
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.untyped_storage().nbytes()


def _local_nbytes(t: torch.Tensor) -> int:
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() * local.element_size()


def _states(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for key in sorted(opt.state.get(p, {})):
                value = opt.state[p][key]
                if isinstance(value, torch.Tensor):
                    out.append(value)
    return out


def run(rank: int, world_size: int, port: int, kinds: List[str], runtime_dir: str, bin_dir: str,
        out_dir: str, job_id: str, steps: int, min_bytes: int, device: str = "cpu") -> None:
    """mp.spawn entry. ``device`` "cuda": NCCL, rank r on GPU r, FSDP2 only."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), MEMOFFLOAD_JOB_ID=job_id)
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for kind in kinds:
            result: Dict[str, Any] = {"kind": kind, "rank": rank, "mismatches": []}
            try:
                _train(rank, kind, runtime_dir, bin_dir, steps, min_bytes, result, device)
            finally:
                Path(out_dir, f"{kind}-rank{rank}.json").write_text(json.dumps(result, default=str))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _train(rank: int, kind: str, runtime_dir: str, bin_dir: str, steps: int, min_bytes: int,
           result: Dict[str, Any], device: str) -> None:
    """``kind``: "fsdp2" or "cpu", with "_keep_grads" when the trainer keeps
    its gradients between steps (zero_grad(set_to_none=False)), and
    "_resume" when it loads its state dicts back first (a resumed job)."""
    import memoffload.torch as mot
    from memoffload.torch.state import placement as _state

    set_to_none = "_keep_grads" not in kind
    resume = kind.endswith("_resume")
    kind = kind.replace("_keep_grads", "").replace("_resume", "")

    torch.manual_seed(0)
    base = DecoderStack(layers=2, dim=128, heads=4).to(device)
    model = _shard(copy.deepcopy(base), kind, device)
    ref = _shard(base, kind, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, lambda s: 0.9 ** s)
    placement = mot.place_state(model, opt, runtime_dir=runtime_dir, min_bytes=min_bytes)
    if resume:  # as a job that resumes does: DCP's state dicts of a fresh optimizer, loaded back
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        for m, o in ((model, opt), (ref, opt_ref)):
            msd, osd = get_state_dict(m, o)  # runs a step on zero gradients, then drops them
            set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
    result["placed_before_step"] = placement.stats()
    params = list(model.parameters())
    result["params"] = len(params)
    # What place_state should move: the tensors of at least min_bytes.
    result["big_params"] = sum(_nbytes(q) >= min_bytes for q in ref.parameters())
    result["params_held_before"] = sum(placement.holds(p) for p in params)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        batch = tokens(batch=2, length=16).random_(0, 97, generator=gen).to(device)
        losses = []
        for m, o, s in ((model, opt, sched), (ref, opt_ref, sched_ref)):
            o.zero_grad(set_to_none=set_to_none)
            loss = m(batch)
            loss.backward()
            o.step()
            s.step()
            losses.append(loss.detach())
        if not torch.equal(_bits(losses[0]), _bits(losses[1])):
            result["mismatches"].append(f"step {step}: loss {losses[0].item()} != {losses[1].item()}")
        for i, (p, q) in enumerate(zip(params, ref.parameters())):
            if not torch.equal(_bits(p), _bits(q)):
                result["mismatches"].append(f"step {step}: parameter {i}")
            if (p.grad is None) != (q.grad is None) or (
                    p.grad is not None and not torch.equal(_bits(p.grad), _bits(q.grad))):
                result["mismatches"].append(f"step {step}: gradient {i}")
        states, states_ref = _states(opt), _states(opt_ref)
        if len(states) != len(states_ref):
            result["mismatches"].append(f"step {step}: {len(states)} states, {len(states_ref)} ref")
        for i, (a, b) in enumerate(zip(states, states_ref)):
            if not torch.equal(_bits(a), _bits(b)):
                result["mismatches"].append(f"step {step}: optimizer state {i}")
        if step == 0:
            result["placed_after_step"] = placement.stats()
    states = _states(opt)
    result["states"] = len(states)
    result["big_states"] = sum(_nbytes(t) >= min_bytes for t in _states(opt_ref))
    result["states_held"] = sum(placement.holds(t) for t in states)
    result["state_bytes"] = sum(t.numel() * t.element_size() for t in states)
    result["params_held"] = sum(placement.holds(p) for p in params)
    # A gradient's local tensor may view a larger buffer (FSDP2's reduce-scatter
    # output): what would move is its own bytes.
    result["big_grads"] = sum(q.grad is not None and _local_nbytes(q.grad) >= min_bytes
                              for q in ref.parameters())
    result["grads_held"] = sum(p.grad is not None and placement.holds(p.grad) for p in params)
    # Placed shards a GPU copies from must be page-locked (CUDA-registered).
    result["params_pinned"] = sum(p._local_tensor.is_pinned() for p in params
                                  if placement.holds(p))
    result["torch"] = torch.__version__
    result["final"] = placement.stats()
    result["status_committed"] = mot.daemon_status(runtime_dir)["committed_bytes"]
    dist.barrier()  # both ranks placed: one session each
    if rank == 0:
        result["sessions"] = sessions(bin_dir, runtime_dir)
        # A torch whose FSDP2 internals were not tested: refused, with a message.
        if kind == "fsdp2":
            saved = _state.TESTED_TORCH
            _state.TESTED_TORCH = ("0.0",)
            try:
                mot.place_state(model, runtime_dir=runtime_dir)
                result["untested_refusal"] = None
            except mot.errors.FailedPrecondition as e:
                result["untested_refusal"] = str(e)
            finally:
                _state.TESTED_TORCH = saved
    dist.barrier()
    placement.remove()
    del model, opt, sched, placement, params, states
    import gc

    gc.collect()
    dist.barrier()
    if rank == 0:
        result["status_after"] = mot.daemon_status(runtime_dir)
