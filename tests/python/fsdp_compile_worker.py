"""One rank of FSDP2 + bf16 (MixedPrecisionPolicy and autocast) + each
layer compiled in place (``layer.compile()``) + ``offload_layers(...,
checkpoint=True)``, on CPU (gloo), started by mp.spawn from test_fsdp.py.

Issue 30 item 3 reported that this combination failed in backward with a
stride assertion, with offload disabled too. Each rank builds the same model
twice, offloaded and with ``enabled=False`` (same wrappers, same graphs),
trains both two steps on the same batches and writes to
``<out_dir>/compile-rank<r>.json`` whether it ran, the error if not, and
whether losses and local gradient shards matched bit for bit."""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import DecoderStack  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def run(rank: int, world: int, port: int, runtime_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import memoffload.torch as mot
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    result = {"ran": False, "error": "", "same": True, "offloaded_bytes": 0}
    try:
        torch.manual_seed(11)
        base = DecoderStack(layers=2, dim=32, heads=4)
        models = []
        for enabled in (True, False):
            m = copy.deepcopy(base)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in m.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(m, mp_policy=policy)
            for layer in m.layers:
                layer.compile()
            handle = mot.offload_layers(
                m.layers, min_tensor_bytes=0, runtime_dir=runtime_dir, enabled=enabled,
                checkpoint=True,
            )
            models.append((m, handle))
        for step in range(2):
            gen = torch.Generator().manual_seed(70 + step)
            batch = torch.randint(0, 97, (2, 16), generator=gen)
            losses = []
            for m, _ in models:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = m(batch)
                loss.backward()
                losses.append(loss.detach())
            (a, _), (b, _) = models
            result["same"] &= bool(torch.equal(_bits(losses[0]), _bits(losses[1])))
            for pa, pb in zip(a.parameters(), b.parameters()):
                result["same"] &= bool(torch.equal(_bits(pa.grad), _bits(pb.grad)))
                pa.grad = None
                pb.grad = None
        handle = models[0][1]
        handle.flush()
        result["offloaded_bytes"] = handle.stats()["offloaded_bytes"]
        for _, h in models:
            h.remove()
        result["ran"] = True
    except Exception as e:  # reported by the test, with the traceback
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-8)}"
    Path(out_dir, f"compile-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
