"""One rank of a 2-rank gloo job (plain processes, started by
test_errors.py) that makes DCP saves fail in the daemon the way a trainer
meets it, and writes what each rank caught to ``<out>/rank<r>.json``:

    python errors_worker.py '<json config>'      # RANK, WORLD_SIZE, MASTER_* in env

* ``already_exists``: "step-2" saved twice (the daemon keeps the first);
* ``resource_exhausted``: a save whose regions do not fit the daemon's arena.

DCP moves a rank's exception to the others by pickling it (gather, then
broadcast), so each text below has crossed processes at least once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from memoffload.torch.checkpoint import MemoffloadWriter


def caught(exc: BaseException) -> Dict[str, Any]:
    """The CheckpointException's text and each rank's failure as DCP hands it on."""
    out: Dict[str, Any] = {"type": type(exc).__name__, "text": str(exc), "failures": {}}
    if isinstance(exc, CheckpointException):
        for rank, failure in exc.failures.items():
            inner = failure[0] if isinstance(failure, tuple) else failure
            out["failures"][str(rank)] = {
                "type": type(inner).__name__,
                "text": str(inner),
                "code": getattr(getattr(inner, "code", None), "name", None),
            }
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    writer_kw = dict(job_id=cfg["job_id"], runtime_dir=cfg["runtime_dir"],
                     fallback_dir=cfg["fallback_dir"], keep_last=None)
    result: Dict[str, Any] = {"rank": rank}
    try:
        small = {"w": torch.full((64,), float(rank))}
        dcp.save(small, storage_writer=MemoffloadWriter(**writer_kw), checkpoint_id="step-2")
        try:
            dcp.save(small, storage_writer=MemoffloadWriter(**writer_kw), checkpoint_id="step-2")
            result["already_exists"] = None
        except CheckpointException as exc:  # a BaseException
            result["already_exists"] = caught(exc)
        big = {"w": torch.zeros(cfg["big_bytes"] // 4, dtype=torch.float32)}
        try:
            # on_error="raise": a save that can never fit would go to the fallback.
            dcp.save(big, storage_writer=MemoffloadWriter(**writer_kw, on_error="raise"),
                     checkpoint_id="big")
            result["resource_exhausted"] = None
        except CheckpointException as exc:
            result["resource_exhausted"] = caught(exc)
    finally:
        Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
