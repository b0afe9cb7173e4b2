"""Training on a GPU the ways the GPU kit's run must cover (issue 28): several
ranks on one device sharing one daemon, FSDP2 over NCCL, a step captured in a
CUDA graph, compiled layers, a daemon restart between steps, and DCP
checkpoints of CUDA tensors. Each is marked gpu and skipped without a device;
where the same case runs on the CPU, its CPU twin runs everywhere, so that the
test's own logic is proven before a GPU ever sees it."""

from __future__ import annotations

import copy
import json
import time
import uuid

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import fsdp_worker
import memoffload.torch as mot
import ranks_worker
from conftest import assert_arena_empty, bin_dir, bit_equal, clone_model, free_port, step_both
from models import DecoderStack, tokens

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def device(request) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return request.param



def _engine(device: str) -> str:
    return "cuda" if device == "cuda" else "host"


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_two_ranks_share_one_daemon_and_one_device(own_daemon, tmp_path, device):
    """Two processes, one daemon (and one GPU): both attach, register the
    arena and offload at once; each trains bit-identically to its plain copy."""
    job = f"ranks-{uuid.uuid4().hex[:8]}"
    barrier = mp.get_context("spawn").Barrier(2)
    mp.spawn(ranks_worker.run, args=(device, own_daemon.runtime_dir, str(tmp_path), job, 3, barrier),
             nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, result in enumerate(results):
        assert result["mismatches"] == [], result
        s = result["stats"]
        assert s["engine"] == _engine(device), s
        assert s["offloaded_bytes"] > 0 and s["prefetched_bytes"] > 0, s
        assert s["skipped_bytes"] == 0 and s["unpinned_bytes"] == 0, s
    assert results[0]["status_during"]["sessions"] == 2, results[0]["status_during"]
    assert own_daemon.status()["used_bytes"] == 0


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_fsdp2_on_one_rank_offloads_bit_exact(daemon, tmp_path, device):
    """fully_shard with world size 1 (NCCL on a GPU, gloo on the CPU)."""
    job = f"fsdp2-one-{uuid.uuid4().hex[:8]}"
    mp.spawn(fsdp_worker.run,
             args=(1, free_port(), ["fsdp2"], daemon.runtime_dir, str(bin_dir()), str(tmp_path), job,
                   3, True, (3, 64, 2, 32), device),
             nprocs=1)
    result = json.loads((tmp_path / "fsdp2-rank0.json").read_text())
    assert len(result["step_seconds"]) == 3, result
    assert result["mismatches"] == [], result["mismatches"]
    s = result["stats"]
    assert s["engine"] == _engine(device) and s["offloaded_bytes"] > 0, s
    assert s["skipped_bytes"] == result["stats_before"]["skipped_bytes"], s
    assert_arena_empty(daemon)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_daemon_restart_between_steps(own_daemon, device):
    """The daemon dies and comes back between steps: training goes on with
    exact gradients, the client attaches again (and registers the new
    instance's arena), and offload resumes."""
    torch.manual_seed(0)
    model = DecoderStack(layers=4).to(device)
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=own_daemon.runtime_dir)
    for _ in range(2):
        step_both(model, ref, tokens().to(device))
    handle.flush()
    before = handle.stats()
    own_daemon.kill()
    own_daemon.start()
    time.sleep(1.1)  # the reconnect interval
    for _ in range(3):
        step_both(model, ref, tokens().to(device))
    handle.flush()
    s = handle.stats()
    handle.remove()
    assert s["engine"] == _engine(device), s
    assert s["reconnects"] == before["reconnects"] + 1 and s["connected"], s
    assert s["offloaded_bytes"] > before["offloaded_bytes"], s
    assert s["unpinned_bytes"] == 0, s  # the new arena registered too
    assert_arena_empty(own_daemon)


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda"], indirect=True)
def test_compiled_layers_offload_bit_exact(daemon, device):
    """Per-layer torch.compile with Triton kernels (the CPU's is test_compile.py)."""
    torch.manual_seed(3)
    eager = DecoderStack(layers=2, dim=64, heads=4).to(device)
    model, ref = copy.deepcopy(eager), copy.deepcopy(eager)
    for m in (model, ref):
        for i, layer in enumerate(m.layers):
            m.layers[i] = torch.compile(layer)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    for step in range(3):
        gen = torch.Generator().manual_seed(40 + step)
        step_both(model, ref, torch.randint(0, 97, (2, 16), generator=gen).to(device))
    handle.flush()
    s = handle.stats()
    handle.remove()
    assert s["engine"] == _engine(device) and s["offloaded_bytes"] > 0, s
    assert s["skipped_bytes"] == 0, s
    assert_arena_empty(daemon)


class _Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                  nn.Linear(4 * dim, dim)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


@pytest.mark.gpu
def test_a_step_captured_in_a_cuda_graph_is_never_offloaded_and_replays_exactly(daemon):
    """Offload cannot run inside a CUDA graph capture (its copies and RPCs
    would not replay): the pack hook keeps those tensors on the device and
    counts them (capture_skipped); the captured step replays bit-identically
    to the same step captured without offload."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    torch.manual_seed(5)
    ref = _Mlp(256).cuda()
    model = copy.deepcopy(ref)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    static = torch.randn(64, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch's graph docs ask
        for m in (model, ref):
            for _ in range(2):
                m.zero_grad(set_to_none=True)
                m(static).backward()
    torch.cuda.current_stream().wait_stream(side)
    handle.flush()
    eager_offloaded = handle.stats()["offloaded_bytes"]
    assert eager_offloaded > 0  # outside a capture it does offload
    before = handle.stats()
    graphs, losses = [], []
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            loss = m(static)
            loss.backward()
        graphs.append(g)
        losses.append(loss)
    after = handle.stats()
    assert after["capture_skipped"] > before["capture_skipped"], after
    assert after["offloaded_bytes"] == before["offloaded_bytes"], after
    for step in range(3):
        static.copy_(torch.randn(64, 256, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(step)))
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
        assert bit_equal(losses[0], losses[1]), step
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert bit_equal(p.grad, q.grad), (step, name)
    handle.remove()
    assert_arena_empty(daemon)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_dcp_checkpoint_of_device_tensors_round_trips_like_the_file_system(daemon, tmp_path, device):
    """dcp.save / dcp.load of a state dict on the device through
    MemoffloadWriter / MemoffloadReader (copies straight into and out of the
    region), next to FileSystemWriter / FileSystemReader of the same state:
    both give back every tensor bit for bit, on the device."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from memoffload.torch.checkpoint import store
    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter

    gen = torch.Generator().manual_seed(11)
    state = {"w": torch.randn(256, 512, generator=gen).to(device),
             "b": torch.randn(512, generator=gen).to(torch.bfloat16).to(device),
             "step": torch.tensor(7, device=device)}
    job = f"dcp-dev-{uuid.uuid4().hex[:8]}"
    kw = dict(job_id=job, runtime_dir=daemon.runtime_dir, fallback_dir=str(tmp_path / "fb"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "single process" from DCP
        writer = MemoffloadWriter(keep_last=None, **kw)
        dcp.save(state, storage_writer=writer, checkpoint_id="s1", no_dist=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")), no_dist=True)
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        reader = MemoffloadReader(**kw)
        dcp.load(back, storage_reader=reader, checkpoint_id="s1", no_dist=True)
        from_fs = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(from_fs, storage_reader=dcp.FileSystemReader(str(tmp_path / "fs")), no_dist=True)
    assert writer.last_mode == "daemon" and reader.last_mode == "daemon"
    for key, value in state.items():
        assert back[key].device == value.device and bit_equal(back[key], value), key
        assert bit_equal(from_fs[key], value), key
    s, _ = store.attach(daemon.runtime_dir, job, -1, True)
    for info in store.stored_checkpoints(s).values():
        store.delete_checkpoint(s, info)
    store.forget_all()
