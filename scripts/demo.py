#!/usr/bin/python3
"""memoffload demo: train a small Transformer on CPU, offloading its layers'
activations through a running memoffloadd, next to the same model trained
without offload, and compare losses and gradients bit for bit.

    scripts/demo.py --runtime-dir DIR [--steps N]

Starts nothing itself: `scripts/run.sh --demo` starts the daemon first.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from torch import nn

import memoffload.torch as mot  # installed by scripts/venv.sh (pip install ./client/python)


def mib(n: int) -> str:
    return f"{n / (1 << 20):7.2f} MiB"


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        logits = self.head(self.encoder(self.embed(tokens), mask=mask))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-dir", default=os.environ.get("MEMOFFLOAD_RUNTIME_DIR", ""))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # predictable on a shared 2-core machine
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    # A fixed "text": a repeating pattern the model can learn quickly.
    data = torch.arange(args.batch * (args.seq + 64)).remainder(97).view(args.batch, -1)

    try:
        status = mot.daemon_status(args.runtime_dir)
    except RuntimeError as e:
        print(f"demo: no memoffloadd at {args.runtime_dir or 'the default runtime dir'}: {e}")
        return 1
    print(
        f"memoffloadd {status['version']} at {status['runtime_dir']}: arena "
        f"{mib(status['capacity_bytes'])}, {status['chunks']} chunk(s)"
    )
    handle = mot.offload_layers(
        model.encoder.layers, min_tensor_bytes=64 << 10, runtime_dir=args.runtime_dir
    )
    print(
        f"offloading {len(model.encoder.layers) - 1} of {len(model.encoder.layers)} layers; "
        f"{args.steps} steps of batch {args.batch} x {args.seq} tokens on CPU"
    )

    identical = True
    prev = handle.stats()
    t_off = t_ref = 0.0
    for step in range(1, args.steps + 1):
        start = step % 64
        batch = data[:, start : start + args.seq]
        opt.zero_grad()
        opt_ref.zero_grad()

        t0 = time.perf_counter()
        loss = model(batch)
        handle.flush()
        in_use = mot.daemon_status(args.runtime_dir)["used_bytes"]  # between forward and backward
        loss.backward()
        t_off += time.perf_counter() - t0
        t0 = time.perf_counter()
        loss_ref = ref(batch)
        loss_ref.backward()
        t_ref += time.perf_counter() - t0

        same = torch.equal(loss, loss_ref) and all(
            torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters())
        )
        identical = identical and same
        opt.step()
        opt_ref.step()
        s = handle.stats()
        print(
            f"step {step:3d}  loss {loss.item():.4f}  offloaded {mib(s['offloaded_bytes'] - prev['offloaded_bytes'])}"
            f"  prefetched {mib(s['prefetched_bytes'] - prev['prefetched_bytes'])}"
            f"  arena in use {mib(in_use)}  skipped {mib(s['skipped_bytes'] - prev['skipped_bytes'])}"
            f"  {'identical' if same else 'DIFFERENT'}"
        )
        prev = s

    handle.flush()
    s = handle.stats()
    after = mot.daemon_status(args.runtime_dir)
    handle.remove()
    print("---")
    print(
        f"total offloaded {mib(s['offloaded_bytes'])}, prefetched {mib(s['prefetched_bytes'])}, "
        f"skipped {mib(s['skipped_bytes'])}; blocking RPCs {s['blocking_rpcs']} (attach only after "
        f"step 1); arena in use after training {mib(after['used_bytes'])}"
    )
    print(f"step time with offload {t_off / args.steps * 1e3:.1f} ms, without {t_ref / args.steps * 1e3:.1f} ms")
    if identical:
        print(f"losses and gradients of all {args.steps} steps are bit-identical to training without offload")
        return 0
    print("MISMATCH: losses or gradients differ from training without offload")
    return 1


if __name__ == "__main__":
    sys.exit(main())
