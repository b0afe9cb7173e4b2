#!/usr/bin/env python3
"""A restart that keeps the node (docs/restarts.md), against one that does not,
measured in the same run, rounds alternated, median and spread:

- ``kept``: a daemon beside a keeper, its arena holding ``--fill`` bytes of
  checkpoint regions (64 MiB each, with CRC32Cs), is SIGKILLed and started
  again: the time from the new process's exec until it answers, and the
  part of it spent taking the state back (reading the journal, verifying
  every region's CRC32Cs, placing them: ``memoffload_state_recovery_seconds``,
  from its log line).
- ``empty``: the same daemon (same arena size, ``--state-store=none``)
  started with nothing to keep: what every restart cost before.
- ``takeover``: ``memoffloadd --take-over`` takes the node (idle sessions,
  no groups to drain) from the daemon serving it: the time from the new
  process's exec until the old one exited, and the longest gap a client
  polling the daemon's status every millisecond saw (the node's pause).

Every kept region is then read back and compared.

    MEMOFFLOAD_BIN_DIR=build/bin .venv/bin/python bench/restart_bench.py [--arena 2GiB] [--fill 1536MiB] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402,F401  (loads libtorch for memoffload._C)

from async_save_bench import parse_size  # noqa: E402
from memoffload import _C  # noqa: E402
import memoffload.torch as mot  # noqa: E402

MiB = 1 << 20
REGION = 64 * MiB
BIN = Path(os.environ.get("MEMOFFLOAD_BIN_DIR", REPO / "build" / "bin"))


def spread(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# Every daemon the bench started (killed at the end, whatever happened).
started: List[subprocess.Popen] = []


def start(rt: Path, log: Path, arena: str, *extra: str) -> tuple[subprocess.Popen, float]:
    """Starts a daemon; returns it and the seconds until it answered."""
    t0 = time.monotonic()
    proc = subprocess.Popen([str(BIN / "memoffloadd"), f"--runtime-dir={rt}", f"--arena-size={arena}",
                             "--chunk-size=256MiB", "--metrics-address=none", "--prefault-threads=2",
                             f"--regions-max-bytes={arena}", "--regions-uid-max-bytes=0",
                             *extra], stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    started.append(proc)
    while True:
        assert proc.poll() is None, log.read_text()[-2000:]
        probe = subprocess.run([str(BIN / "memoffloadctl"), "--runtime-dir", str(rt), "status"],
                               capture_output=True)
        if probe.returncode == 0:
            return proc, time.monotonic() - t0
        time.sleep(0.01)


def take_over(old: subprocess.Popen, rt: Path, log: Path, arena: str):
    """Runs a take-over of `old` while a client polls; returns ((the new
    daemon, seconds until the old one exited), the longest polling gap)."""
    stamps: List[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                mot.daemon_status(str(rt), timeout_ms=5000)
                stamps.append(time.monotonic())
            except Exception:
                pass
            time.sleep(0.001)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    new = subprocess.Popen([str(BIN / "memoffloadd"), f"--runtime-dir={rt}", f"--arena-size={arena}",
                            "--chunk-size=256MiB", "--metrics-address=none",
                            "--prefault-threads=2", f"--regions-max-bytes={arena}",
                            "--regions-uid-max-bytes=0", "--state-store=keeper", "--take-over"],
                           stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    started.append(new)
    assert old.wait(timeout=120) == 0, log.read_text()[-2000:]
    seconds = time.monotonic() - t0
    time.sleep(0.3)
    stop.set()
    poller.join()
    assert new.poll() is None, log.read_text()[-2000:]
    window = [t for t in stamps if t >= t0 - 0.1]
    gap = max(b - a for a, b in zip(window, window[1:]))
    return (new, seconds), gap


def pattern(i: int) -> bytes:
    return bytes([(i * 37 + 11) % 256]) * REGION


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arena", default="2GiB")
    ap.add_argument("--fill", default="1536MiB")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    regions = parse_size(args.fill) // REGION
    tmp = Path(tempfile.mkdtemp(prefix="mo-restart-bench-"))
    kept_rt, empty_rt = tmp / "kept", tmp / "empty"
    kept_rt.mkdir(mode=0o700)
    empty_rt.mkdir(mode=0o700)
    keeper = subprocess.Popen([str(BIN / "memoffloadd"), "keeper", f"--runtime-dir={kept_rt}"],
                              stdout=open(tmp / "keeper.log", "ab"), stderr=subprocess.STDOUT)
    out: Dict[str, List[float]] = {"kept_start_s": [], "recovery_s": [], "empty_start_s": [],
                                   "takeover_s": [], "takeover_gap_s": []}
    try:
        while not (kept_rt / "keeper.sock").exists():
            time.sleep(0.01)
        daemon, _ = start(kept_rt, tmp / "kept.log", args.arena, "--state-store=keeper")
        store = _C.RegionStore(runtime_dir=str(kept_rt), job_id="bench", rank=0)
        for i in range(regions):
            w = store.create(f"r{i}", REGION)
            w.append(pattern(i))
            w.commit()
        store.close()
        for _ in range(args.rounds):
            daemon.send_signal(signal.SIGKILL)
            daemon.wait()
            before = (tmp / "kept.log").read_text()
            daemon, seconds = start(kept_rt, tmp / "kept.log", args.arena, "--state-store=keeper")
            line = re.search(r"recovered the node .*?: (\d+) of (\d+) checkpoint regions .*? in "
                             r"([0-9.]+) s", (tmp / "kept.log").read_text()[len(before):])
            assert line and int(line.group(1)) == regions, (tmp / "kept.log").read_text()[-2000:]
            out["kept_start_s"].append(seconds)
            out["recovery_s"].append(float(line.group(3)))
            empty, seconds = start(empty_rt, tmp / "empty.log", args.arena, "--state-store=none")
            out["empty_start_s"].append(seconds)
            empty.terminate()
            empty.wait()
        for _ in range(args.rounds):
            seconds, gap = take_over(daemon, kept_rt, tmp / "kept.log", args.arena)
            daemon = seconds[0]
            out["takeover_s"].append(seconds[1])
            out["takeover_gap_s"].append(gap)
        store = _C.RegionStore(runtime_dir=str(kept_rt), job_id="bench", rank=0)
        for i in range(regions):
            r = store.open(f"r{i}", verify=True)
            assert r.read_bytes(0, REGION) == pattern(i), f"r{i} came back different"
            r.close()
        store.close()
        daemon.terminate()
        daemon.wait()
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        keeper.terminate()
        keeper.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    result = {k: spread(v) for k, v in out.items()}
    kept_bytes = regions * REGION
    result["regions"] = regions
    result["kept_bytes"] = kept_bytes
    result["verify_gb_per_s"] = kept_bytes / 1e9 / result["recovery_s"]["median"]
    result["takeover_gap_ms"] = {k: v * 1000 for k, v in result.pop("takeover_gap_s").items()}
    result["kept_vs_empty_start"] = spread(
        [k / e for k, e in zip(out["kept_start_s"], out["empty_start_s"])])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
