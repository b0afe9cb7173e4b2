#!/usr/bin/env python3
"""memoffload on a GPU, each figure next to a baseline measured in the same run.

    .venv/bin/python bench/gpu_bench.py [--runtime-dir DIR] [--device N] [--quick]

Prints one JSON object per line:

1. copies: D2H and H2D GB/s of one tensor through the arena (offload_group +
   flush; prefetch_group + get_group), next to torch copies of the same bytes
   into and out of a pinned host tensor and a pageable one.
2. overlap: a matmul loop alone, arena D2H copies alone, and both at once.
   overlap = (compute + copies - both) / min(compute, copies): 1 when the
   copies hide entirely behind compute, 0 when they run one after the other.
3. register: in a new process, the first offload through a fresh session
   with the CUDA engine (attach, and registration of the one arena chunk
   it lands in with cuMemHostRegister) next to the same with the host engine
   (attach alone); the difference per GiB of chunk is the registration's
   cost, next to cudaHostAlloc (torch.empty(pin_memory=True)),
   pin_memory() of a pageable tensor and cudaHostRegister of faulted pageable
   memory, all of one chunk's bytes, in that same process.
4. checkpoint: dcp.save and dcp.load (one process, no process group) of a
   state dict on the device through memoffload.torch.checkpoint (copies
   straight between the device and the region) next to FileSystemWriter /
   FileSystemReader into a temporary directory on local disk (warm page
   cache: what a restart on the same node reads), GB/s of the state's bytes.
5. step: training step time and peak device memory of a small Llama-like
   decoder (RMSNorm, rotary-free attention through scaled_dot_product_attention,
   SwiGLU MLP, bf16) without offload, with offload_layers, and with a per-rank
   pinned pool (torch.autograd.graph.save_on_cpu(pin_memory=True): what
   torchtune's and TransformerEngine's CPU offload amount to), medians of
   interleaved steps.

Exit 77 with a message when there is no CUDA device (CTest: skipped, label
gpu). --cpu-smoke runs the same code on the CPU with tiny sizes and no pinned
memory, so the script itself is tested where there is no GPU; its numbers
mean nothing. Without --runtime-dir it starts $MEMOFFLOAD_BIN_DIR/memoffloadd
(default build/bin) with an arena large enough for the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


class Device:
    """The device under test and how to wait for it."""

    def __init__(self, cpu_smoke: bool, index: int):
        self.cuda = not cpu_smoke
        self.torch = torch.device("cuda", index) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(index)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.torch)

    def stream(self) -> int:
        return torch.cuda.current_stream(self.torch).cuda_stream if self.cuda else 0

    def host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and self.cuda)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.torch)


def timed(dev: Device, fn) -> float:
    dev.sync()
    start = time.perf_counter()
    fn()
    dev.sync()
    return time.perf_counter() - start


def bench_copies(dev: Device, off, nbytes: int, rounds: int) -> dict:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev.torch)
    back = torch.empty_like(src)
    pinned, pageable = dev.host(nbytes, True), dev.host(nbytes, False)
    d2h = {"arena": [], "pinned": [], "pageable": []}
    h2d = {"arena": [], "pinned": [], "pageable": []}
    for r in range(rounds):
        key = 9_000_000 + r
        d2h["arena"].append(timed(dev, lambda: (off.offload_group(key, [src], dev.stream()),
                                                off.flush())))
        got = []
        h2d["arena"].append(timed(dev, lambda: (off.prefetch_group(key),
                                                got.extend(off.get_group(key, dev.stream())))))
        if not torch.equal(got[0], src):
            raise SystemExit("gpu_bench: the bytes that came back differ")
        off.release_group(key)
        for name, host in (("pinned", pinned), ("pageable", pageable)):
            d2h[name].append(timed(dev, lambda: host.copy_(src, non_blocking=True)))
            h2d[name].append(timed(dev, lambda: back.copy_(host, non_blocking=True)))
    gbps = {f"{direction}_{name}_gbps": nbytes / statistics.median(v) / 1e9
            for direction, table in (("d2h", d2h), ("h2d", h2d)) for name, v in table.items()}
    row = {"bench": "gpu_copies", "bytes": nbytes, "rounds": rounds, **gbps}
    row["d2h_arena_vs_pinned"] = gbps["d2h_arena_gbps"] / gbps["d2h_pinned_gbps"]
    row["h2d_arena_vs_pinned"] = gbps["h2d_arena_gbps"] / gbps["h2d_pinned_gbps"]
    return row


def register_probe(runtime_dir: str, chunk_bytes: int, cuda: bool) -> dict:
    """Runs in a process of its own (--register-probe): see the file comment."""
    from memoffload import _C

    if cuda:
        torch.zeros(1, device="cuda")  # the context exists before anything is timed
    tiny = torch.ones(1024, device="cuda" if cuda else "cpu")
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0
    first = {}
    for engine in ("host", "cuda"):
        off = _C.GroupOffloader(runtime_dir=runtime_dir, job_id="gpu-bench-register",
                                use_cuda=engine == "cuda")
        start = time.perf_counter()
        off.offload_group(1, [tiny], stream)
        off.flush()
        if cuda:
            torch.cuda.synchronize()
        first[engine] = time.perf_counter() - start
        stats = off.stats()
        off.release_group(1)
        off.flush()
        first[engine + "_engine"] = stats["engine"]
        if engine == "cuda":
            first["unpinned"] = stats["unpinned_bytes"]
        del off
    gib = chunk_bytes / 2**30
    row = {"bench": "gpu_register", "chunk_bytes": chunk_bytes,
           "attach_s": first["host"], "attach_register_s": first["cuda"],
           "engines": [first["host_engine"], first["cuda_engine"]],
           "register_s_per_gib": max(0.0, first["cuda"] - first["host"]) / gib}
    row["unpinned_bytes"] = first["unpinned"]
    if cuda:
        # The baselines, each of one chunk's bytes; one that fails is
        # recorded as such and does not cost the figures above.
        def per_gib(name, fn):
            try:
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                row[f"{name}_s_per_gib"] = (time.perf_counter() - t) / gib
            except Exception as e:  # recorded in the row, never hidden
                row[f"{name}_s_per_gib"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"

        per_gib("cuda_host_alloc",
                lambda: torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True))
        pageable = torch.ones(chunk_bytes, dtype=torch.uint8)  # faulted, like the arena
        per_gib("pin_memory", lambda: pageable.pin_memory())
        cudart = torch.cuda.cudart()

        def register():
            err = cudart.cudaHostRegister(pageable.data_ptr(), chunk_bytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister returned {err}")

        per_gib("cuda_host_register", register)
        if row["cuda_host_register_s_per_gib"] is not None:
            cudart.cudaHostUnregister(pageable.data_ptr())
            row["register_vs_cuda_host_register"] = (
                row["register_s_per_gib"] / row["cuda_host_register_s_per_gib"])
    return row


def bench_register(dev: Device, runtime_dir: str) -> dict:
    """register_probe in a new process (a fresh CUDA context, no mapping yet)."""
    import subprocess

    import memoffload.torch as mot

    chunk = int(mot.daemon_status(runtime_dir)["chunk_size_bytes"])
    args = [sys.executable, os.path.abspath(__file__), "--register-probe", runtime_dir,
            str(chunk)] + ([] if dev.cuda else ["--cpu-smoke"])
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"gpu_bench: the registration probe failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_checkpoint(dev: Device, runtime_dir: str, nbytes: int, tensors: int, rounds: int) -> dict:
    import uuid
    import warnings

    import torch.distributed.checkpoint as dcp
    from memoffload.torch.checkpoint import store
    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter

    gen = torch.Generator().manual_seed(7)
    each = nbytes // tensors // 2  # bf16 elements
    state = {f"t{i}": torch.randn(each, generator=gen).to(torch.bfloat16).to(dev.torch)
             for i in range(tensors)}
    back = {k: torch.empty_like(v) for k, v in state.items()}
    job = f"gpu-bench-{uuid.uuid4().hex[:8]}"
    kw = dict(job_id=job, runtime_dir=runtime_dir)
    times = {"save_arena": [], "load_arena": [], "save_disk": [], "load_disk": []}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as disk, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "single process" from DCP
        writer = MemoffloadWriter(keep_last=1, fallback_dir=os.path.join(disk, "fallback"), **kw)
        for r in range(rounds):
            times["save_arena"].append(timed(dev, lambda: dcp.save(
                state, storage_writer=writer, checkpoint_id=f"r{r}", no_dist=True)))
            reader = MemoffloadReader(fallback_dir=os.path.join(disk, "fallback"), **kw)
            times["load_arena"].append(timed(dev, lambda: dcp.load(
                back, storage_reader=reader, checkpoint_id=f"r{r}", no_dist=True)))
            mode = (writer.last_mode, reader.last_mode)
            if mode != ("daemon", "daemon") or not all(torch.equal(back[k], v) for k, v in state.items()):
                raise SystemExit(f"gpu_bench: the checkpoint through the daemon failed ({mode})")
            path = os.path.join(disk, f"fs{r}")
            times["save_disk"].append(timed(dev, lambda: dcp.save(
                state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)))
            times["load_disk"].append(timed(dev, lambda: dcp.load(
                back, storage_reader=dcp.FileSystemReader(path), no_dist=True)))
            shutil.rmtree(path)
        s, _ = store.attach(runtime_dir, job, -1, True)
        for info in store.stored_checkpoints(s).values():
            store.delete_checkpoint(s, info)
        store.forget_all()
    med = {k: statistics.median(v) for k, v in times.items()}
    size = sum(v.numel() * v.element_size() for v in state.values())
    row = {"bench": "gpu_checkpoint", "bytes": size, "tensors": tensors, "rounds": rounds,
           **{f"{k}_gbps": size / v / 1e9 for k, v in med.items()}}
    row["save_arena_vs_disk"] = med["save_disk"] / med["save_arena"]
    row["load_arena_vs_disk"] = med["load_disk"] / med["load_arena"]
    return row


def bench_overlap(dev: Device, off, nbytes: int, dim: int, rounds: int) -> dict:
    a = torch.randn(dim, dim, device=dev.torch)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev.torch)

    def compute():
        x = a
        for _ in range(8):
            x = x @ a
            x = x / x.norm()

    def copies(base_key):
        off.offload_group(base_key, [src], dev.stream())

    def both(base_key):
        copies(base_key)
        compute()
        off.flush()

    samples = {"compute": [], "copies": [], "both": []}
    for r in range(rounds):
        samples["compute"].append(timed(dev, compute))
        samples["copies"].append(timed(dev, lambda: (copies(9_100_000 + r), off.flush())))
        off.release_group(9_100_000 + r)
        samples["both"].append(timed(dev, lambda: both(9_200_000 + r)))
        off.release_group(9_200_000 + r)
    c, x, b = (statistics.median(samples[k]) for k in ("compute", "copies", "both"))
    return {"bench": "gpu_overlap", "bytes": nbytes, "compute_s": c, "copies_s": x, "both_s": b,
            "overlap": (c + x - b) / min(c, x)}


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        hidden = 8 * dim // 3
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), tokens.flatten())


def bench_step(dev: Device, runtime_dir: str, shape: dict, steps: int) -> dict:
    """Two copies of one model: one with offload_layers installed once (as a
    training script does), the other run plain and under save_on_cpu, timed
    in interleaved steps after two warm-up rounds. Peak bytes are device
    memory allocated during the step above what was allocated before it."""
    import copy

    import memoffload.torch as mot

    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.cuda else torch.float32
    model = Llama(shape["layers"], shape["dim"], shape["heads"], shape["vocab"]).to(dev.torch, dtype)
    off_model = copy.deepcopy(model)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=dev.torch)
    handle = mot.offload_layers(off_model.layers, runtime_dir=runtime_dir)

    def step(m: nn.Module) -> None:
        m(tokens).backward()
        m.zero_grad(set_to_none=True)

    def pinned_pool() -> None:
        with torch.autograd.graph.save_on_cpu(pin_memory=dev.cuda):
            step(model)

    def offload() -> None:
        step(off_model)
        handle.flush()  # queued Releases belong to this step

    variants = {"none": lambda: step(model), "offload": offload, "pinned_pool": pinned_pool}
    times = {k: [] for k in variants}
    peaks = {k: 0 for k in variants}
    for i in range(steps + 2):
        for name, fn in variants.items():  # interleaved: noise hits all alike
            dev.sync()
            dev.reset_peak()
            before = torch.cuda.memory_allocated(dev.torch) if dev.cuda else 0
            t = timed(dev, fn)
            if i >= 2:
                times[name].append(t)
                peaks[name] = max(peaks[name], dev.peak_bytes() - before)
    stats = handle.stats()
    handle.remove()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"bench": "gpu_step", **shape, "steps": steps, "dtype": str(dtype),
            **{f"{k}_step_s": v for k, v in med.items()},
            **{f"{k}_peak_bytes": v for k, v in peaks.items()},
            "offload_vs_none": med["offload"] / med["none"],
            "offload_vs_pinned_pool": med["offload"] / med["pinned_pool"],
            "offloaded_bytes": stats["offloaded_bytes"], "engine": stats["engine"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime-dir")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run on the CPU with tiny sizes (tests the script only)")
    parser.add_argument("--register-probe", nargs=2, metavar=("RUNTIME_DIR", "CHUNK_BYTES"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.register_probe:
        emit(register_probe(args.register_probe[0], int(args.register_probe[1]),
                            cuda=not args.cpu_smoke))
        return 0
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (torch.cuda.is_available() is False): nothing measured",
              file=sys.stderr)
        return 77
    dev = Device(args.cpu_smoke, args.device)
    import memoffload.torch as mot
    from torch_bench import start_daemon

    small = args.cpu_smoke
    rounds = 2 if small else (3 if args.quick else 7)
    shape = (dict(layers=2, dim=64, heads=4, vocab=128, batch=2, seq=16) if small else
             dict(layers=8, dim=2048, heads=16, vocab=32000, batch=4, seq=2048))
    with tempfile.TemporaryDirectory() as tmp:
        daemon = None
        runtime_dir = args.runtime_dir
        if runtime_dir is None:
            runtime_dir = tmp
            daemon = start_daemon(tmp, arena="256MiB" if small else "24GiB",
                                  chunk="64MiB" if small else "1GiB")
        try:
            off = mot.get_offloader(runtime_dir)
            emit({"bench": "gpu_info", "device": torch.cuda.get_device_name(dev.torch)
                  if dev.cuda else "cpu (smoke run: numbers mean nothing)",
                  "torch": torch.__version__, "engine": off.stats()["engine"]})
            for nbytes in ([1 << 20] if small else [64 << 20, 512 << 20]):
                emit(bench_copies(dev, off, nbytes, rounds))
            emit(bench_register(dev, runtime_dir))
            # 2 GiB through the disk per round: 3 rounds bound the time.
            emit(bench_checkpoint(dev, runtime_dir, (8 << 20) if small else (2 << 30),
                                  4 if small else 32, min(rounds, 3)))
            emit(bench_overlap(dev, off, (1 << 20) if small else (256 << 20),
                               64 if small else 8192, rounds))
            emit(bench_step(dev, runtime_dir, shape, 2 if small else (5 if args.quick else 10)))
        finally:
            mot.forget_offloader(runtime_dir)
            if daemon is not None:
                daemon.terminate()
                daemon.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
