#!/usr/bin/env python3
"""Node-safe checkpoints (issue 33, item 5): what ``replicas=1`` costs and
buys, each against a baseline measured in the same run. Two simulated nodes
on this machine (a memoffloadd with its own runtime dir each), 4 ranks (2
per node) on gloo over lo, replicating over the link between nodes from
127.0.0.2 (node 0) and 127.0.0.3 (node 1) as tests/python/test_node_safe.py
does. Each rank saves its own
shard: ``--size`` bytes of float32 in 16 tensors under keys of its own.

1. ``blocking``: how long ``dcp.save`` with ``MemoffloadWriter(replicas=1)``
   blocks vs ``replicas=0``, alternated rounds after one warm-up round of
   each; per round the slowest rank's. ``wait_replication()`` follows each
   timed save outside the window. Also the lag: ``Replication.seconds`` and
   the time from the save's return to ``wait_replication()``'s.
2. ``replication``: bytes each rank replicated over the time of the link's
   exchange (``Session.exchange``, timed by a wrapper: connecting and the
   TLS handshakes, reading the local daemon, streaming, committing into the
   peer's) vs, alternated with the saves, three baselines sending as many
   bytes in the same ring (each rank to the same local rank of the other
   node, from its replication address, all streams at once): a plain TLS
   1.3 stream with the link's own key exchange and cipher, from memory into
   memory (``memoffload-bench streams --kind tls``, the target's baseline),
   the same over plain TCP (``--kind tcp``), and a raw ``ProcessGroupGloo``
   from the same address (the transport replicas used before issue 40).
3. ``restore``: node 1's daemon is SIGKILLed and started empty before each
   round; 4 ranks ``dcp.load`` a node-safe checkpoint with MemoffloadReader
   (node 1's shards come from node 0) vs FileSystemReader of the same state
   saved with FileSystemWriter into a local temp dir whose page cache was
   dropped (``os.sync()``, ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every
   file). Every rank checks that it loaded its state bit for bit.

Prints one JSON object (median, min, max; ratios of the medians); progress
on stderr. Everything it starts stops with it, also on failure.

    MEMOFFLOAD_BIN_DIR=build/bin .venv/bin/python bench/node_safe_bench.py [--size 64MiB] [--rounds 5]

The daemons get one replication key file (secure mode), as an operator
sets them up.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

WORLD = 4
NODE_OF = [0, 0, 1, 1]
JOB = "node-safe-bench"
MODES = ["replicas_1", "replicas_0"]
TENSORS = 16
MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[node_safe_bench] {msg}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    for suffix, factor in {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def spread(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def die_with_parent(sig: int = signal.SIGKILL, parent: Optional[int] = None) -> None:
    """This process gets ``sig`` when the bench's main process goes (Linux);
    it exits now if that process (pid ``parent``) is gone already."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)


# ---- one rank ---------------------------------------------------------------


def make_state(rank: int, size: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(1234 + rank)
    per = size // TENSORS // 4
    return {f"r{rank}": {f"w{i}": torch.randn(per, generator=g) for i in range(TENSORS)}}


def bit_equal(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for k in a for x, y in zip(a[k].values(), b[k].values()))


class RawRing:
    """A baseline: a gloo group made as the link's was before issue 40 (its
    own PrefixStore over the default store, ``create_device(hostname=<the
    replication address>)``), sending ``nbytes`` to the buddy while
    receiving as many from the source."""

    def __init__(self, rank: int, buddy: int, source: int, nbytes: int, timeout: float) -> None:
        store = dist.PrefixStore("bench/raw-gloo", dist.distributed_c10d._get_default_store())
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout)
        address = os.environ["MEMOFFLOAD_REPLICATION_ADDRESS"]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        self.pg = dist.ProcessGroupGloo(store, rank, WORLD, opts)
        self.buddy, self.source = buddy, source
        self.out = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        self.into = torch.empty(nbytes, dtype=torch.uint8)

    def once(self) -> float:
        self.pg.barrier().wait()
        t = time.perf_counter()
        works = [self.pg.send([self.out], self.buddy, 7), self.pg.recv([self.into], self.source, 7)]
        for w in works:
            w.wait()
        return time.perf_counter() - t


def rank_main(args: argparse.Namespace) -> None:
    die_with_parent(parent=args.parent)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter
    from memoffload.torch.checkpoint.nodes.session import Session

    rank, node = args.rank, NODE_OF[args.rank]
    torch.set_num_threads(1)
    base = Path(args.base)
    rt, fallback, fs_dir = str(base / f"node{node}"), str(base / f"fallback{node}"), str(base / "fs")
    store = dist.TCPStore("127.0.0.1", args.store_port, None, False, timedelta(seconds=args.timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=args.timeout))
    say = log if rank == 0 else (lambda msg: None)

    exchanges: List[float] = []  # Session.exchange's times in this process
    plain_exchange = Session.exchange

    def timed_exchange(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return plain_exchange(self, *a, **k)
        finally:
            exchanges.append(time.perf_counter() - t)

    Session.exchange = timed_exchange  # type: ignore[method-assign]

    state = make_state(rank, parse_size(args.size))
    writers = {m: MemoffloadWriter(job_id=JOB, runtime_dir=rt, fallback_dir=fallback, keep_last=2,
                                   replicas=1 if m == "replicas_1" else 0) for m in MODES}
    # The library's ring with 2 nodes of 2 ranks: the same local index on the other node.
    buddy = source = (rank + 2) % WORLD
    saves: Dict[str, List[Dict[str, Any]]] = {m: [] for m in MODES}
    raw_s: List[float] = []
    raw: Optional[RawRing] = None
    nbytes = parse_size(args.size)
    for i in range(args.rounds + 1):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            dist.barrier()
            exchanges.clear()
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=writers[mode], checkpoint_id=f"{mode}-{i}")
            t1 = time.perf_counter()
            rep = writers[mode].wait_replication()
            t2 = time.perf_counter()
            row = {"blocked_s": t1 - t0, "after_save_s": t2 - t1,
                   "lag_s": rep.seconds if rep else None, "bytes_sent": rep.bytes_sent if rep else 0,
                   "exchange_s": sum(exchanges), "node_safe": bool(rep and rep.node_safe),
                   "why": rep.why if rep else "no Replication", "mode": writers[mode].last_mode}
            say(f"round {i} {mode}: blocked {row['blocked_s']:.3f} s, replicated "
                f"{row['after_save_s']:.3f} s later, node-safe {row['node_safe']}")
            if i > 0:
                saves[mode].append(row)
            elif mode == "replicas_1" and row["bytes_sent"]:
                nbytes = row["bytes_sent"]  # the raw baseline sends as many bytes
        if raw is None:
            raw = RawRing(rank, buddy, source, nbytes, args.timeout)
        t = raw.once()
        if i > 0:
            raw_s.append(t)
        if rank == 0:
            store.set(f"bench/bytes/{i}", str(nbytes))
        store.set(f"bench/streams/{i}/{rank}", "1")  # the main process runs the stream baselines
        store.wait([f"bench/streams-done/{i}"], timedelta(seconds=args.timeout))

    say("node-safe save to restore from, and the same state with FileSystemWriter")
    dcp.save(state, storage_writer=writers["replicas_1"], checkpoint_id="restore")
    rep = writers["replicas_1"].wait_replication()
    restore_saved_node_safe = bool(rep and rep.node_safe)
    dcp.save(state, storage_writer=FileSystemWriter(fs_dir))
    for w in writers.values():
        w.close()
    target = {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state.items()}
    loads: Dict[str, List[float]] = {"memoffload": [], "filesystem": []}
    identical, fetched, load_modes = True, [], set()
    for i in range(args.rounds):
        store.set(f"bench/ready/{i}/{rank}", "1")  # the main process restarts node 1's daemon
        store.wait([f"bench/go/{i}"], timedelta(seconds=args.timeout))
        for mode in (["memoffload", "filesystem"] if i % 2 == 0 else ["filesystem", "memoffload"]):
            for t in target[f"r{rank}"].values():
                t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "memoffload":
                reader = MemoffloadReader(job_id=JOB, runtime_dir=rt, fallback_dir=fallback)
                dcp.load(target, storage_reader=reader, checkpoint_id="restore")
            else:
                dcp.load(target, storage_reader=FileSystemReader(fs_dir))
            loads[mode].append(time.perf_counter() - t0)
            identical = identical and bit_equal(target, state)
            if mode == "memoffload":
                fetched.append(sum(1 for w in reader.last_sources.values() if w != "local daemon"))
                load_modes.add(reader.last_mode)
        say(f"restore round {i}: memoffload {loads['memoffload'][-1]:.3f} s, "
            f"filesystem {loads['filesystem'][-1]:.3f} s")
    result = {"rank": rank, "saves": saves, "raw_s": raw_s, "raw_bytes": nbytes, "loads": loads,
              "bit_identical": identical, "fetched_regions": fetched, "load_modes": sorted(load_modes),
              "restore_saved_node_safe": restore_saved_node_safe,
              "replication_address": os.environ["MEMOFFLOAD_REPLICATION_ADDRESS"]}
    store.set(f"bench/result/{rank}", json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ---- the main process: daemons, ranks, figures ---------------------------------


def bin_dir() -> Path:
    return Path(os.environ.get("MEMOFFLOAD_BIN_DIR",
                               Path(__file__).resolve().parents[1] / "build" / "bin"))


def streams(kind: str, nbytes: int, timeout: float) -> float:
    """One round of ``memoffload-bench streams``: the slowest rank's seconds."""
    out = subprocess.run(
        [str(bin_dir() / "memoffload-bench"), "streams", "--kind", kind,
         "--addresses", "127.0.0.2,127.0.0.3", "--per-address", str(WORLD // 2),
         "--bytes", str(nbytes), "--rounds", "1"],
        capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"memoffload-bench streams --kind {kind}: {out.stderr.strip()}")
    return json.loads(out.stdout)["seconds"][0]


class Daemon:
    """A memoffloadd in ``runtime_dir`` (the command line of tests/python/conftest.py)."""

    def __init__(self, runtime_dir: Path, arena: str, key_file: Path) -> None:
        self.runtime_dir, self.arena, self.key_file = runtime_dir, arena, key_file
        self.proc: Optional[subprocess.Popen] = None
        self.log = runtime_dir.parent / f"memoffloadd-{runtime_dir.name}.log"

    def start(self) -> "Daemon":
        import memoffload
        import memoffload.torch as mot

        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(Path(bin_dir(), "memoffloadd")), f"--runtime-dir={self.runtime_dir}",
                 f"--arena-size={self.arena}", "--chunk-size=16MiB", "--metrics-address=none",
                 "--prefault-threads=1", "--log-level=warn", f"--regions-max-bytes={self.arena}",
                 "--regions-uid-max-bytes=0", f"--replication-key-file={self.key_file}"],
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"memoffloadd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                mot.daemon_status(str(self.runtime_dir))
                return self
            except memoffload.Unavailable:
                time.sleep(0.05)
        raise SystemExit(f"memoffloadd in {self.runtime_dir} did not answer within 60 s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def drop_cache(folder: Path) -> Optional[int]:
    """os.sync(), then POSIX_FADV_DONTNEED on every file; the bytes still
    resident after it (fincore), None without fincore."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if not shutil.which("fincore"):
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES",
                          *map(str, files)], capture_output=True, text=True, timeout=30)
    return sum(int(x) for x in out.stdout.split()) if out.returncode == 0 else None


def fs_type(path: Path) -> str:
    best = ("", "?")
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, kind = line.split()[:3]
        if str(path.resolve()).startswith(mnt) and len(mnt) > len(best[0]):
            best = (mnt, kind)
    return best[1]


def figures(results: List[Dict[str, Any]], args: argparse.Namespace, resident: List[Any],
            base: Path, stream_s: Dict[str, List[float]]) -> Dict[str, Any]:
    rounds = range(args.rounds)

    def slowest(mode: str, key: str) -> List[float]:
        return [max(r["saves"][mode][i][key] for r in results) for i in rounds]

    blocked = {m: spread(slowest(m, "blocked_s")) for m in MODES}
    r1 = [row for r in results for row in r["saves"]["replicas_1"]]
    nbytes = results[0]["raw_bytes"]
    sent = [min(r["saves"]["replicas_1"][i]["bytes_sent"] for r in results) for i in rounds]
    exchange = slowest("replicas_1", "exchange_s")
    lag = slowest("replicas_1", "lag_s")
    raw = [max(r["raw_s"][i] for r in results) for i in rounds]
    repl_bps = [b / s for b, s in zip(sent, exchange)]
    raw_bps = [nbytes / s for s in raw]
    tls_bps = [nbytes / s for s in stream_s["tls"]]
    tcp_bps = [nbytes / s for s in stream_s["tcp"]]
    mo = [max(r["loads"]["memoffload"][i] for r in results) for i in rounds]
    fs = [max(r["loads"]["filesystem"][i] for r in results) for i in rounds]
    return {
        "bench": "node_safe", "world": WORLD, "nodes": 2, "rounds": args.rounds,
        "size_bytes_per_rank": parse_size(args.size), "tensors_per_rank": TENSORS,
        "machine": (f"{platform.node()}: {os.cpu_count()} CPUs shared by {WORLD} ranks and 2 "
                    f"daemons, torch {torch.__version__}; both 'nodes' on this machine, over lo"),
        "blocking": {
            "what": "dcp.save's time, slowest rank per round, seconds", **blocked,
            "ratio": blocked["replicas_1"]["median"] / blocked["replicas_0"]["median"], "target": 1.10,
            "node_safe_all": all(row["node_safe"] for row in r1),
            "not_node_safe_why": sorted({row["why"] for row in r1 if not row["node_safe"]}),
            "modes": sorted({row["mode"] for r in results for m in MODES for row in r["saves"][m]}),
            "replicas_0_lag_s": spread(slowest("replicas_0", "lag_s")),
        },
        "replication": {
            "bytes_per_rank": statistics.median(sent), "lag_s": spread(lag),
            "after_save_s": spread(slowest("replicas_1", "after_save_s")),
            "exchange_s": spread(exchange), "throughput_Bps": spread(repl_bps),
            "plain_tls": {"bytes_per_stream": nbytes, "seconds": spread(stream_s["tls"]),
                          "throughput_Bps": spread(tls_bps)},
            "plain_tcp": {"bytes_per_stream": nbytes, "seconds": spread(stream_s["tcp"]),
                          "throughput_Bps": spread(tcp_bps)},
            "raw_gloo": {"bytes_per_rank": nbytes, "seconds": spread(raw), "throughput_Bps": spread(raw_bps)},
            "ratio": statistics.median(repl_bps) / statistics.median(tls_bps), "target": 0.8,
            "ratio_vs_tcp": statistics.median(repl_bps) / statistics.median(tcp_bps),
            "ratio_vs_gloo": statistics.median(repl_bps) / statistics.median(raw_bps),
            "addresses": sorted({r["replication_address"] for r in results}),
            "what": "bytes each rank replicated over the link's exchange time (slowest rank), vs "
                    "plain TLS 1.3 streams of as many bytes with the link's cipher and key "
                    "exchange (ratio), plain TCP, and one send + recv on a raw ProcessGroupGloo, "
                    "each in the same ring from the same addresses",
        },
        "restore": {
            "what": "dcp.load on 4 ranks, slowest rank per round, seconds; node 1's daemon "
                    "SIGKILLed and started empty before each round",
            "memoffload_s": spread(mo), "filesystem_s": spread(fs),
            "ratio": statistics.median(mo) / statistics.median(fs),
            "bit_identical": all(r["bit_identical"] for r in results),
            "saved_node_safe": all(r["restore_saved_node_safe"] for r in results),
            "memoffload_modes": sorted({m for r in results for m in r["load_modes"]}),
            "fetched_regions_per_round": [sum(r["fetched_regions"][i] for r in results) for i in rounds],
            "cache_drop": "os.sync(), then os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) on every file",
            "resident_bytes_after_drop": resident, "filesystem": fs_type(base),
        },
    }


def main_bench(args: argparse.Namespace) -> None:
    size = parse_size(args.size)
    # Per node and replicas=1 save: its 2 ranks' shards and the other node's 2.
    # keep_last=2 plus the newest node-safe one plus the save in progress.
    arena = f"{4 * 4 * size // MiB + 256}MiB"
    base = Path(tempfile.mkdtemp(prefix="node-safe-bench-", dir=args.tmp_dir))
    daemons: List[Daemon] = []
    procs: List[subprocess.Popen] = []
    try:
        key_file = base / "replication-key"  # one cluster secret, as an operator provisions it
        key_file.write_text(f"bench {os.urandom(32).hex()}\n")
        key_file.chmod(0o400)
        for node in (0, 1):
            (base / f"node{node}").mkdir(mode=0o700)
            daemons.append(Daemon(base / f"node{node}", arena, key_file).start())
        log(f"2 daemons of {arena} in {base}")
        store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=args.timeout),
                              wait_for_workers=False)
        for rank in range(WORLD):
            env = dict(os.environ, GLOO_SOCKET_IFNAME="lo",
                       MEMOFFLOAD_REPLICATION_ADDRESS=f"127.0.0.{2 + NODE_OF[rank]}",
                       MEMOFFLOAD_REPLICATION_TIMEOUT_S=str(args.timeout))
            env.pop("MEMOFFLOAD_JOB_ID", None)
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--rank", str(rank), "--base", str(base),
                 "--store-port", str(store.port), "--size", args.size, "--rounds", str(args.rounds),
                 "--timeout", str(args.timeout), "--parent", str(os.getpid())], env=env, stdout=subprocess.DEVNULL))

        def wait_keys(keys: List[str], what: str) -> None:
            deadline = time.monotonic() + args.timeout
            while not store.check(keys):
                for r, p in enumerate(procs):
                    if p.poll() not in (None, 0):
                        raise SystemExit(f"rank {r} exited {p.returncode} ({what})")
                if time.monotonic() > deadline:
                    raise SystemExit(f"timed out after {args.timeout} s: {what}")
                time.sleep(0.05)

        stream_s: Dict[str, List[float]] = {"tls": [], "tcp": []}
        for i in range(args.rounds + 1):
            wait_keys([f"bench/streams/{i}/{r}" for r in range(WORLD)], f"ranks ready for streams {i}")
            nbytes = int(store.get(f"bench/bytes/{i}"))
            for kind in (("tls", "tcp") if i % 2 == 0 else ("tcp", "tls")):
                t = streams(kind, nbytes, args.timeout)
                if i > 0:
                    stream_s[kind].append(t)
            store.set(f"bench/streams-done/{i}", "1")
        resident = []
        for i in range(args.rounds):
            wait_keys([f"bench/ready/{i}/{r}" for r in range(WORLD)], f"ranks ready for restore round {i}")
            daemons[1].stop(signal.SIGKILL)  # node 1 is lost; a fresh, empty daemon replaces it
            daemons[1].start()
            resident.append(drop_cache(base / "fs"))
            store.set(f"bench/go/{i}", "1")
        wait_keys([f"bench/result/{r}" for r in range(WORLD)], "the ranks' results")
        results = [json.loads(store.get(f"bench/result/{r}")) for r in range(WORLD)]
        for r, p in enumerate(procs):
            if p.wait(timeout=args.timeout) != 0:
                raise SystemExit(f"rank {r} exited {p.returncode}")
        print(json.dumps(figures(results, args, resident, base, stream_s)), flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for d in daemons:
            d.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="64MiB", help="bytes each rank saves")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds of each mode")
    parser.add_argument("--timeout", type=int, default=300, help="seconds any wait may take")
    parser.add_argument("--tmp-dir", default=None, help="where the temp dir goes (local disk)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally stops everything
        main_bench(args)
    else:
        rank_main(args)


if __name__ == "__main__":
    main()
