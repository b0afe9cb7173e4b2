"""One rank of ``dcp.async_save`` with MemoffloadWriter as its own stager,
under real FSDP2 on CPU (gloo), started by mp.spawn from test_async_stage.py.

Each rank shards a small decoder stack, trains a step with AdamW, keeps a
copy of its model and optimizer state dicts, and starts an async save on a
gloo group of its own (so that the background save never races training's
collectives). It trains on while the save runs, then waits for it, loads the
checkpoint into a freshly made model and optimizer, and compares them bit
for bit with the copy taken at the save. Writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import fsdp_decoder_and_adamw as _model_and_opt  # noqa: E402
from models import local_copies as _flat  # noqa: E402
from models import tokens  # noqa: E402


def _step(model, opt, seed: int) -> None:
    opt.zero_grad()
    model(tokens(batch=2, length=16).random_(0, 97, generator=torch.Generator().manual_seed(seed))).backward()
    opt.step()


def run(rank: int, world_size: int, port: int, runtime_dir: str, out_dir: str, job_id: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter

    result: Dict[str, Any] = {"rank": rank, "mismatches": []}
    try:
        model, opt = _model_and_opt()
        _step(model, opt, 0)
        msd, osd = get_state_dict(model, opt)
        saved = _flat({"model": msd, "optim": osd})
        writer = MemoffloadWriter(job_id=job_id, runtime_dir=runtime_dir)
        group = dist.new_group(backend="gloo")
        t = time.perf_counter()
        fut = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer,
                             checkpoint_id="async-1", process_group=group)
        result["blocked_s"] = time.perf_counter() - t
        result["staged"] = writer.last_staged
        _step(model, opt, 1)  # training goes on while the save runs
        fut.result()
        result["mode"] = writer.last_mode
        writer.close()
        dist.barrier()
        fresh, fresh_opt = _model_and_opt()
        _step(fresh, fresh_opt, 5)  # other values, so that a load that did nothing shows
        fmsd, fosd = get_state_dict(fresh, fresh_opt)
        state = {"model": fmsd, "optim": fosd}
        dcp.load(state, storage_reader=MemoffloadReader(job_id=job_id, runtime_dir=runtime_dir),
                 checkpoint_id="async-1")
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        loaded = _flat(dict(zip(("model", "optim"), get_state_dict(fresh, fresh_opt))))
        if sorted(loaded) != sorted(saved):
            result["mismatches"].append(f"keys {sorted(set(loaded) ^ set(saved))}")
        for key in saved:
            if key in loaded and not torch.equal(loaded[key].reshape(-1).view(torch.uint8),
                                                 saved[key].reshape(-1).view(torch.uint8)):
                result["mismatches"].append(key)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
        dist.barrier()
        dist.destroy_process_group()
