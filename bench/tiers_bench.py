#!/usr/bin/env python3
"""The checkpoint tiers (issue 44), each against a baseline measured in the
same run, rounds alternated, median and spread:

- ``persist``: a committed region written to a file by ``RegionStore.persist``
  (C++, from the arena mapping, O_DIRECT, verified, fsynced; unthrottled)
  against a plain sequential write of the same bytes from process memory to
  the same file system (16 MiB writes, then fsync).
- ``blocked``: how long ``CheckpointManager.step`` blocks training at a save
  that is also persisted (``durable_every=1``) against one that is not
  (node only), both with ``async_save``.
- ``restore``: ``dcp.load`` of a persisted checkpoint from the durable tier
  through ``MemoffloadReader`` (no daemon has it) against DCP's own
  ``FileSystemReader`` on the same files, their pages dropped from the page
  cache before each load (``posix_fadvise(DONTNEED)``).
- ``steps``: 2 ranks (gloo, CPU) train an MLP and save to the node every
  ``--every`` steps; persisting every ``--durable-every``-th, the step time
  of the steps that run while a persist is in flight, with the default
  throttle, against the same steps of a run that persists nothing; and how
  many steps a checkpoint takes to be persisted.

    MEMOFFLOAD_BIN_DIR=build/bin .venv/bin/python bench/tiers_bench.py [--size 512MiB] [--state 512MiB] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

import torch_bench  # noqa: E402  (this folder)
from async_save_bench import parse_size  # noqa: E402
from memoffload import _C  # noqa: E402
from memoffload.torch.checkpoint import CheckpointManager, MemoffloadReader  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MiB = 1 << 20


def spread(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def drop_pages(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_persist(rt: str, tmp: str, size: int, rounds: int) -> Dict[str, Any]:
    store = _C.RegionStore(rt, "bench-persist")
    data = torch.randint(0, 255, (size,), dtype=torch.uint8)
    writer = store.create("dcp/x/__0_0.distcp", size)
    writer.append(data)
    writer.commit()
    out = os.path.join(tmp, "persist")
    os.mkdir(out)
    dfd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    view = memoryview(data.numpy())
    rows: Dict[str, List[float]] = {"persist": [], "plain": []}
    for i in range(rounds + 1):
        for mode in (("persist", "plain") if i % 2 == 0 else ("plain", "persist")):
            name = f"{mode}-{i}"
            t = time.perf_counter()
            if mode == "persist":
                store.persist("dcp/x/__0_0.distcp", dfd, name)
            else:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
                for at in range(0, size, 16 * MiB):
                    os.write(fd, view[at:at + 16 * MiB])
                os.fsync(fd)
                os.close(fd)
            seconds = time.perf_counter() - t
            os.unlink(name, dir_fd=dfd)
            if i > 0:
                rows[mode].append(size / seconds / 1e9)
    os.close(dfd)
    store.close()
    return {"bytes": size, "GBps": {m: spread(v) for m, v in rows.items()},
            "ratio_persist_over_plain": statistics.median(rows["persist"]) /
            statistics.median(rows["plain"])}


def make_state(size: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    per = size // 16 // 4
    return {"model": {f"w{i}": torch.randn(per, generator=g) for i in range(16)}, "step": 0}


def bench_blocked_and_restore(rt: str, tmp: str, size: int, rounds: int) -> Dict[str, Any]:
    state = make_state(size)
    managers = {
        "node_only": CheckpointManager(state, "bench-node", node_every=1, durable_every=0,
                                       durable_dir=os.path.join(tmp, "d-node"), runtime_dir=rt,
                                       keep_last_node=1, keep_last_durable=1),
        "persisted": CheckpointManager(state, "bench-durable", node_every=1, durable_every=1,
                                       durable_dir=os.path.join(tmp, "d-durable"), runtime_dir=rt,
                                       keep_last_node=1, keep_last_durable=1, persist_share=1.0),
    }
    blocked: Dict[str, List[float]] = {m: [] for m in managers}
    persisted_s: List[float] = []
    for i in range(rounds + 1):
        for mode in (list(managers) if i % 2 == 0 else list(reversed(managers))):
            m = managers[mode]
            state["step"] = i + 1
            t = time.perf_counter()
            m.step(i + 1)
            took = time.perf_counter() - t
            m._collect(wait=True)  # the save done, then its persist: rounds apart
            m.wait_persisted()
            if i > 0:
                blocked[mode].append(took)
                if mode == "persisted":
                    persisted_s.append(m.last_persisted["seconds"])
    for m in managers.values():
        m.close()
    # Restore: the last persisted checkpoint, which the node tier no longer
    # holds (the daemon restarted, say): from the files.
    durable = os.path.join(tmp, "d-durable")
    ckpt = f"step-{rounds + 1}"
    path = os.path.join(durable, ckpt)
    store = _C.RegionStore(rt, "bench-durable")
    for region in store.list(f"dcp/{ckpt}/"):
        store.delete(region["name"])
    store.close()
    loads: Dict[str, List[float]] = {"memoffload": [], "filesystem_reader": []}
    for i in range(rounds + 1):
        for mode in (list(loads) if i % 2 == 0 else list(reversed(loads))):
            target = make_state(size)
            drop_pages(path)
            t = time.perf_counter()
            if mode == "memoffload":
                reader = MemoffloadReader(job_id="bench-durable", runtime_dir=rt,
                                          fallback_dir=durable)
                dcp.load(target, storage_reader=reader, checkpoint_id=ckpt)
                assert reader.last_mode == "filesystem"
            else:
                dcp.load(target, storage_reader=FileSystemReader(path))
            if i > 0:
                loads[mode].append(time.perf_counter() - t)
            assert torch.equal(target["model"]["w3"], state["model"]["w3"])
    return {
        "blocked_s": {m: spread(v) for m, v in blocked.items()},
        "ratio_blocked_persisted_over_node_only":
            statistics.median(blocked["persisted"]) / statistics.median(blocked["node_only"]),
        "persist_s": spread(persisted_s),
        "restore_s": {m: spread(v) for m, v in loads.items()},
        "ratio_restore_speed_memoffload_over_filesystem_reader":
            statistics.median(loads["filesystem_reader"]) / statistics.median(loads["memoffload"]),
    }


def _rank(rank: int, cfg: Dict[str, Any], port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    width = cfg["width"]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, width)
    result = {}
    # node-only before and after, so that neither order nor warm-up favours one
    for mode, durable_every in (("node_only", 0), ("persisted", cfg["durable_every"]),
                                ("node_only_after", 0)):
        manager = CheckpointManager(
            {"app": _Both(model, opt, rank)}, f"bench-steps-{mode}", node_every=cfg["every"],
            durable_every=durable_every, durable_dir=os.path.join(cfg["tmp"], f"steps-{mode}"),
            runtime_dir=cfg["rt"], keep_last_node=1, keep_last_durable=1)
        times, until = [], []
        saved_at: Any = None
        for step in range(1, cfg["steps"] + 1):
            t = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            manager.step(step)
            took = time.perf_counter() - t
            busy = manager.persisting is not None
            times.append((step, took, busy))
            if rank == 0 and durable_every:
                if saved_at is not None and manager.last_persisted.get("step") == saved_at:
                    until.append(step - saved_at)  # steps from its save to its publish
                    saved_at = None
                if step % durable_every == 0 and saved_at is None:
                    saved_at = step
        manager.close()
        result[mode] = {"times": times, "until": until}
    out.put((rank, result))
    dist.destroy_process_group()


class _Both:
    def __init__(self, model: Any, opt: Any, rank: int) -> None:
        self.model, self.opt, self.rank = model, opt, rank

    def state_dict(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        m, o = get_state_dict(self.model, self.opt)
        return {f"model{self.rank}": m, f"optim{self.rank}": o}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        raise NotImplementedError


def bench_steps(rt: str, tmp: str, steps: int, every: int, durable_every: int,
                width: int) -> Dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cfg = {"rt": rt, "tmp": tmp, "steps": steps, "every": every, "durable_every": durable_every,
           "width": width}
    port = torch_bench_port()
    procs = [ctx.Process(target=_rank, args=(r, cfg, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(60)
    out: Dict[str, Any] = {"steps": steps, "every": every, "durable_every": durable_every}
    for rank, r in sorted(results.items()):
        # Steps that ran while this rank persisted, against the same steps of
        # the run that persisted nothing (the first interval warms up, skipped).
        during = [s for s, _, busy in r["persisted"]["times"] if busy and s > every]
        before = {s: t for s, t, _ in r["node_only"]["times"]}
        after = {s: t for s, t, _ in r["node_only_after"]["times"]}
        base = {s: (before[s] + after[s]) / 2 for s in before}
        mine = {s: t for s, t, _ in r["persisted"]["times"]}
        ratios = [mine[s] / base[s] for s in during if s in base]
        saves = [t for s, t, _ in r["node_only"]["times"] if s % every == 0 and s > every]
        plain = [t for s, t, _ in r["node_only"]["times"] if s % every and s > every]
        # The same run's own steps that neither saved nor persisted.
        idle = [t for s, t, busy in r["persisted"]["times"] if not busy and s % every and s > every]
        out[f"rank{rank}"] = {
            "ratio_while_persisting_over_same_run_idle":
                statistics.median([mine[s] for s in during if s % every]) / statistics.median(idle)
                if during and idle else None,
            "steps_while_persisting": len(during),
            "step_s_while_persisting": spread([mine[s] for s in during]) if during else None,
            "step_s_same_steps_node_only": spread([base[s] for s in during]) if during else None,
            "node_only_after_over_before": statistics.median(after.values())
            / statistics.median(before.values()),
            "ratio_step_while_persisting_over_node_only":
                statistics.median([mine[s] for s in during])
                / statistics.median([base[s] for s in during]) if during else None,
            "per_step_ratio": spread(ratios) if ratios else None,
            "plain_step_s": spread(plain), "save_step_s": spread(saves),
        }
    until = results[0]["persisted"]["until"]
    out["steps_until_persisted"] = spread([float(u) for u in until]) if until else None
    return out


def torch_bench_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="512MiB", help="persist: the region's bytes")
    parser.add_argument("--state", default="512MiB", help="blocked/restore: the state's bytes")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="steps: node saves")
    parser.add_argument("--durable-every", type=int, default=50, help="steps: persisted saves")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--only", default="persist,blocked,steps")
    parser.add_argument("--dir", default="", help="where the durable files go (a real disk)")
    args = parser.parse_args()
    size, state = parse_size(args.size), parse_size(args.state)
    torch.set_num_threads(1)
    arena = max(1024, (size + 6 * state) // MiB + 512)
    report: Dict[str, Any] = {"bench": "tiers", "rounds": args.rounds}
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        rt = os.path.join(tmp, "rt")
        os.mkdir(rt, 0o700)
        daemon = torch_bench.start_daemon(
            rt, arena=f"{arena}MiB", chunk="256MiB",
            extra=[f"--regions-max-bytes={arena}MiB", "--regions-uid-max-bytes=0"])
        try:
            if "persist" in args.only:
                report["persist"] = bench_persist(rt, tmp, size, args.rounds)
            if "blocked" in args.only:
                report["blocked_restore"] = bench_blocked_and_restore(rt, tmp, state, args.rounds)
            if "steps" in args.only:
                report["steps"] = bench_steps(rt, tmp, args.steps, args.every, args.durable_every,
                                              args.width)
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
