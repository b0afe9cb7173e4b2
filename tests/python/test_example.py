"""The LibTorch example trainer (explicit API) against the real daemon."""

from __future__ import annotations

import subprocess

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
