"""One rank of a real 2-rank FSDP2 (gloo, CPU) training run that checkpoints
through memoffload.torch.checkpoint; started as a plain process by
test_checkpoint.py (so that the test can SIGKILL it):

    python ckpt_worker.py '<json config>'      # RANK, WORLD_SIZE, MASTER_* in env

Phases (config["phase"]):

* ``run_a``: trains steps 1..6, saving after steps 2, 3 and 4 (keep_last=2);
  snapshots the local state right after the step-4 save ("saved") and after
  step 6 ("final"). With ``kill_save``, it then saves "step-6" and rank 1
  SIGKILLs itself in the middle of writing its region, once rank 0's region
  is committed; the test SIGKILLs rank 0. Without it, it waits to be killed.
* ``run_b``: a new job with the same job id: first (with ``full_job``) loads
  a checkpoint one process saved of the whole model into its shards
  (resharding), then loads latest_checkpoint(),
  snapshots what it loaded ("loaded"), trains steps 5..6 ("final") and saves
  "step-6" again.
* ``fallback``: trains 2 steps, saves "step-2" (to the filesystem when some
  rank has no daemon), snapshots, trains 2 more, loads "step-2" back and
  snapshots that ("loaded"). ``runtime_dir`` may be a list, one per rank.

A snapshot is every local shard of the model and optimizer state, the LR
scheduler's state and the rank's RNG state, torch.save'd to
``<out>/<phase>-<name>-rank<r>.pt``; what else a phase saw goes to
``<out>/<phase>-rank<r>.json``. The data of step s is a function of s and the
rank: the position of the data is the trainer's (it is saved as "step").
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from memoffload.torch.checkpoint import store
from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter, latest_checkpoint

SAVE_STEPS = (2, 3, 4)
LAST_STEP = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.25)),
            nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.25)),
        ])
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(rank: int):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    torch.manual_seed(100 + rank)  # dropout differs per rank
    return model, opt, sched


def train_step(model, opt, sched, step: int, rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step * world + rank)
    x = torch.randn(8, 16, generator=gen)
    y = torch.randn(8, 1, generator=gen)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def state(model, opt, sched, rank: int, step: int) -> Dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "lr_sched": sched.state_dict(),
            f"rng_{rank}": torch.get_rng_state(), "step": step}


def _flat(prefix: str, value: Any, out: Dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}", v, out)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in value):
        for i, v in enumerate(value):
            _flat(f"{prefix}.{i}", v, out)
    elif isinstance(value, torch.Tensor):
        t = value.to_local() if hasattr(value, "to_local") else value
        out[prefix] = t.detach().clone()
    else:
        out[prefix] = value


def snapshot(cfg: Dict[str, Any], name: str, model, opt, sched, rank: int, step: int) -> None:
    flat: Dict[str, Any] = {}
    _flat("", state(model, opt, sched, rank, step), flat)
    torch.save(flat, os.path.join(cfg["out"], f"{cfg['phase']}-{name}-rank{rank}.pt"))


def regions(cfg: Dict[str, Any]) -> Dict[str, Any]:
    s, reason = store.attach(cfg["runtime_dir"], cfg["job_id"], -1, True)
    assert s is not None, reason
    return {c.checkpoint_id: {"complete": c.complete, "regions": sorted(c.regions)}
            for c in store.stored_checkpoints(s).values()}


def save(cfg, model, opt, sched, rank: int, step: int, result: Dict[str, Any], **hooks) -> None:
    writer = MemoffloadWriter(job_id=cfg["job_id"], runtime_dir=cfg["runtime_dir"],
                              fallback_dir=cfg["fallback_dir"], keep_last=2)
    writer._after_append = hooks.get("after_append")
    dcp.save(state(model, opt, sched, rank, step), storage_writer=writer, checkpoint_id=f"step-{step}")
    result["saves"].append({"step": step, "mode": writer.last_mode, "collected": writer.last_collected,
                            "deleted": writer.last_deleted})
    if rank == 0 and writer.last_mode == "daemon":
        result["regions_after"][str(step)] = regions(cfg)


def load(cfg, model, opt, sched, rank: int, checkpoint_id: str, result: Dict[str, Any]) -> int:
    sd = state(model, opt, sched, rank, -1)
    reader = MemoffloadReader(job_id=cfg["job_id"], runtime_dir=cfg["runtime_dir"],
                              fallback_dir=cfg["fallback_dir"])
    dcp.load(sd, storage_reader=reader, checkpoint_id=checkpoint_id)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    sched.load_state_dict(sd["lr_sched"])
    torch.set_rng_state(sd[f"rng_{rank}"])
    result["loads"].append({"checkpoint_id": checkpoint_id, "mode": reader.last_mode, "step": sd["step"]})
    return int(sd["step"])


def load_resharded(cfg: Dict[str, Any], model) -> Dict[str, Any]:
    """Loads checkpoint "full" of job ``full_job`` (one process saved the
    unsharded model with every parameter + 1) into this rank's shards: each
    shard reads part of a stored tensor (narrowed by storage offsets).
    Returns {name: [shape of the local shard, bit-identical to init + 1]}."""
    msd = get_model_state_dict(model)
    expected = {k: (_local(v) + 1).detach().clone() for k, v in msd.items()}
    reader = MemoffloadReader(job_id=cfg["full_job"], runtime_dir=cfg["runtime_dir"],
                              fallback_dir=cfg["fallback_dir"])
    dcp.load({"model": msd}, storage_reader=reader, checkpoint_id="full")
    got = {k: _local(v) for k, v in msd.items()}
    return {k: [list(got[k].shape), torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8))]
            for k in msd}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def kill_mid_write(cfg: Dict[str, Any], rank: int):
    """rank 1's append hook: once rank 0's region of this save is committed,
    SIGKILL this process with its own region half written."""
    def hook(region: str, written: int) -> None:
        if rank != 1 or not region.endswith("__1_0.distcp"):
            return
        other = region.replace("__1_0.distcp", "__0_0.distcp")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            s, _ = store.attach(cfg["runtime_dir"], cfg["job_id"], -1, True)
            if any(r["name"] == other for r in s.list(other)):
                break
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    return hook


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if isinstance(cfg["runtime_dir"], list):  # one per rank
        cfg["runtime_dir"] = cfg["runtime_dir"][rank]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: Dict[str, Any] = {"rank": rank, "saves": [], "loads": [], "regions_after": {}}
    out = os.path.join(cfg["out"], f"{cfg['phase']}-rank{rank}.json")
    model, opt, sched = build(rank)
    phase = cfg["phase"]
    if phase == "run_a":
        for step in range(1, LAST_STEP + 1):
            train_step(model, opt, sched, step, rank, world)
            if step in SAVE_STEPS:
                save(cfg, model, opt, sched, rank, step, result)
            if step == SAVE_STEPS[-1]:
                snapshot(cfg, "saved", model, opt, sched, rank, step)
        snapshot(cfg, "final", model, opt, sched, rank, LAST_STEP)
        write_json(out, result)
        if cfg.get("kill_save"):
            try:
                save(cfg, model, opt, sched, rank, LAST_STEP, result, after_append=kill_mid_write(cfg, rank))
            except BaseException as exc:  # rank 0: gloo sees rank 1 die (DCP raises CheckpointException)
                print(f"rank {rank}: the save failed as rank 1 died: {type(exc).__name__}", file=sys.stderr)
        while True:  # the test SIGKILLs us
            time.sleep(1)
    elif phase == "run_b":
        if cfg.get("full_job"):
            result["resharded"] = load_resharded(cfg, model)
        latest = latest_checkpoint(cfg["job_id"], cfg["runtime_dir"], cfg["fallback_dir"])
        result["latest"] = latest
        step = load(cfg, model, opt, sched, rank, latest, result)
        snapshot(cfg, "loaded", model, opt, sched, rank, step)
        for step in range(step + 1, LAST_STEP + 1):
            train_step(model, opt, sched, step, rank, world)
        snapshot(cfg, "final", model, opt, sched, rank, LAST_STEP)
        save(cfg, model, opt, sched, rank, LAST_STEP, result)
    elif phase == "fallback":
        for step in (1, 2):
            train_step(model, opt, sched, step, rank, world)
        save(cfg, model, opt, sched, rank, 2, result)
        snapshot(cfg, "saved", model, opt, sched, rank, 2)
        for step in (3, 4):
            train_step(model, opt, sched, step, rank, world)
        result["latest"] = latest_checkpoint(cfg["job_id"], cfg["runtime_dir"], cfg["fallback_dir"])
        step = load(cfg, model, opt, sched, rank, "step-2", result)
        snapshot(cfg, "loaded", model, opt, sched, rank, step)
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    write_json(out, result)
    # Both ranks end together: a rank whose peer has already exited could
    # abort in gloo's teardown ("terminate called without an active
    # exception", seen in 2 of 3 runs with torch 2.13, also on the daemon of
    # the stop before; nothing of memoffload's is running by then).
    dist.barrier()
    dist.destroy_process_group()


def write_json(path: str, result: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
