"""The trainer of examples/two_nodes.sh: a small FSDP2 model on CPU (gloo),
started by torchrun on each "node". Each rank uses its node's memoffloadd
($MEMOFFLOAD_RUNTIME_DIR) and replicates from its node's address
($MEMOFFLOAD_REPLICATION_ADDRESS).

    two_nodes_train.py train OUT     trains 4 steps, saves step-4 with a
                                     replica on the other node, writes each
                                     rank's shard digest to OUT
    two_nodes_train.py restore OUT   loads the newest node-safe checkpoint
                                     and checks each rank's shard against
                                     OUT's digests
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter, latest_checkpoint

JOB = "two-nodes-example"


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def digest(model, opt) -> str:
    """sha256 of this rank's shards of the model and optimizer state."""
    msd, osd = get_state_dict(model, opt)
    h = hashlib.sha256()

    def walk(value) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                walk(value[k])
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())

    walk({"model": msd, "optim": osd})
    return h.hexdigest()


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = model_and_optimizer()
    if phase == "train":
        writer = MemoffloadWriter(job_id=JOB, replicas=1)
        for step in range(1, 5):
            gen = torch.Generator().manual_seed(100 * step + rank)
            loss = model(torch.randn(8, 64, generator=gen)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer, checkpoint_id="step-4")
        rep = writer.wait_replication()
        (out / f"digest-rank{rank}").write_text(digest(model, opt))
        if rank == 0:
            print(f"saved step-4: node-safe {rep.node_safe} {rep.why}".rstrip(), flush=True)
        if not rep.node_safe:
            raise SystemExit(f"rank {rank}: step-4 is not node-safe: {rep.why}")
    else:
        ckpt = latest_checkpoint(job_id=JOB, node_safe=True)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        reader = MemoffloadReader(job_id=JOB)
        dcp.load(state, checkpoint_id=ckpt, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        same = digest(model, opt) == (out / f"digest-rank{rank}").read_text()
        remote = sorted(r for r, where in reader.last_sources.items() if where != "local daemon")
        print(json.dumps({"rank": rank, "restored": ckpt, "bit_identical": same,
                          "from_other_node": remote}), flush=True)
        if not same:
            raise SystemExit(f"rank {rank}: the restored state differs from the saved one")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MEMOFFLOAD_JOB_ID", JOB)
    main()
