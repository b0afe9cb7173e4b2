#!/usr/bin/env python3
"""The one-line summary of a GPU kit run, from its results.jsonl.

    summarize.py RESULTS SECONDS "FAILED STEPS"

Names the device, driver and torch, each step's outcome, and the figures
that have targets (issue 28), each as the ratio to its same-run baseline.
"""

from __future__ import annotations

import json
import sys


def fmt(value, digits: int = 2) -> str:
    return "?" if value is None else f"{value:.{digits}f}"


def main() -> int:
    path, seconds, failed = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    machine = next((r for r in rows if r.get("step") == "machine"), {})
    device = machine.get("device") or "no CUDA device (cpu smoke: the figures mean nothing)"
    parts = [f"memoffload gpu kit: {device}, driver {machine.get('driver') or '?'}, "
             f"torch {machine.get('torch', '?')}, python {machine.get('python', '?')}"]
    steps = [f"{r['step']} {r['status']} ({r['seconds']}s)" for r in rows if "status" in r
             and isinstance(r.get("status"), str)]
    parts.append("; ".join(steps) or "no step ran")
    figures = []
    for r in rows:
        bench = r.get("bench")
        if bench == "gpu_copies":
            figures.append(f"copies {r['bytes'] >> 20} MiB arena/pinned d2h "
                           f"{fmt(r.get('d2h_arena_vs_pinned'))} h2d {fmt(r.get('h2d_arena_vs_pinned'))}")
        elif bench == "gpu_overlap":
            figures.append(f"overlap {fmt(r.get('overlap'))}")
        elif bench == "gpu_step":
            figures.append(f"step offload/none {fmt(r.get('offload_vs_none'))} "
                           f"offload/save_on_cpu {fmt(r.get('offload_vs_pinned_pool'))}")
        elif bench == "gpu_register":
            figures.append(f"registration {fmt(r.get('register_s_per_gib'), 3)} s/GiB")
        elif bench == "gpu_checkpoint":
            figures.append(f"checkpoint vs disk save {fmt(r.get('save_arena_vs_disk'))} "
                           f"load {fmt(r.get('load_arena_vs_disk'))}")
        elif bench == "attach":
            figures.append(f"attach first write{' (hugepages)' if r.get('hugepages') else ''} "
                           f"{fmt(r.get('ratio'))}x memcpy")
    if figures:
        parts.append("; ".join(figures))
    parts.append(f"{seconds}s in all: " + ("FAILED: " + ", ".join(failed) if failed else "ok"))
    print(" | ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
