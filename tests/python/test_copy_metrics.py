"""The torch offloader reports its copies to the daemon (bytes and seconds with
Commit and Release): after a training step with offload, the daemon's
memoffload_client_copy_{bytes,seconds}_total grew in both directions.

Commit 769031a fixed an offloader that sent the bytes with 0 seconds (so the
daemon dropped them and the copy throughput panel had no data); this is the
test that would have caught it. Uses its own daemon with metrics enabled (the
shared fixtures run without metrics)."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Dict, Iterator

import pytest
import torch

import memoffload.torch as mot
from conftest import Daemon, bin_dir
from models import DecoderStack, tokens

SERIES = re.compile(
    r'^(memoffload_client_copy_(?:bytes|seconds)_total)\{direction="(offload|prefetch)"\} (\S+)$',
    re.M)


class MetricsDaemon(Daemon):
    """conftest's Daemon with the metrics listener on a free loopback port."""

    def start(self) -> "MetricsDaemon":
        exe = bin_dir() / "memoffloadd"
        if not exe.exists():
            pytest.fail(f"{exe} not found: build it or set MEMOFFLOAD_BIN_DIR")
        self.proc = subprocess.Popen(
            [str(exe), f"--runtime-dir={self.runtime_dir}", f"--arena-size={self.arena}",
             f"--chunk-size={self.chunk}", "--metrics-address=127.0.0.1:0",
             "--prefault-threads=1", "--log-level=warn"],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"memoffloadd exited with {self.proc.returncode}: "
                            f"{self.log.read_text()}")
            r = subprocess.run([str(bin_dir() / "memoffloadctl"), "--runtime-dir",
                                self.runtime_dir, "--json", "status"],
                               capture_output=True, text=True, timeout=10)
            if r.returncode == 0:
                status = json.loads(r.stdout)
                self.metrics_address = status.get("metricsAddress") or status["metrics_address"]
                return self
            time.sleep(0.05)
        pytest.fail("memoffloadd did not answer within 20 s")

    def copy_counters(self) -> Dict[tuple, float]:
        """{(family, direction): value} of the client copy counters."""
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {(m.group(1), m.group(2)): float(m.group(3)) for m in SERIES.finditer(text)}


@pytest.fixture
def metrics_daemon(tmp_path: Path) -> Iterator[MetricsDaemon]:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    d = MetricsDaemon(rt, "256MiB", "64MiB").start()
    yield d
    mot.forget_offloader(d.runtime_dir)
    d.stop()


def test_offload_step_reports_copy_bytes_and_seconds_in_both_directions(metrics_daemon):
    keys = [(f"memoffload_client_copy_{kind}_total", direction)
            for kind in ("bytes", "seconds") for direction in ("offload", "prefetch")]
    before = metrics_daemon.copy_counters()
    assert set(before) == set(keys), before
    assert all(v == 0 for v in before.values()), before

    torch.manual_seed(0)
    model = DecoderStack(layers=3)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0,
                                runtime_dir=metrics_daemon.runtime_dir)
    try:
        for _ in range(2):
            model.zero_grad()
            model(tokens(4, 32)).float().pow(2).mean().backward()
        stats = handle.stats()
    finally:
        handle.remove()
    assert stats["offloaded_bytes"] > 0 and stats["prefetched_bytes"] > 0, stats

    # Commit and Release go out asynchronously, one group at a time: wait until
    # every group of the step is counted in both directions (or fail naming
    # what is missing). Waiting only for the counters to grow raced with the
    # last group's Release (CI saw 3 of 4 groups counted).
    def complete(counters: Dict[tuple, float]) -> bool:
        return all(counters[("memoffload_client_copy_bytes_total", d)] >= stats["offloaded_bytes"]
                   and counters[("memoffload_client_copy_seconds_total", d)] > 0
                   for d in ("offload", "prefetch"))

    deadline = time.monotonic() + 10
    while True:
        after = metrics_daemon.copy_counters()
        if complete(after) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    grown = {k: after[k] > before[k] for k in keys}
    assert all(grown.values()), f"did not grow: {[k for k, g in grown.items() if not g]}; {after}"
    for direction in ("offload", "prefetch"):
        copied = after[("memoffload_client_copy_bytes_total", direction)]
        seconds = after[("memoffload_client_copy_seconds_total", direction)]
        # Every group of the step is reported: all the offloaded bytes.
        assert copied == stats["offloaded_bytes"], (direction, copied, stats)
        assert 0 < seconds < 60, (direction, seconds)
