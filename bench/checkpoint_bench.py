#!/usr/bin/env python3
"""Checkpoint save and restore through the daemon (memoffload.torch.checkpoint)
next to DCP's FileSystemWriter/Reader on local disk and a plain memcpy of the
same bytes, all measured in the same run. Prints one JSON object.

    .venv/bin/python bench/checkpoint_bench.py [--size 256MiB] [--tensors 16]
        [--repeat 3] [--disk-dir DIR] [--runtime-dir DIR]

The state is ``--tensors`` float32 tensors of ``--size`` bytes in all, saved
and loaded with torch.distributed.checkpoint in one process (no process
group). Figures are GB/s (1e9 bytes per second) of the state's bytes, the
median of ``--repeat`` runs, one thread (torch.set_num_threads(1)):

* save: memcpy into preallocated, pre-touched tensors; dcp.save through the
  daemon with and without checksums, each by a writer kept for its pass as a
  trainer keeps it (keep_last=1): its first save (reported apart, as
  "first": the first checkpoint of a restarted job) touches the arena's
  pages in this process, the counted ones start with the third;
  FileSystemWriter (sync_files=True, its default: every file fsync'ed) into
  ``--disk-dir`` (default a temp dir under /var/tmp; its file system type is
  reported: it must not be tmpfs).
* load ("restore after a crash"), in a new process per round (a new session,
  the arena mapped anew, as in a restarted job): dcp.load from the daemon of
  the checksummed checkpoint, verified at open, and of the one saved without
  checksums, opened without the check;
  FileSystemReader cold (each file's pages dropped with
  posix_fadvise(POSIX_FADV_DONTNEED) after the fsync; fincore's count of
  resident bytes just before the load is reported) and warm (read again);
  memcpy back.
* raw_regions: the same bytes through memoffload._C.RegionStore without DCP,
  to show where the daemon path's time goes (first touch of the arena's
  pages in a new session, checksums, the CRC check at open).

* shm: FileSystemWriter into /dev/shm and FileSystemReader back (a
  checkpoint kept in memory the plain way), the restore's baseline.

Goals (reported, never asserted): save >= 0.5x memcpy, a job's first save
without checksums >= 0.7x; restore from the daemon >= 5x the cold restore
from disk, and without checksums >= 2x (with them >= 1.3x) FileSystemReader
from /dev/shm.

``--pages 4k|thp|hugetlbfs`` sets the kernel for the run (bench/sysknobs.py:
shared-memory THP off or ``advise``, or huge pages reserved and the daemon
started with ``--hugepages``; restored on every exit) and reports the pages
the daemon's arena got; the default leaves the node as it is.

Without --runtime-dir it starts $MEMOFFLOAD_BIN_DIR/memoffloadd (default
build/bin) in a temporary directory with an arena of 4x the size (>= 1 GiB),
all of which checkpoint regions may use (--regions-max-bytes), the bench's
one uid included (--regions-uid-max-bytes; by default a uid gets half).
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
import warnings
from typing import Callable, Dict, List, Optional

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

import torch
import torch.distributed.checkpoint as dcp

import memoffload.torch as mot
from memoffload.torch.checkpoint import store as _checkpoint_store
from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter

_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if unit and t.endswith(unit):
            return int(float(t[: -len(unit)]) * _UNITS[unit])
    return int(t)


def start_daemon(tmp: str, arena_bytes: int, hugepages: bool = False) -> subprocess.Popen:
    bin_dir = os.environ.get("MEMOFFLOAD_BIN_DIR", os.path.join(REPO, "build", "bin"))
    exe = os.path.join(bin_dir, "memoffloadd")
    chunk = 256 << 20
    arena = -(-arena_bytes // chunk) * chunk
    proc = subprocess.Popen(
        [exe, f"--runtime-dir={tmp}", f"--arena-size={arena}", f"--chunk-size={chunk}",
         f"--regions-max-bytes={arena}", f"--regions-uid-max-bytes={arena}",
         "--metrics-address=none", "--log-level=warn", *(["--hugepages"] if hugepages else [])])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"memoffloadd exited with {proc.returncode}")
        try:
            mot.daemon_status(tmp)
            return proc
        except RuntimeError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("memoffloadd did not start")


def fs_type(path: str) -> str:
    out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", path], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def resident_bytes(paths: List[str]) -> Optional[int]:
    """Bytes of ``paths`` in the page cache (util-linux fincore), None if unknown."""
    if not paths or shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *paths],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return sum(int(line.split()[0]) for line in out.stdout.splitlines() if line.strip())


def drop_file_pages(paths: List[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def ratio(a: float, b: float) -> Optional[float]:
    return float(f"{a / b:.3g}") if b > 0 else None


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_state(size_bytes: int, tensors: int) -> Dict[str, torch.Tensor]:
    per = max(1, size_bytes // tensors // 4)
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(tensors)}


def empty_like_state(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}  # zeros: pages touched


def same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def bench_raw(runtime_dir: str, job: str, state: Dict[str, torch.Tensor], repeat: int) -> Dict[str, float]:
    """Where the daemon path's time goes, without DCP: RegionStore writes of
    the same tensors into a new session's mapping (first touch of the pages
    in this process) and again into the same pages (the region deleted and
    made again), with and without checksums; opening with and without the
    CRC check; reading into preallocated tensors. Medians."""
    from memoffload import _C

    tensors = list(state.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    dst = [torch.zeros_like(t) for t in tensors]
    rows: Dict[str, List[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    def write(store, name: str) -> float:
        def run() -> None:
            w = store.create(name, nbytes)
            for t in tensors:
                w.append(t)
            w.commit()
        return timed(run)

    for rep in range(repeat):
        for crc in (True, False):
            tag = "crc" if crc else "nocrc"
            name = f"raw/{rep}-{tag}"
            store = _C.RegionStore(runtime_dir=runtime_dir, job_id=job, rank=0, checksums=crc)
            add(f"write_new_session_{tag}_gbps", gbps(nbytes, write(store, name)))
            store.delete(name)
            add(f"write_same_pages_{tag}_gbps", gbps(nbytes, write(store, name)))
            reader_store = _C.RegionStore(runtime_dir=runtime_dir, job_id=job, rank=0)
            for verify in (True, False):
                opened = []
                add(f"open_{tag}_verify_{str(verify).lower()}_ms",
                    round(timed(lambda: opened.append(reader_store.open(name, verify))) * 1e3, 2))
                reader = opened[0]
                offsets = []
                at = 0
                for t in tensors:
                    offsets.append(at)
                    at += t.numel() * t.element_size()
                add(f"read_{tag}_gbps", gbps(nbytes, timed(
                    lambda: [reader.read_into(o, d) for o, d in zip(offsets, dst)])))
                reader.close()
            store.delete(name)
            store.close()
            reader_store.close()
    return {k: round(statistics.median(v), 3) for k, v in rows.items()}


# Saves of a writer before its figures count: the first touches the arena's
# pages in this process, the second the other area keep_last=1 alternates to.
WARMUP_SAVES = 2


def restore_in_new_process(runtime_dir: str, size: int, tensors: int, loads: List[Dict]) -> Dict[str, float]:
    """Runs ``loads`` in a new process (as a restarted job: a new session,
    the arena mapped anew), in order; returns seconds per load."""
    child = {"runtime_dir": runtime_dir, "size": size, "tensors": tensors, "loads": loads}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--restore-child", json.dumps(child)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"restore child exited {out.returncode}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def restore_child(child: Dict) -> None:
    torch.set_num_threads(1)
    state = make_state(child["size"], child["tensors"])  # the same seed: the same bytes
    dst = empty_like_state(state)
    seconds: Dict[str, float] = {}
    for load in child["loads"]:
        for v in dst.values():
            v.zero_()
        if "path" in load:
            reader = dcp.FileSystemReader(load["path"])
            t = timed(lambda: dcp.load(dst, storage_reader=reader, no_dist=True))
        else:
            reader = MemoffloadReader(job_id=load["job"], runtime_dir=child["runtime_dir"],
                                      fallback_dir=os.devnull, verify=load["verify"])
            t = timed(lambda: dcp.load(dst, storage_reader=reader, checkpoint_id=load["checkpoint_id"],
                                       no_dist=True))
            if reader.last_mode != "daemon":
                raise SystemExit(f"{load} was read from {reader.last_mode}")
        if not same(state, dst):
            raise SystemExit(f"{load['name']}: the loaded state differs")
        seconds[load["name"]] = t
    _checkpoint_store.forget_all()
    print(json.dumps(seconds), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MiB", help="bytes of state (e.g. 256MiB, 2GiB)")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--disk-dir", default="", help="local-disk directory for FileSystemWriter")
    parser.add_argument("--runtime-dir", default="")
    parser.add_argument("--pages", choices=["", "4k", "thp", "hugetlbfs"], default="",
                        help="set the kernel for this page size for the run (root)")
    parser.add_argument("--restore-child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.restore_child:
        restore_child(json.loads(args.restore_child))
        return 0
    if args.pages:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import sysknobs
        from page_sizes_bench import settings

        size = parse_size(args.size)
        arena = max(1 << 30, 4 * size)
        with sysknobs.changed(settings(args.pages, -(-arena // (256 << 20)) * (256 << 20))):
            return run(args)
    return run(args)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    size = parse_size(args.size)
    state = make_state(size, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    job = f"ckpt-bench-{uuid.uuid4().hex[:8]}"

    proc = None
    tmp_rt = None
    runtime_dir = args.runtime_dir
    if not runtime_dir:
        tmp_rt = tempfile.TemporaryDirectory(prefix="mo-ckpt-bench-")
        runtime_dir = tmp_rt.name
        proc = start_daemon(runtime_dir, max(1 << 30, 4 * nbytes), args.pages == "hugetlbfs")
    pages = mot.daemon_status(runtime_dir)["pages"]
    disk_root = tempfile.mkdtemp(prefix="mo-ckpt-bench-", dir=args.disk_dir or "/var/tmp")
    results: Dict[str, List[float]] = {}
    jobs: List[str] = []

    def record(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(gbps(nbytes, seconds))

    try:
        dst = empty_like_state(state)
        fallback = os.path.join(disk_root, "fallback")
        resident_cold: List[Optional[int]] = []
        for crc in (True, False):
            # One writer per pass, kept for the whole pass as a trainer keeps
            # it: its first save touches the arena's pages in this process
            # (reported as "first"); with keep_last=1 it then alternates
            # between two areas, warm from the third save on.
            tag = "crc" if crc else "nocrc"
            jobs.append(f"{job}-{tag}")
            writer = MemoffloadWriter(job_id=jobs[-1], runtime_dir=runtime_dir, fallback_dir=fallback,
                                      keep_last=1, checksums=crc)
            for rep in range(WARMUP_SAVES + args.repeat):
                count = rep >= WARMUP_SAVES
                t = timed(lambda: [dst[k].copy_(v) for k, v in state.items()])
                if count:
                    record("save_memcpy", t)
                    record("load_memcpy", t)
                ckpt = f"r{rep}"
                t = timed(lambda: dcp.save(state, storage_writer=writer, checkpoint_id=ckpt, no_dist=True))
                if writer.last_mode != "daemon":
                    raise SystemExit(f"save went to {writer.last_mode}, not the daemon")
                if rep == 0:
                    record(f"save_daemon_{tag}_first", t)
                if count:
                    record(f"save_daemon_{tag}", t)
                    load = {"name": f"load_daemon_{tag}", "job": jobs[-1], "checkpoint_id": ckpt,
                            "verify": crc}
                    restored = restore_in_new_process(runtime_dir, size, args.tensors, [load])
                    for name, seconds in restored.items():
                        record(name, seconds)
        for rep in range(1 + args.repeat):  # the first round warms up and is not counted
            path = os.path.join(disk_root, f"r{rep}")
            t = timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True))
            if rep:
                record("save_filesystem", t)
            files = [os.path.join(path, f) for f in os.listdir(path)]
            drop_file_pages(files)
            resident = resident_bytes(files)
            loads = [{"name": f"load_filesystem_{temp}", "path": path} for temp in ("cold", "warm")]
            for name, seconds in restore_in_new_process(runtime_dir, size, args.tensors, loads).items():
                if rep:
                    record(name, seconds)
            if rep:
                resident_cold.append(resident)
            shutil.rmtree(path)
        shm_root = tempfile.mkdtemp(prefix="mo-ckpt-bench-", dir="/dev/shm")
        try:
            for rep in range(1 + args.repeat):  # the first round warms up
                path = os.path.join(shm_root, f"r{rep}")
                t = timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path),
                                           no_dist=True))
                loads = [{"name": "load_shm", "path": path}]
                for name, seconds in restore_in_new_process(runtime_dir, size, args.tensors,
                                                            loads).items():
                    if rep:
                        record(name, seconds)
                if rep:
                    record("save_shm", t)
                shutil.rmtree(path)
        finally:
            shutil.rmtree(shm_root, ignore_errors=True)
        raw = bench_raw(runtime_dir, job, state, args.repeat)
        for j in jobs:
            store, _ = _checkpoint_store.attach(runtime_dir, j, -1, True)
            for info in _checkpoint_store.stored_checkpoints(store).values():
                _checkpoint_store.delete_checkpoint(store, info)
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
        _checkpoint_store.forget_all()  # end our sessions before the daemon drains
        if proc is not None:
            proc.terminate()
            proc.wait()
        if tmp_rt is not None:
            tmp_rt.cleanup()

    med = {k: round(statistics.median(v), 3) for k, v in results.items()}
    out = {
        "bench": "checkpoint",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "threads": 1,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "size_bytes": nbytes,
        "pages": pages,
        "tensors": args.tensors,
        "repeat": args.repeat,
        "disk": {
            "dir": args.disk_dir or "/var/tmp",
            "fstype": fs_type(args.disk_dir or "/var/tmp"),
            "cold_method": "fsync, then posix_fadvise(POSIX_FADV_DONTNEED) on every file; "
                           "/proc/sys/vm/drop_caches not used (shared machine)",
            "resident_bytes_before_cold_load": resident_cold,
        },
        "save": {
            "memcpy_gbps": med["save_memcpy"],
            "daemon_crc_gbps": med["save_daemon_crc"],
            "daemon_nocrc_gbps": med["save_daemon_nocrc"],
            "filesystem_gbps": med["save_filesystem"],
            "daemon_crc_vs_memcpy": ratio(med["save_daemon_crc"], med["save_memcpy"]),
            "daemon_nocrc_vs_memcpy": ratio(med["save_daemon_nocrc"], med["save_memcpy"]),
            "daemon_crc_vs_filesystem": ratio(med["save_daemon_crc"], med["save_filesystem"]),
            "daemon_crc_first_gbps": med["save_daemon_crc_first"],
            "daemon_nocrc_first_gbps": med["save_daemon_nocrc_first"],
            "daemon_crc_first_vs_memcpy": ratio(med["save_daemon_crc_first"], med["save_memcpy"]),
            "daemon_nocrc_first_vs_memcpy": ratio(med["save_daemon_nocrc_first"],
                                                  med["save_memcpy"]),
            "shm_gbps": med["save_shm"],
            "goal_vs_memcpy": 0.5,
            "goal_first_nocrc_vs_memcpy": 0.7,
        },
        "load": {
            "memcpy_gbps": med["load_memcpy"],
            "daemon_crc_gbps": med["load_daemon_crc"],
            "daemon_nocrc_gbps": med["load_daemon_nocrc"],
            "filesystem_cold_gbps": med["load_filesystem_cold"],
            "filesystem_warm_gbps": med["load_filesystem_warm"],
            "daemon_crc_vs_filesystem_cold": ratio(med["load_daemon_crc"], med["load_filesystem_cold"]),
            "daemon_crc_vs_filesystem_warm": ratio(med["load_daemon_crc"], med["load_filesystem_warm"]),
            "daemon_crc_vs_memcpy": ratio(med["load_daemon_crc"], med["load_memcpy"]),
            "shm_gbps": med["load_shm"],
            "daemon_nocrc_vs_shm": ratio(med["load_daemon_nocrc"], med["load_shm"]),
            "daemon_crc_vs_shm": ratio(med["load_daemon_crc"], med["load_shm"]),
            "goal_vs_filesystem_cold": 5.0,
            "goal_nocrc_vs_shm": 2.0,
            "goal_crc_vs_shm": 1.3,
        },
        "raw_regions": raw,
        "samples_gbps": results,
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
