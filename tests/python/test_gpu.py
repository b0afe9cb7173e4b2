"""GPU versions of the key cases (CUDA copy engine). Skipped without a device."""

from __future__ import annotations

import pytest
import torch

import memoffload.torch as mot
from conftest import assert_arena_empty, clone_model, step_both
from models import DecoderStack, tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")


def test_decoder_stack_exact_on_gpu(daemon):
    torch.manual_seed(0)
    model = DecoderStack(layers=4).cuda()
    ref = clone_model(model)
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    for _ in range(3):
        step_both(model, ref, tokens().cuda())
    s = handle.stats()
    handle.remove()
    assert s["engine"] == "cuda"
    assert s["offloaded_bytes"] > 0
    assert_arena_empty(daemon)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_transpose_and_dtypes_on_gpu(daemon, dtype):
    a = (torch.randn(64, 32, device="cuda") * 100).to(dtype)
    off = mot.get_offloader(daemon.runtime_dir)
    off.offload_group(8_000_001, [a, a.t()], torch.cuda.current_stream().cuda_stream, -1)
    off.prefetch_group(8_000_001)
    x, xt = off.get_group(8_000_001)
    assert x.is_cuda and torch.equal(x, a) and torch.equal(xt, a.t())
    assert xt.data_ptr() == x.data_ptr() != a.data_ptr()
    off.release_group(8_000_001)
    assert_arena_empty(daemon, off)


def test_offload_frees_device_memory(daemon):
    torch.manual_seed(1)
    model = DecoderStack(layers=4, dim=256).cuda()
    t = tokens(batch=16, length=128).cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = model(t)
    plain = torch.cuda.memory_allocated() - base
    loss.backward()
    del loss
    handle = mot.offload_layers(model.layers, min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    loss = model(t)
    handle.flush()
    offloaded = torch.cuda.memory_allocated() - base
    loss.backward()
    handle.remove()
    assert offloaded < plain * 0.6, (offloaded, plain)
