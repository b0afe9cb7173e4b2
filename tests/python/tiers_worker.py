"""One rank of a job that checkpoints through CheckpointManager (issue 44,
test_tiers.py), started by nodes_cluster.Cluster as ``tiers_worker.py
CONFIG RANK``: each rank trains a small model of its own (its keys carry
the rank, so every rank writes a shard of its own), the data of each step
derived from the step.

It calls ``manager.restore()`` first, trains from the step after it to
``cfg["steps"]`` with ``manager.step(step)`` after each, and closes the
manager (waiting for the persist in flight). Keeps in
``<out>/<phase>-rank<r>.json``: the restored step, the tier and what
``status()`` said; in ``<phase>-final-rank<r>.pt`` the final parameters and
optimizer state. With ``$MEMOFFLOAD_TEST_SAVE_PAUSE`` the test stops the
persist at a window and SIGKILLs the ranks there.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from log_records import Records  # noqa: E402


class App:
    """The rank's model and optimizer as one Stateful."""

    def __init__(self, rank: int, width: int) -> None:
        torch.manual_seed(1000 + rank)
        self.rank = rank
        self.model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                                         torch.nn.Linear(width, 8))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def state_dict(self) -> Dict[str, Any]:
        # get_state_dict: the optimizer's state exists before its first step
        # (DCP loads into what state_dict() returns).
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {f"model{self.rank}": model_sd, f"optim{self.rank}": optim_sd}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=sd[f"model{self.rank}"],
                       optim_state_dict=sd[f"optim{self.rank}"])

    def train(self, step: int) -> None:
        gen = torch.Generator().manual_seed(step * 100 + self.rank)
        x = torch.randn(16, self.model[0].in_features, generator=gen)
        self.opt.zero_grad()
        self.model(x).square().mean().backward()
        self.opt.step()

    def snapshot(self) -> Dict[str, torch.Tensor]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        out = {f"p.{k}": v.detach().clone() for k, v in model_sd.items()}
        for fqn, state in optim_sd["state"].items():
            out.update({f"o.{fqn}.{k}": v.clone() for k, v in state.items()})
        return out


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    rank = int(sys.argv[2])
    records = Records()
    logging.getLogger("memoffload").addHandler(records)
    logging.getLogger("memoffload").setLevel(logging.INFO)
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world"])
    from memoffload.torch.checkpoint import CheckpointManager

    app = App(rank, cfg.get("width", 64))
    manager = CheckpointManager(
        {"app": app}, job_id=cfg["job_id"], runtime_dir=cfg["runtime_dir"],
        durable_dir=cfg["durable_dir"], node_every=cfg.get("node_every", 1),
        durable_every=cfg.get("durable_every", 2), replicas=cfg.get("replicas", 0),
        keep_last_node=cfg.get("keep_last_node", 2), keep_last_durable=cfg.get("keep_last_durable", 2),
        async_save=cfg.get("async_save", True), persist_share=cfg.get("share", 1.0),
        persist_timeout_s=cfg.get("persist_timeout_s", 120))
    restored = manager.restore()
    out: Dict[str, Any] = {"restored": restored, "tier": manager.last_restore.get("tier"),
                           "sources": manager.last_restore.get("sources")}
    if restored is not None:
        torch.save(app.snapshot(), os.path.join(cfg["out"], f"{cfg['phase']}-loaded-rank{rank}.pt"))
    for step in range((restored or 0) + 1, cfg["steps"] + 1):
        app.train(step)
        manager.step(step)
        if step == cfg.get("snapshot_at"):
            torch.save(app.snapshot(),
                       os.path.join(cfg["out"], f"{cfg['phase']}-at{step}-rank{rank}.pt"))
    manager.close()
    out["status"] = manager.status()
    out["log"] = records.lines
    torch.save(app.snapshot(), os.path.join(cfg["out"], f"{cfg['phase']}-final-rank{rank}.pt"))
    with open(os.path.join(cfg["out"], f"{cfg['phase']}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
