"""One rank of two ``dcp.async_save`` in flight at once (test_save_queue.py):
the first save's commit is slowed down on the coordinator, and every rank
starts the second before the first is over. Writes ``<out>/rank<r>.json``
with where each save went, what was logged, and the state loaded back.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist

from log_records import Records




def main(runtime_dir: str, job: str, out: str, slow_s: float) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import torch.distributed.checkpoint as dcp

    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter

    records = Records()
    logging.getLogger("memoffload").addHandler(records)
    logging.getLogger("memoffload").setLevel(logging.INFO)
    group = dist.new_group(backend="gloo")
    writer = MemoffloadWriter(job_id=job, runtime_dir=runtime_dir, keep_last=None)
    finish = writer.finish

    def slow_finish(*args: Any, **kwargs: Any) -> None:
        if writer.checkpoint_id == "first":
            time.sleep(slow_s)
        finish(*args, **kwargs)

    writer.finish = slow_finish
    states = {name: {f"t{rank}": torch.full((1 << 16,), float(i + 10 * rank))}
              for i, name in enumerate(("first", "second"))}
    result: Dict[str, Any] = {"rank": rank}
    t = time.monotonic()
    first = dcp.async_save(states["first"], storage_writer=writer, checkpoint_id="first",
                           process_group=group)
    second = dcp.async_save(states["second"], storage_writer=writer, checkpoint_id="second",
                            process_group=group)
    result["second_started_s"] = time.monotonic() - t
    result["first"] = writer.result(first).where
    result["second"] = writer.result(second).where
    writer.close()
    dist.barrier()
    for name, saved in states.items():
        state = {f"t{rank}": torch.zeros(1 << 16)}
        dcp.load(state, storage_reader=MemoffloadReader(job_id=job, runtime_dir=runtime_dir),
                 checkpoint_id=name)
        result[f"{name}_loaded"] = torch.equal(state[f"t{rank}"], saved[f"t{rank}"])
    result["log"] = records.lines
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    # Gloo's threads ended before the interpreter's (an exit with the groups
    # alive aborted once: "terminate called without an active exception").
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
