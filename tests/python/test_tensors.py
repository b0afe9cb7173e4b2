"""Saved-tensor semantics through offload_activations and the explicit API."""

from __future__ import annotations

import pytest
import torch

import memoffload
import memoffload.torch as mot
import contextlib

from conftest import assert_arena_empty, bit_equal


class SaveAndCheck(torch.autograd.Function):
    """Saves the given tensors; backward checks each comes back exactly as it
    was (values, dtype, sizes, strides, storage offset) and returns grad * 2."""

    @staticmethod
    def forward(ctx, x, *saved):
        ctx.expect = [
            (t.detach().clone(), t.dtype, t.shape, t.stride(), t.storage_offset()) for t in saved
        ]
        ctx.save_for_backward(*saved)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        got = ctx.saved_tensors
        SaveAndCheck.seen = got
        for t, (value, dtype, shape, stride, offset) in zip(got, ctx.expect):
            assert t.dtype == dtype and t.shape == shape
            assert t.stride() == stride and t.storage_offset() == offset
            assert bit_equal(t, value)
        return (grad * 2,) + (None,) * len(got)


def run_saving(daemon, *tensors, min_tensor_bytes=0):
    x = torch.randn(8, requires_grad=True)
    with mot.offload_activations(min_tensor_bytes=min_tensor_bytes, runtime_dir=daemon.runtime_dir) as ctx:
        y = SaveAndCheck.apply(x, *tensors)
    ctx.prefetch()
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((8,), 2.0))
    return ctx


def test_tensor_and_transpose_restore_as_views_of_one_storage(daemon):
    a = torch.randn(64, 32)
    before = mot.get_offloader(daemon.runtime_dir).stats()
    run_saving(daemon, a, a.t(), a)  # saved three times: one storage
    got = SaveAndCheck.seen
    ptr = got[0].storage().data_ptr()
    assert got[1].storage().data_ptr() == ptr and got[2].storage().data_ptr() == ptr
    assert ptr != a.storage().data_ptr()  # really restored from the arena
    assert torch.equal(got[1], got[0].t())
    s = mot.get_offloader(daemon.runtime_dir).stats()
    assert s["offloaded_bytes"] - before["offloaded_bytes"] == a.numel() * 4
    assert s["deduplicated"] - before["deduplicated"] == 2
    del got
    SaveAndCheck.seen = None
    assert_arena_empty(daemon)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
)
def test_dtypes(daemon, dtype):
    if dtype == torch.bool:
        t = torch.rand(33, 17) > 0.5
    elif dtype == torch.int64:
        t = torch.randint(-(2**40), 2**40, (33, 17))
    else:
        t = torch.randn(33, 17).to(dtype)
    before = mot.get_offloader(daemon.runtime_dir).stats()
    run_saving(daemon, t, t[5:, 3:].t())  # values compared bit for bit in backward
    got = SaveAndCheck.seen
    assert got[0].storage()._cdata == got[1].storage()._cdata != t.storage()._cdata
    s = mot.get_offloader(daemon.runtime_dir).stats()
    assert s["offloaded_bytes"] - before["offloaded_bytes"] == t.numel() * t.element_size()
    assert s["prefetched_bytes"] - before["prefetched_bytes"] == t.numel() * t.element_size()
    del got
    SaveAndCheck.seen = None
    assert_arena_empty(daemon)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_gradients_exact(daemon, dtype):
    """Gradients through ops that save tensors of each float dtype, with and
    without offload, bit for bit (float16 on CPU: only elementwise mul)."""
    torch.manual_seed(3)
    x0 = torch.randn(48, 48).to(dtype)
    w0 = torch.randn(48, 48).to(dtype)

    def run(offload: bool):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        block = (
            mot.offload_activations(runtime_dir=daemon.runtime_dir)
            if offload
            else contextlib.nullcontext()
        )
        with block:
            h = x * 1.5
            g = h * h.t()  # saves h and its transpose: one storage
            out = (g * w) * g  # saves g (twice) and w (a leaf: kept)
            if dtype != torch.float16:  # no matmul for half on CPU
                out = out @ h
        loss = out.float().sum()
        loss.backward()
        return loss, x.grad, w.grad

    off = mot.get_offloader(daemon.runtime_dir)
    before = off.stats()
    loss, gx, gw = run(True)
    off.flush()
    s = off.stats()
    loss_ref, gx_ref, gw_ref = run(False)
    assert bit_equal(loss, loss_ref)
    assert bit_equal(gx, gx_ref) and bit_equal(gw, gw_ref)
    offloaded = s["offloaded_bytes"] - before["offloaded_bytes"]
    assert offloaded >= 2 * 48 * 48 * x0.element_size()  # h and g at least
    assert s["prefetched_bytes"] - before["prefetched_bytes"] == offloaded
    assert s["deduplicated"] > before["deduplicated"]
    assert_arena_empty(daemon)


def test_bfloat16_mlp_exact(daemon):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)
    ).to(torch.bfloat16)
    ref = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)
    ).to(torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    with mot.offload_activations(runtime_dir=daemon.runtime_dir):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    ref(x).float().pow(2).mean().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert bit_equal(a.grad, b.grad)
    del loss
    assert_arena_empty(daemon)


def test_zero_size_noncontiguous_offset_and_expanded(daemon):
    base = torch.randn(10, 12)
    cases = [
        torch.empty(0, 5),
        base[:, ::3],  # non-contiguous
        base[4:],  # storage offset
        base.t()[2:5],  # transposed with offset
        torch.randn(1, 6).expand(4, 6),  # stride 0
        torch.randn(3, 4, 5).permute(2, 0, 1),
    ]
    run_saving(daemon, *cases)
    got = SaveAndCheck.seen
    assert got[1].storage().data_ptr() == got[2].storage().data_ptr() == got[3].storage().data_ptr()
    SaveAndCheck.seen = None
    del got
    assert_arena_empty(daemon)


def test_unpacked_tensor_over_the_arena_holds_its_group(daemon):
    """On CPU an unpacked tensor is a view of the arena bytes themselves: its
    group's space stays reserved while the tensor lives (here past the end of
    backward), and writing into it changes nothing in another group."""
    a = torch.randn(256, 64)
    b = torch.randn(256, 64)
    run_saving(daemon, a)
    kept = SaveAndCheck.seen[0]
    SaveAndCheck.seen = None
    mot.get_offloader(daemon.runtime_dir).flush()
    s = daemon.status()
    assert s["groups"] == 1 and s["used_bytes"] > 0, s  # held by `kept` alone
    kept.add_(1.0)  # writes into the first group's bytes only
    run_saving(daemon, b)  # backward compares b bit for bit
    assert bit_equal(SaveAndCheck.seen[0], b)
    SaveAndCheck.seen = None
    assert bit_equal(kept, a + 1.0)
    del kept
    assert_arena_empty(daemon)


def test_small_tensors_stay(daemon):
    t = torch.randn(4)
    before = mot.get_offloader(daemon.runtime_dir).stats()["offloaded_bytes"]
    ctx = run_saving(daemon, t, min_tensor_bytes=1 << 10)
    assert SaveAndCheck.seen[0].storage().data_ptr() == t.storage().data_ptr()
    assert ctx.stats()["kept_small_bytes"] == 16
    assert mot.get_offloader(daemon.runtime_dir).stats()["offloaded_bytes"] == before
    SaveAndCheck.seen = None


@pytest.mark.parametrize("what", ["input", "output"])
def test_inplace_after_save_raises(daemon, what):
    """PyTorch 1.13 skips its version check when saved_tensors_hooks are in use;
    memoffload checks the version counter itself and raises the usual error."""
    for offload in (False, True):
        a = torch.randn(50, 50, requires_grad=True)
        h = a * 1.0
        if offload:
            ctx = mot.offload_activations(runtime_dir=daemon.runtime_dir)
            ctx.__enter__()
        if what == "input":
            y = h.sin()  # saves its input h
        else:
            y = h.exp()  # saves its output y
        if offload:
            ctx.__exit__(None, None, None)
        (h if what == "input" else y).mul_(2)
        # PyTorch's own check (plain RuntimeError) without offload; with it,
        # memoffload's, which carries FAILED_PRECONDITION.
        expected = memoffload.FailedPrecondition if offload else RuntimeError
        with pytest.raises(expected) as raised:
            y.sum().backward()
        if offload:
            assert raised.value.code == memoffload.StatusCode.FAILED_PRECONDITION
        del raised  # its traceback holds the graph
    del y, h
    assert_arena_empty(daemon)


def test_explicit_api(daemon):
    off = mot.get_offloader(daemon.runtime_dir)
    a = torch.randn(128, 64)
    b = torch.arange(1000)
    off.offload_group(9_000_001, [a, a.t(), b[10:20]], 0, -1)
    off.prefetch_group(9_000_001)
    x, xt, bs = off.get_group(9_000_001)
    assert torch.equal(x, a) and torch.equal(xt, a.t()) and torch.equal(bs, b[10:20])
    assert xt.storage().data_ptr() == x.storage().data_ptr() != a.storage().data_ptr()
    assert bs.storage_offset() == 10
    off.release_group(9_000_001)
    with pytest.raises(memoffload.NotFound) as raised:
        off.get(9_000_001, 0)
    assert raised.value.code == memoffload.StatusCode.NOT_FOUND
    assert_arena_empty(daemon, off)


def test_native_pack_keeps_parameters_as_isinstance_says(daemon):
    """The native pack hook answers isinstance(t, nn.Parameter) without the
    metaclass's Python frame: a Parameter, a subclass of it, a tensor flagged
    _is_param, a view of a Parameter and a detached, frozen parameter-like
    tensor stay in place; a plain tensor (also one whose _is_param is false)
    becomes a native SavedEntry that unpacks to its values."""
    from memoffload import _C
    from memoffload.torch import _Counters, _make_pack, _ParamSkip, _unpack

    class MyParam(torch.nn.Parameter):
        pass

    flagged = torch.randn(64)
    flagged._is_param = True
    unflagged = torch.randn(64)
    unflagged._is_param = False
    frozen = torch.nn.Parameter(torch.randn(64), requires_grad=False)
    kept = [torch.nn.Parameter(torch.randn(64)), MyParam(torch.randn(64)), flagged, frozen,
            frozen[8:40]]
    plain = [torch.randn(64), unflagged]
    off = mot.get_offloader(daemon.runtime_dir)
    with mot.offload_activations(runtime_dir=daemon.runtime_dir) as ctx:
        counters = _Counters()
        pack = _make_pack(off, ctx.key, 0, _ParamSkip([]), counters)
        for t in kept:
            assert pack(t) is t
        handles = [pack(t) for t in plain]
    assert all(type(h) is _C.SavedEntry for h in handles)
    with pytest.raises(TypeError):
        _C.SavedEntry()
    for h, t in zip(handles, plain):
        assert torch.equal(_unpack(h), t)
    assert counters.native.param_bytes == 4 * 64 * 4 + 32 * 4
    del handles, h  # the loop variable holds the last entry
    assert_arena_empty(daemon, off)
