#!/usr/bin/env python3
"""``dcp.async_save`` into the daemon: the time the training loop is blocked
per save with MemoffloadWriter staging straight into the checkpoint's region,
against DCP's ``DefaultStager`` (shared memory, pinned where there is a GPU)
in front of the same writer, alternated in one run. CPU here; the GPU kit
runs it with pinned staging.

Per save: ``blocked_s`` (async_save's call, which stages), ``total_s``
(until the save's future is done), and ``staging_copies``: the bytes of the
staged state that are not the checkpoint's own region, over the state's
bytes (DefaultStager: its buffer, kept between saves; MemoffloadWriter: the
staged tensors are the region). Prints one JSON object: median, min and max
per mode, and the ratios MemoffloadWriter / DefaultStager of the medians.

    MEMOFFLOAD_BIN_DIR=build/bin .venv/bin/python bench/async_save_bench.py [--size 256MiB] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

import torch_bench  # noqa: E402  (this folder)
from memoffload.torch.checkpoint import MemoffloadWriter  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def make_state(size: int, device: str, tensors: int = 16) -> Dict[str, Any]:
    per = size // tensors // 4
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(per, generator=g).to(device) for i in range(tensors)},
            "step": 1}


class Recording:
    """An AsyncStager in front of another that records how many staged bytes
    are outside the checkpoint's region."""

    _synchronize_after_execute = False

    def __init__(self, inner: Any, writer: MemoffloadWriter) -> None:
        self.inner, self.writer = inner, writer
        self.outside = 0

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        staged = self.inner.stage(state_dict)
        region = self.writer._staged if self.inner is self.writer else None
        self.outside = 0
        for t in staged["model"].values():
            if region is None or region.locate(t) is None:
                self.outside += t.numel() * t.element_size()
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        if self.inner is not self.writer:
            self.inner.close()


def one_save(mode: str, writer: MemoffloadWriter, stager: Recording, state: Dict[str, Any],
             ckpt: str) -> Dict[str, float]:
    t = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=ckpt, async_stager=stager)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a stager's non-blocking copies are part of the staging
    blocked = time.perf_counter() - t
    fut.result()
    total = time.perf_counter() - t
    state_bytes = sum(v.numel() * v.element_size() for v in state["model"].values())
    return {"blocked_s": blocked, "total_s": total, "staging_copies": stager.outside / state_bytes}


def summarize(rows: List[Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    return {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where the state lives (cuda: the GPU kit)")
    args = parser.parse_args()
    size = parse_size(args.size)
    torch.set_num_threads(1)
    state = make_state(size, args.device)
    # Per mode a checkpoint kept, the next one and its staged copy: room
    # for 8 states, all of it for regions.
    arena_mib = max(256, 8 * size // MiB + 64)
    with tempfile.TemporaryDirectory() as tmp:
        rt = os.path.join(tmp, "rt")
        os.mkdir(rt, 0o700)
        daemon = torch_bench.start_daemon(
            rt, arena=f"{arena_mib}MiB", chunk=f"{min(1024, arena_mib)}MiB",
            extra=[f"--regions-max-bytes={arena_mib}MiB", "--regions-uid-max-bytes=0"])
        try:
            pinned = args.device == "cuda"
            runs: Dict[str, List[Dict[str, float]]] = {"default_stager": [], "memoffload": []}
            writers = {m: MemoffloadWriter(job_id=f"bench-{m}", runtime_dir=rt, keep_last=1)
                       for m in runs}
            stagers = {
                "default_stager": Recording(DefaultStager(StagingOptions(pinned, True, False, False)),
                                            writers["default_stager"]),
                "memoffload": Recording(writers["memoffload"], writers["memoffload"]),
            }
            for i in range(args.rounds + 1):  # the first round warms both up
                order = list(runs) if i % 2 == 0 else list(reversed(runs))
                for mode in order:
                    row = one_save(mode, writers[mode], stagers[mode], state, f"r{i}")
                    if i > 0:
                        runs[mode].append(row)
            for mode in runs:
                stagers[mode].close()
                writers[mode].close()
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    d, m = summarize(runs["default_stager"]), summarize(runs["memoffload"])
    print(json.dumps({
        "bench": "async_save", "state_bytes": size, "rounds": args.rounds, "device": args.device,
        "pinned": pinned,
        "default_stager": d, "memoffload": m,
        "ratio_memoffload_over_default": {
            k: m[k]["median"] / d[k]["median"] for k in ("blocked_s", "total_s")},
    }))


if __name__ == "__main__":
    main()
