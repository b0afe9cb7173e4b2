#!/usr/bin/env python3
"""The pause a take-over costs the clients (docs/restarts.md, "Sessions
resume"), against the same load without one, in the same run, rounds
alternated, median and spread.

``--clients`` processes (``memoffload-bench pause-worker``) each cycle
64 KiB groups against one daemon for ``--seconds``: reserve, write, commit
with checksums, four in flight, then prefetch, read back, compare, release;
every call timed. In a ``takeover`` round ``memoffloadd --take-over`` takes
the node a third of the way in: each client's longest call is the pause it
saw (its calls wait and are sent again; its session resumes). In a
``steady`` round nothing happens: the longest call under the same load,
the noise floor. Every client must end with no error, no mismatch, and (in
a take-over round) one resume of its own session.

With ``--mode restart`` the daemon keeps its state in a keeper
(``memoffloadd keeper``, as in a container) and the round's event is a
restart instead: SIGTERM (the sessions are kept), then the next daemon is
started as soon as the old one has exited, as systemd does; the sessions
resume on it.

    MEMOFFLOAD_BIN_DIR=build/bin python3 bench/takeover_pause_bench.py [--mode takeover|restart] [--clients 64] [--seconds 6] [--rounds 3] [--arena-size 512MiB] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("MEMOFFLOAD_BIN_DIR", REPO / "build" / "bin"))
ARGS = ["--arena-size=512MiB", "--chunk-size=32MiB", "--metrics-address=none"]


def quantile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spread(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def wait_serving(rt: Path, proc: subprocess.Popen, log: Path) -> None:
    while subprocess.run([str(BIN / "memoffloadctl"), "--runtime-dir", str(rt), "status"],
                         capture_output=True).returncode != 0:
        assert proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.02)


def one_round(tmp: Path, clients: int, seconds: float, takeover: bool,
              mode: str) -> Dict[str, object]:
    rt = tmp / f"rt-{time.monotonic_ns()}"
    rt.mkdir(mode=0o700)
    log = tmp / "daemon.log"
    keeper = None
    store = ["--state-store=none"]
    if mode == "restart":
        keeper = subprocess.Popen([str(BIN / "memoffloadd"), "keeper", f"--runtime-dir={rt}"],
                                  stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        while not (rt / "keeper.sock").exists():
            assert keeper.poll() is None, log.read_text()[-2000:]
            time.sleep(0.01)
        store = ["--state-store=keeper"]
    daemon = subprocess.Popen([str(BIN / "memoffloadd"), f"--runtime-dir={rt}", *ARGS, *store],
                              stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    wait_serving(rt, daemon, log)
    workers = [subprocess.Popen([str(BIN / "memoffload-bench"), "pause-worker", str(rt),
                                 str(seconds), str(i)], stdout=subprocess.PIPE, text=True)
               for i in range(clients)]
    serving = daemon
    took = None
    if takeover and mode == "takeover":
        time.sleep(seconds / 3)
        t0 = time.monotonic()
        serving = subprocess.Popen([str(BIN / "memoffloadd"), f"--runtime-dir={rt}", *ARGS,
                                    *store, "--take-over"], stdout=open(log, "ab"),
                                   stderr=subprocess.STDOUT)
        assert daemon.wait(timeout=60) == 0, log.read_text()[-3000:]
        took = time.monotonic() - t0
    elif takeover:
        time.sleep(seconds / 3)
        t0 = time.monotonic()
        daemon.terminate()
        assert daemon.wait(timeout=60) == 0, log.read_text()[-3000:]
        serving = subprocess.Popen([str(BIN / "memoffloadd"), f"--runtime-dir={rt}", *ARGS,
                                    *store], stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        wait_serving(rt, serving, log)
        took = time.monotonic() - t0
    lines = [w.communicate(timeout=seconds + 120)[0].split() for w in workers]
    serving.terminate()
    serving.wait(timeout=60)
    if keeper is not None:
        keeper.terminate()
        keeper.wait(timeout=30)
    pauses, calls, resumes = [], 0, 0
    for i, line in enumerate(lines):
        assert line and line[0] == "PAUSE", f"client {i}: {line}"
        _, _, n, errors, mismatches, longest, resumed = line
        assert errors == "0" and mismatches == "0", f"client {i}: {line}"
        assert int(resumed) == (1 if takeover else 0), f"client {i}: {line}"
        pauses.append(float(longest) / 1000)
        calls += int(n)
        resumes += int(resumed)
    return {"pauses": pauses, "calls": calls, "resumes": resumes, "event_s": took}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("takeover", "restart"), default="takeover")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arena-size", default="512MiB",
                    help="the daemon's arena (a restart's cost grew with it before it kept "
                         "the chunks no process was handed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ARGS[0] = f"--arena-size={args.arena_size}"
    out: Dict[str, List[float]] = {"event_p99_s": [], "event_max_s": [],
                                   "event_median_s": [], "steady_p99_s": [],
                                   "steady_max_s": [], "ratio_p99": [], "event_s": []}
    with tempfile.TemporaryDirectory(prefix="memoffload-pause-") as d:
        tmp = Path(d)
        for _ in range(args.rounds):
            steady = one_round(tmp, args.clients, args.seconds, False, args.mode)
            moved = one_round(tmp, args.clients, args.seconds, True, args.mode)
            out["steady_p99_s"].append(quantile(steady["pauses"], 0.99))
            out["steady_max_s"].append(max(steady["pauses"]))
            out["event_p99_s"].append(quantile(moved["pauses"], 0.99))
            out["event_max_s"].append(max(moved["pauses"]))
            out["event_median_s"].append(statistics.median(moved["pauses"]))
            out["ratio_p99"].append(out["event_p99_s"][-1] / out["steady_p99_s"][-1])
            out["event_s"].append(moved["event_s"])
    result = {k: spread(v) for k, v in out.items()}
    result["mode"] = args.mode
    result["arena"] = args.arena_size
    result["clients"] = args.clients
    result["rounds"] = args.rounds
    if args.json:
        print(json.dumps(result))
        return
    # event: the take-over or the restart (event_s: from its start until the
    # old daemon exited, or until the next one served).
    for key, s in result.items():
        if isinstance(s, dict):
            print(f"{key:20s} median {s['median']:.3f}  ({s['min']:.3f} .. {s['max']:.3f})")
    print(f"{args.mode}: {args.clients} clients, {args.arena_size} arena, {args.rounds} rounds; every group read back "
          f"bit for bit, no call failed, every session resumed once per {args.mode}")


if __name__ == "__main__":
    sys.exit(main())
