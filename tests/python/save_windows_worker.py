"""One rank of the save-window table (test_save_windows.py): for each cell
(window x on_error) it saves a previous checkpoint to files, then starts a
``dcp.async_save`` that the test stops at the cell's window
($MEMOFFLOAD_TEST_SAVE_PAUSE) while it SIGKILLs a daemon, and records where
the save went. Once the test has restarted the daemon: the latest
checkpoint, a bit-for-bit load of it, and whether the next save lands in
the daemon. Writes ``<out>/rank<r>.json``.

Files shared with the test, in the pause dir: ``cell-<k>`` (the test is
ready for cell k), ``saved-<k>-<rank>`` (this rank's save of cell k is
over), ``up-<k>`` (the daemons are back), ``done-<k>-<rank>`` (cell k is
over on this rank).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from log_records import Records




def _wait_for(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.005)


def _state(rank: int, step: int) -> Dict[str, Any]:
    """Each rank's own tensors (same names on every rank would be one
    replicated tensor to DCP, written once)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return {f"w{rank}": torch.randn(256, 256, generator=gen),
            f"b{rank}": torch.randn(256, generator=gen), "step": step}


def _bit_equal(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return sorted(a) == sorted(b) and a["step"] == b["step"] and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a if k != "step")


def _previous_in_files(dcp: Any, fallback: str, job: str, rank: int, group: Any) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    from memoffload.torch.checkpoint import store as _store
    from memoffload.torch.checkpoint import trusted_files as _trusted

    path = os.path.join(fallback, "prev")
    if rank == 0:
        _trusted.trusted_fallback_dir(fallback, create=True).close()
    dist.barrier(group)
    dcp.save(_state(rank, 1), storage_writer=FileSystemWriter(path), process_group=group)
    if rank == 0:
        with _trusted.trusted_fallback_dir(fallback) as root:
            _store.write_marker(_trusted.TrustedFileSystem(root), path, job)
    dist.barrier(group)


def main(cfg: Dict[str, Any]) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world"])
    import torch.distributed.checkpoint as dcp

    import memoffload
    from memoffload.torch.checkpoint import (MemoffloadReader, MemoffloadWriter,
                                             latest_checkpoint)
    from memoffload.torch.checkpoint import outcome as _outcome

    records = Records()
    logging.getLogger("memoffload").addHandler(records)
    logging.getLogger("memoffload").setLevel(logging.INFO)
    pause_dir = Path(os.environ["MEMOFFLOAD_TEST_SAVE_PAUSE"])
    group = dist.new_group(backend="gloo")  # the saves' own, as a trainer would
    runtime_dir = cfg["runtime_dirs"][rank]
    cells: List[Dict[str, Any]] = []
    try:
        for k, (window, mode) in enumerate(cfg["cells"]):
            _wait_for(pause_dir / f"cell-{k}")
            job = f"{cfg['job']}-{window}-{mode}"
            fallback = os.path.join(cfg["fallback"], job)
            cell: Dict[str, Any] = {"window": window, "mode": mode}
            # The previous checkpoint, in the fallback dir as a run without a
            # daemon leaves it (the daemon about to be killed would take one
            # of its own with it).
            _previous_in_files(dcp, fallback, job, rank, group)
            hook = _outcome.pause
            writer = MemoffloadWriter(job_id=job, runtime_dir=runtime_dir, fallback_dir=fallback,
                                      on_error=mode, keep_last=None, replicas=cfg["replicas"])
            mark = len(records.lines)
            if window == "a" and hook is not None:
                hook("a", rank)  # the test kills the daemon before the save starts
            saved = _state(rank, 2)
            try:
                pending = dcp.async_save(saved, storage_writer=writer, checkpoint_id="cell",
                                         process_group=group)
                result = writer.result(pending)
                cell.update(where=result.where, why=result.why, code=result.code)
            except Exception as exc:  # noqa: BLE001 - on_error="raise": what it raises
                cell.update(where="raised", error=type(exc).__name__,
                            memoffload_error=isinstance(exc, memoffload.Error),
                            code=int(getattr(exc, "code", 0)), why=str(exc))
            except BaseException as exc:  # noqa: BLE001 - must never happen
                cell.update(where="raised", error=type(exc).__name__, base=True, why=str(exc))
            if cfg["replicas"]:
                rep = writer.wait_replication()
                cell["node_safe"] = bool(rep and rep.node_safe)
            cell["warnings"] = [line for line in records.lines[mark:] if line.startswith("WARN")]
            (pause_dir / f"saved-{k}-{rank}").touch()
            _wait_for(pause_dir / f"up-{k}")
            dist.barrier()
            latest = latest_checkpoint(job_id=job, runtime_dir=runtime_dir, fallback_dir=fallback)
            cell["latest"] = latest
            if latest is not None:
                state = {f"w{rank}": torch.zeros(256, 256), f"b{rank}": torch.zeros(256),
                         "step": -1}
                reader = MemoffloadReader(job_id=job, runtime_dir=runtime_dir,
                                          fallback_dir=fallback)
                dcp.load(state, storage_reader=reader, checkpoint_id=latest)
                cell["loaded_from"] = reader.last_mode
                cell["bit_exact"] = _bit_equal(state, _state(rank, 2 if latest == "cell" else 1))
            dist.barrier()
            after = writer.result(dcp.async_save(_state(rank, 3), storage_writer=writer,
                                                 checkpoint_id="next", process_group=group))
            cell["next"] = after.where
            writer.close()
            cells.append(cell)
            dist.barrier()
            (pause_dir / f"done-{k}-{rank}").touch()
    finally:
        Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps({"cells": cells},
                                                                  default=str))
        sys.stdout.flush()
    dist.destroy_process_group()  # gloo's threads end before the interpreter's


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
