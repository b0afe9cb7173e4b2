#!/usr/bin/env python3
"""Where a restore from the node spends its time (issue 43), next to DCP's
FileSystemReader from /dev/shm, each in a new process (a restarted job).

    python3 bench/restore_profile.py [--size 128MiB] [--tensors 16] [--rounds 5]
        [--pages 4k|thp|hugetlbfs]

It saves one checkpoint through the daemon with checksums and one without,
and the same state with FileSystemWriter into /dev/shm, then, for each, runs
``--rounds`` restores in fresh processes. Each restore times its phases:

- ``attach``: finding and checking the daemon (the trusted-path walk of the
  runtime dir, the broker's peer check) and the session's attach;
- ``metadata``: opening the ``.metadata`` region, reading and unpickling it;
- ``plan``: DCP's planning around it (``dcp.load`` less the reader's calls);
- ``open``: opening the data regions (the daemon's OpenRegion);
- ``copy``: copying out of the arena, with the checksums of what is copied
  when they are checked as read (a new process maps each page of the arena
  as it reads it: the page-table cost of its page size is here);
- ``verify_rest``: the checksums of what no read covered;
- ``close``: closing the regions.

It prints the median of each phase (ms) and its range, and the total against
FileSystemReader's. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List

import torch
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checkpoint_bench as cb  # noqa: E402

import memoffload.torch as mot  # noqa: E402
from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter  # noqa: E402
from memoffload.torch.checkpoint import store as _store  # noqa: E402

PHASES = ["attach", "metadata", "plan", "open", "copy", "verify_rest", "close", "total"]


class Timer:
    def __init__(self) -> None:
        self.ms: Dict[str, float] = {p: 0.0 for p in PHASES}

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[phase] += (time.perf_counter() - start) * 1e3

        setattr(obj, name, timed)


def child(spec: Dict[str, Any]) -> None:
    """One restore in this (new) process; prints its phases as JSON."""
    torch.set_num_threads(1)
    state = cb.make_state(spec["size"], spec["tensors"])
    dst = cb.empty_like_state(state)
    timer = Timer()
    if spec["kind"] == "shm":
        reader = dcp.FileSystemReader(spec["path"])
        start = time.perf_counter()
        dcp.load(dst, storage_reader=reader, no_dist=True)
        timer.ms["total"] = (time.perf_counter() - start) * 1e3
    else:
        # The reader's pieces, timed where they run.
        timer.wrap(_store, "attach", "attach")

        reader = MemoffloadReader(job_id=spec["job"], runtime_dir=spec["runtime_dir"],
                                  fallback_dir=os.devnull, verify=spec["verify"])
        read_metadata = reader.read_metadata

        def metadata(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return read_metadata(*args, **kwargs)
            finally:
                timer.ms["metadata"] += (time.perf_counter() - start) * 1e3

        reader.read_metadata = metadata
        read_data = reader.read_data

        def data(plan: Any, planner: Any) -> Any:
            store = reader._region_store
            reader._region_store = _TimedStore(store, timer)
            try:
                return read_data(plan, planner)
            finally:
                reader._region_store = store

        reader.read_data = data
        start = time.perf_counter()
        dcp.load(dst, storage_reader=reader, checkpoint_id=spec["checkpoint_id"], no_dist=True)
        timer.ms["total"] = (time.perf_counter() - start) * 1e3
        timer.ms["attach"] = min(timer.ms["attach"], timer.ms["metadata"])
        timer.ms["metadata"] -= timer.ms["attach"]
        accounted = sum(timer.ms[p] for p in PHASES if p not in ("plan", "total"))
        timer.ms["plan"] = timer.ms["total"] - accounted
        _store.forget_all()
    if not cb.same(state, dst):
        raise SystemExit("the restored state differs")
    print(json.dumps(timer.ms), flush=True)


class _TimedStore:
    """The region store, its opens timed and their readers wrapped."""

    def __init__(self, inner: Any, timer: Timer) -> None:
        self._inner = inner
        self._timer = timer

    def open(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        r = self._inner.open(*args, **kwargs)
        self._timer.ms["open"] += (time.perf_counter() - start) * 1e3
        return _TimedRegion(r, self._timer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _TimedRegion:
    """A region reader whose calls add to the timer's phases."""

    def __init__(self, inner: Any, timer: Timer) -> None:
        self._inner = inner
        self._timer = timer

    def _timed(self, phase: str, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._timer.ms[phase] += (time.perf_counter() - start) * 1e3

    def read_into(self, *args: Any) -> Any:
        return self._timed("copy", self._inner.read_into, *args)

    def read_bytes(self, *args: Any) -> Any:
        return self._timed("copy", self._inner.read_bytes, *args)

    def verify_rest(self) -> Any:
        return self._timed("verify_rest", self._inner.verify_rest)

    def close(self) -> Any:
        return self._timed("close", self._inner.close)


def in_new_process(spec: Dict[str, Any]) -> Dict[str, float]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"restore child exited {out.returncode}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    size = cb.parse_size(args.size)
    state = cb.make_state(size, args.tensors)
    job = f"restore-profile-{uuid.uuid4().hex[:8]}"
    tmp = tempfile.TemporaryDirectory(prefix="mo-restore-profile-")
    proc = cb.start_daemon(tmp.name, max(1 << 30, 4 * size), args.pages == "hugetlbfs")
    shm = tempfile.mkdtemp(prefix="mo-restore-profile-", dir="/dev/shm")
    samples: Dict[str, List[Dict[str, float]]] = {}
    try:
        pages = mot.daemon_status(tmp.name)["pages"]
        for crc in (True, False):
            writer = MemoffloadWriter(job_id=f"{job}-{crc}", runtime_dir=tmp.name,
                                      fallback_dir=os.devnull, checksums=crc)
            dcp.save(state, storage_writer=writer, checkpoint_id="c", no_dist=True)
            writer.close()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(shm, "c")), no_dist=True)
        _store.forget_all()
        specs = {
            "daemon, checksums": {"kind": "daemon", "job": f"{job}-True", "verify": True},
            "daemon, no checksums": {"kind": "daemon", "job": f"{job}-False", "verify": False},
            "FileSystemReader /dev/shm": {"kind": "shm", "path": os.path.join(shm, "c")},
        }
        for _ in range(args.rounds):
            for name, spec in specs.items():
                spec = {**spec, "size": size, "tensors": args.tensors, "runtime_dir": tmp.name,
                        "checkpoint_id": "c"}
                samples.setdefault(name, []).append(in_new_process(spec))
    finally:
        _store.forget_all()
        shutil.rmtree(shm, ignore_errors=True)
        proc.terminate()
        proc.wait()
        tmp.cleanup()
    shm_total = statistics.median(s["total"] for s in samples["FileSystemReader /dev/shm"])
    print(f"restore of {args.size} in {args.tensors} tensors, new process each, arena on {pages}, "
          f"{args.rounds} rounds: median ms (min-max)")
    for name, runs in samples.items():
        total = statistics.median(s["total"] for s in runs)
        print(f"{name}: total {total:.1f} ({min(s['total'] for s in runs):.1f}-"
              f"{max(s['total'] for s in runs):.1f}), {shm_total / total:.2f}x FileSystemReader")
        if name.startswith("daemon"):
            print("    " + ", ".join(
                f"{p} {statistics.median(s[p] for s in runs):.1f}"
                f" ({min(s[p] for s in runs):.1f}-{max(s[p] for s in runs):.1f})"
                for p in PHASES if p != "total"))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="128MiB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pages", choices=["", "4k", "thp", "hugetlbfs"], default="")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    if args.pages:
        import sysknobs
        from page_sizes_bench import settings

        arena = max(1 << 30, 4 * cb.parse_size(args.size))
        with sysknobs.changed(settings(args.pages, -(-arena // (256 << 20)) * (256 << 20))):
            return run(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
