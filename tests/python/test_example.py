"""The LibTorch example trainer (explicit API) against the real daemon."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from conftest import bin_dir


def test_example_trainer(daemon):
    exe = bin_dir() / "memoffload-torch-example"
    if not exe.exists():
        pytest.skip(f"{exe} not built (MEMOFFLOAD_BUILD_TORCH=OFF?)")
    out = subprocess.run(
        [str(exe), "--runtime-dir", daemon.runtime_dir, "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical to training without offload" in out.stdout
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(line.endswith("gradients identical") for line in steps)
    # Only the attach blocks: every group was prefetched before it was needed.
    assert all("blocking_rpcs 1 " in line for line in steps), steps
    # Cumulative counters of the example's offloader: every step moved bytes
    # through the arena and read all of them back; nothing stayed behind.
    counts = [
        tuple(int(v) for v in re.search(
            r"offloaded (\d+) B prefetched (\d+) B skipped (\d+) B", line).groups())
        for line in steps
    ]
    previous = (0, 0, 0)
    for offloaded, prefetched, skipped in counts:
        assert offloaded > previous[0] and prefetched > previous[1], counts
        assert skipped == 0, counts
        previous = (offloaded, prefetched, skipped)
    assert counts[-1][0] == counts[-1][1], counts  # everything offloaded came back
    deadline = time.monotonic() + 5  # the daemon notices the exit on its lifeline
    while (s := daemon.status())["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s["used_bytes"] == 0 and s["groups"] == 0 and s["sessions"] == 0, s
