"""bench/gpu_bench.py is only measured on a GPU; here its code runs on the CPU
(--cpu-smoke) so that the script itself cannot rot, and without a device it
must say so and exit 77 (CTest's skip code for the gpu label)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_bench.py")


def test_without_a_device_it_exits_77_with_a_message():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: `ctest -L gpu` runs the benchmark itself")
    r = subprocess.run([sys.executable, BENCH], capture_output=True, text=True, timeout=120)
    assert r.returncode == 77, r
    assert "no CUDA device" in r.stderr


def test_cpu_smoke_prints_every_figure_next_to_its_baseline():
    r = subprocess.run([sys.executable, BENCH, "--cpu-smoke"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row["bench"]: row for row in map(json.loads, r.stdout.splitlines())}
    assert set(rows) == {"gpu_info", "gpu_copies", "gpu_register", "gpu_checkpoint", "gpu_overlap",
                         "gpu_step"}, rows
    ckpt = rows["gpu_checkpoint"]
    for key in ("save_arena", "load_arena", "save_disk", "load_disk"):
        assert ckpt[f"{key}_gbps"] > 0, ckpt
    assert ckpt["bytes"] == 8 << 20 and ckpt["save_arena_vs_disk"] > 0, ckpt
    register = rows["gpu_register"]
    assert register["attach_s"] > 0 and register["attach_register_s"] > 0, register
    assert register["engines"] == ["host", "host"], register  # no CUDA device here
    assert register["register_s_per_gib"] >= 0, register
    for direction in ("d2h", "h2d"):
        for path in ("arena", "pinned", "pageable"):
            assert rows["gpu_copies"][f"{direction}_{path}_gbps"] > 0
        assert rows["gpu_copies"][f"{direction}_arena_vs_pinned"] > 0
    assert {"compute_s", "copies_s", "both_s", "overlap"} <= set(rows["gpu_overlap"])
    step = rows["gpu_step"]
    for variant in ("none", "offload", "pinned_pool"):
        assert step[f"{variant}_step_s"] > 0
    assert step["offloaded_bytes"] > 0, step
    assert step["offload_vs_none"] > 0 and step["offload_vs_pinned_pool"] > 0
