"""The torch layer with its CUDA engine active, on the simulated driver
(tests/cuda_sim, found through LD_LIBRARY_PATH as a real libcuda.so.1 would
be): an attach is one broker round trip (no GetStatus, no second channel;
issue 14 item 4), each arena chunk the session uses is registered with the
driver at its own size, and nothing stays registered once the offloader is
gone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import bin_dir, free_port

# The simulated driver's counters, as tests/cuda_sim/cuda_sim.h has them
# (the start of each script below).
SIM_STATS = r"""
import ctypes, gc, json, sys
import torch

class SimStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "live_events", "pending_work", "registered_ranges", "register_calls",
        "unknown_unregisters", "misuse", "dtoh_copies", "htod_copies",
        "copies_with_pageable_host", "stream_waits", "captured_nodes",
        "captures_invalidated", "device_allocations")]  # as tests/cuda_sim/cuda_sim.h
"""

TRAINER = SIM_STATS + r"""
import memoffload.torch as mot

runtime_dir = sys.argv[1]
off = mot.get_offloader(runtime_dir)
sim = ctypes.CDLL("libcuda.so.1")  # the instance the engine dlopened
sim.sim_stats.restype = SimStats
a = torch.randn(3 << 20)                   # 12 MiB: spans two 8 MiB chunks
b = torch.arange(1 << 18, dtype=torch.int64)
off.offload_group(1, [a, b], 0, -1)
off.flush()
during = sim.sim_stats()
off.prefetch_group(1)
x, y = off.get_group(1, 0)
same = torch.equal(x, a) and torch.equal(y, b)
off.release_group(1)
stats = off.stats()
del off, x, y
mot.forget_offloader(runtime_dir)  # the last reference: the offloader goes
gc.collect()
after = sim.sim_stats()
print(json.dumps({"engine": stats["engine"], "same": same,
                  "unpinned_bytes": stats["unpinned_bytes"],
                  "registered_during": during.registered_ranges,
                  "register_calls": after.register_calls,
                  "registered_after": after.registered_ranges,
                  "unknown_unregisters": after.unknown_unregisters,
                  "misuse": after.misuse}))
"""



def requests_by_method(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    counts: dict = {}
    for m in re.finditer(r'^memoffload_requests_total\{([^}]*)\} (\S+)$', text, re.M):
        method = re.search(r'method="([^"]+)"', m.group(1)).group(1)
        counts[method] = counts.get(method, 0) + float(m.group(2))
    return counts


def test_attach_with_the_cuda_engine_is_one_round_trip_and_registers_every_chunk(tmp_path: Path):
    sim_dir = bin_dir().parent / "cuda_sim"
    if not (sim_dir / "libcuda.so.1").exists():
        pytest.fail(f"{sim_dir}/libcuda.so.1 not built (target cuda_sim)")
    rt = tmp_path / "rt"
    port = free_port()
    log = tmp_path / "memoffloadd.log"
    daemon = subprocess.Popen(
        [str(bin_dir() / "memoffloadd"), f"--runtime-dir={rt}", "--arena-size=20MiB",
         "--chunk-size=8MiB", f"--metrics-address=127.0.0.1:{port}", "--log-level=warn"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                before = requests_by_method(port)
                break
            except OSError:
                assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        env = dict(os.environ, LD_LIBRARY_PATH=str(sim_dir), CUDA_SIM_MAX_DELAY_US="200")
        r = subprocess.run([sys.executable, "-c", TRAINER, str(rt)], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        import json
        got = json.loads(r.stdout.strip().splitlines()[-1])
        after = requests_by_method(port)
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert got["engine"] == "cuda", got
    assert got["same"], got
    calls = {m: after.get(m, 0) - before.get(m, 0) for m in set(after) | set(before)}
    assert calls.get("GetStatus", 0) == 0, f"the attach called GetStatus: {calls}"
    assert calls.get("Reserve", 0) >= 1 and calls.get("Release", 0) >= 1, calls
    # 20 MiB in 8 MiB chunks: 8, 8 and a 4 MiB last one; the 14 MiB group
    # used at least two, each registered once at its own size.
    assert got["registered_during"] >= 2, got
    assert got["register_calls"] == got["registered_during"], got
    assert got["unpinned_bytes"] == 0, f"a chunk stayed unregistered: {got}"
    assert got["registered_after"] == 0, f"registrations outlived the offloader: {got}"
    assert got["unknown_unregisters"] == 0 and got["misuse"] == 0, got


STATE = SIM_STATS + r"""
import memoffload._C as C

store = C.HostStateStore(runtime_dir=sys.argv[1], job_id="state", use_cuda=True)
sim = ctypes.CDLL("libcuda.so.1")  # the instance the engine dlopened
sim.sim_stats.restype = SimStats
blocks = [store.empty(5 << 20) for _ in range(3)]   # 15 MiB: at least two 8 MiB chunks
for i, b in enumerate(blocks):
    b.fill_(i + 1)
during = sim.sim_stats()
stats = store.stats()
same = all(bool((b == i + 1).all()) for i, b in enumerate(blocks))
del blocks, b
gc.collect()
held_after_tensors = store.stats()["tensors"]
del store                          # the last reference: the session's mapping goes
gc.collect()
after = sim.sim_stats()
print(json.dumps({"cuda": stats["cuda"], "unpinned_bytes": stats["unpinned_bytes"],
                  "same": same, "held_after_tensors": held_after_tensors,
                  "registered_during": during.registered_ranges,
                  "register_calls": after.register_calls,
                  "registered_after": after.registered_ranges,
                  "unknown_unregisters": after.unknown_unregisters, "misuse": after.misuse}))
"""


def test_placed_state_registers_its_chunks_and_unregisters_them_before_unmapping(tmp_path: Path):
    """HostStateStore (place_state's) with the CUDA engine on the simulated
    driver: each chunk a block lands in is registered once at its own size
    (nothing left pageable), and every registration is gone, without a
    misuse, once the tensors and the store are."""
    sim_dir = bin_dir().parent / "cuda_sim"
    if not (sim_dir / "libcuda.so.1").exists():
        pytest.fail(f"{sim_dir}/libcuda.so.1 not built (target cuda_sim)")
    rt = tmp_path / "rt"
    log = tmp_path / "memoffloadd.log"
    daemon = subprocess.Popen(
        [str(bin_dir() / "memoffloadd"), f"--runtime-dir={rt}", "--arena-size=32MiB",
         "--chunk-size=8MiB", "--metrics-address=none", "--log-level=warn"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        env = dict(os.environ, LD_LIBRARY_PATH=str(sim_dir), CUDA_SIM_MAX_DELAY_US="200")
        deadline = time.monotonic() + 20
        while not (rt / "broker.sock").exists():
            assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        r = subprocess.run([sys.executable, "-c", STATE, str(rt)], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        import json
        got = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert got["cuda"] and got["same"], got
    assert got["registered_during"] >= 2, got
    assert got["register_calls"] == got["registered_during"], got
    assert got["unpinned_bytes"] == 0, f"a chunk stayed unregistered: {got}"
    assert got["held_after_tensors"] == 0, got
    assert got["registered_after"] == 0, f"registrations outlived the mapping: {got}"
    assert got["unknown_unregisters"] == 0 and got["misuse"] == 0, got
