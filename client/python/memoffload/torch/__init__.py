"""Activation offload for PyTorch trainers through memoffloadd.

Two entry points:

* :func:`offload_layers` wraps the forward of each chosen layer; every forward
  invocation of a layer is one *group*. Tensors autograd saves inside it move
  into the arena after the layer's forward and come back, one
  ``prefetch_window`` ahead, during backward.
* :func:`offload_activations` offloads everything saved inside a ``with``
  block as one group.

Both use ``torch.autograd.graph.saved_tensors_hooks``. The native part
(:mod:`memoffload._C`) does the bookkeeping: storage-identity dedup, bump
placement in the group's reservation, the worker thread that runs Reserve,
copies, Commit, Prefetch and Release, the version check of saved tensors, and
the fallback that keeps a group in memory when the daemon cannot take it.

A saved tensor's handle releases its part of the group when autograd drops
it (after the node that used it ran, or when the graph dies); the group's
arena space is returned when its last handle is gone. So ``retain_graph=True``
keeps the data in the arena for a second backward, and a graph dropped without
backward releases everything it reserved.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

_MIN_TORCH = (2, 1)
_TESTED_TORCH = "2.13.0"


def _torch_release(version: str) -> tuple:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


if _torch_release(torch.__version__) < _MIN_TORCH:
    raise ImportError(
        f"memoffload needs torch >= {_MIN_TORCH[0]}.{_MIN_TORCH[1]} ({_TESTED_TORCH} is tested); "
        f"found torch {torch.__version__} at {os.path.dirname(torch.__file__)}"
    )
try:
    from .. import _C
except ImportError as exc:  # built against another torch, or not built at all
    raise ImportError(
        f"memoffload's native part (memoffload._C) does not load with torch {torch.__version__}: "
        f"{exc}. Reinstall it against this torch: "
        "pip install --no-build-isolation --force-reinstall <memoffload>/client/python"
    ) from exc
from .. import errors, logs  # noqa: E402
from ..checkpointing import (  # noqa: E402
    OWN_HOOK_ATTR,
    checkpointed,
    foreign_hooks_active,
    in_backward,
)

# What the native part logged after the last drain reaches the logger at
# exit too (before logging's own atexit handler shuts it down).
atexit.register(logs.drain, _C)

if _C.built_torch_version != torch.__version__.split("+")[0]:
    raise ImportError(
        f"memoffload._C was built against torch {_C.built_torch_version}, but torch "
        f"{torch.__version__} is imported: reinstall it against this torch "
        "(pip install --no-build-isolation --force-reinstall <memoffload>/client/python)"
    )

__all__ = [
    # MemoffloadCallback is provided lazily (module __getattr__ below) and is
    # not listed, so that `from memoffload.torch import *` does not import
    # transformers either.
    "GroupStats",
    "HandleStats",
    "OffloadHandle",
    "OffloadStats",
    "daemon_status",
    "find_layer_stack",
    "get_offloader",
    "offload_activations",
    "offload_layers",
]

# The process's offloaders (one session each), by (runtime dir, job id).
_offloaders: Dict[Tuple[str, str], "_C.GroupOffloader"] = {}
_offloaders_lock = threading.Lock()
_keys = itertools.count(1)
# Slots name recurring groups (a layer of one handle) so that the native side
# can reserve a group's space before its forward with last step's size.
_slot_bases = itertools.count(1)
_SLOT_STRIDE = 1 << 20
_ACTIVATIONS_SLOT = 0
# Saved tensors below this size stay in place: each cost ~20 us of fixed
# bookkeeping before the native hooks, more than its copy below ~16 KiB; the
# threshold was not re-derived since (docs/torch_measured.md).
DEFAULT_MIN_TENSOR_BYTES = 16 << 10


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "-1"))
    except ValueError:
        return -1


DEFAULT_JOB_ID = "torch"


def _job_id_of(job_id: Optional[str]) -> str:
    """``job_id``, else ``$MEMOFFLOAD_JOB_ID``, else ``"torch"``."""
    if job_id is not None and (not isinstance(job_id, str) or not job_id):
        raise errors.InvalidArgument(f"job_id must be a non-empty string or None, not {job_id!r}")
    return job_id or os.environ.get("MEMOFFLOAD_JOB_ID") or DEFAULT_JOB_ID


def get_offloader(runtime_dir: Optional[str] = None, job_id: Optional[str] = None) -> "_C.GroupOffloader":
    """The process's offloader (one session) for ``runtime_dir`` and ``job_id``.

    ``None`` or ``""`` means ``$MEMOFFLOAD_RUNTIME_DIR`` or the default runtime
    directory; ``job_id`` ``None`` means ``$MEMOFFLOAD_JOB_ID`` or ``"torch"``
    (the job ``memoffloadctl sessions`` and ``/metrics`` show, and the job
    quota the session counts against). One offloader per (runtime dir, job
    id). The first call attaches (the only blocking RPC of a steady training
    loop); without a daemon it still succeeds and every group stays in memory
    until a daemon appears there.
    """
    key = (runtime_dir or "", _job_id_of(job_id))
    with _offloaders_lock:
        off = _offloaders.get(key)
        if off is None:
            off = _C.GroupOffloader(
                runtime_dir=key[0],
                job_id=key[1],
                rank=_env_int("RANK"),
                local_rank=_env_int("LOCAL_RANK"),
            )
            _offloaders[key] = off
    logs.drain(_C)
    return off


def forget_offloader(runtime_dir: Optional[str] = None, job_id: Optional[str] = None) -> None:
    """Drops the cached offloader of ``runtime_dir`` and ``job_id`` (``None``:
    of every job id there); its session ends once no live graph uses it.
    Mostly for tests that start and stop daemons."""
    with _offloaders_lock:
        for key in list(_offloaders):
            if key[0] == (runtime_dir or "") and (job_id is None or key[1] == _job_id_of(job_id)):
                del _offloaders[key]


def daemon_status(runtime_dir: Optional[str] = None, timeout_ms: int = 5000) -> Dict[str, Any]:
    """The daemon's GetStatus (capacity, used, reserved, committed, ...).
    Raises :class:`memoffload.Unavailable` when no daemon answers."""
    return _C.daemon_status(runtime_dir or "", timeout_ms)


from ..counters import (  # noqa: E402
    GroupStats,
    HandleStats,
    OffloadStats,
    _Counters,
    _delta,
    _zero_stats,
)
from ..selection import LayerSelection, _selected  # noqa: E402
from ..param_skip import _ParamSkip  # noqa: E402
from . import _module_names  # noqa: E402


class _Packed:
    """What autograd keeps for an offloaded saved CUDA tensor (CPU tensors get
    a native ``_C.SavedEntry``). When autograd drops it, the entry is dropped;
    the group goes when its last entry does."""

    __slots__ = ("off", "key", "entry", "device", "__weakref__")

    def __init__(self, off: "_C.GroupOffloader", key: int, entry: int, device: torch.device) -> None:
        self.off = off
        self.key = key
        self.entry = entry
        self.device = device  # the device whose stream will use it

    def __del__(self) -> None:
        try:
            self.off.drop_entry(self.key, self.entry)
        except Exception:  # interpreter shutdown, or the group is gone
            pass


def _unpack_cuda(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Packed):
        # The consumer stream waits (on the GPU) for the copy back; the block
        # is not reused before that stream is done with it.
        stream = torch.cuda.current_stream(packed.device)
        t = packed.off.get(packed.key, packed.entry, stream.cuda_stream)
        if t.is_cuda:
            t.record_stream(stream)
        return t
    return packed


def _cuda_pack(off: "_C.GroupOffloader", key: int) -> Callable[[torch.Tensor], Any]:
    def pack(t: torch.Tensor) -> Any:
        stream = torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0
        # -1: the offloader cannot take this tensor; it counted it as skipped.
        entry = off.add(key, t, stream)
        if entry < 0:
            # Never a saved output as-is: see _C.PackHook's KeptInPlace.
            return t if t.is_leaf else t.detach()
        return _Packed(off, key, entry, t.device)

    return pack


# The unpack hook (native): a CPU tensor's entry comes back from the arena
# without a Python frame; CUDA handles go through _unpack_cuda.
_unpack = _C.UnpackHook(_unpack_cuda)


def _make_pack(
    off: "_C.GroupOffloader",
    key: int,
    min_tensor_bytes: int,
    is_param: _ParamSkip,
    counters: _Counters,
) -> Callable[[torch.Tensor], Any]:
    """The pack hook of group ``key`` (native, see client/torch/python_hooks.cc):
    small tensors, parameters, buffers and weight copies (``is_param``'s
    rules) stay in place and are counted in ``counters``; the rest goes into
    the group."""
    return _C.PackHook(
        off,
        key,
        min_tensor_bytes,
        is_param.storage_keys,
        is_param.offload_weights,
        counters.native,
        _cuda_pack(off, key),
    )


def _first_grad_tensor(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for item in out:
            t = _first_grad_tensor(item)
            if t is not None:
                return t
    return None


_HANDLE_ATTR = "_memoffload_handle"
# What OffloadHandle._enter tells a layer call to do besides offloading.
_AS_IS = object()  # the plain forward: nothing of ours applies
_RUN = object()  # the forward, checkpointed if asked, offloading nothing


class OffloadHandle:
    """Returned by :func:`offload_layers`: ``stats()``, ``step_stats()``,
    ``flush()`` and ``remove()``."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        offloaded: Set[int],
        prefetch_window: int,
        min_tensor_bytes: int,
        off: Optional["_C.GroupOffloader"],
        offload_weights: bool = False,
        strict: bool = False,
        checkpoint: bool = False,
        use_reentrant: bool = False,
    ) -> None:
        self._layers = list(layers)
        for index, layer in enumerate(self._layers):
            if any(other is layer for other in self._layers[:index]):
                raise errors.InvalidArgument(
                    f"{_module_names.describe(layer, index)} appears twice in the layers")
            if getattr(layer.__dict__.get("forward"), _HANDLE_ATTR, None) is not None:
                raise errors.FailedPrecondition(
                    f"{_module_names.describe(layer, index)} is already wrapped by "
                    "offload_layers: remove() that handle first"
                )
        self._offloaded = offloaded if off is not None else set()
        self._window = max(0, int(prefetch_window))
        self._min_bytes = int(min_tensor_bytes)
        self._off = off
        self._weights = offload_weights
        self._strict = strict
        self._checkpoint = checkpoint
        self._reentrant = use_reentrant
        self._slot_base = next(_slot_bases) * _SLOT_STRIDE
        self._chain: Optional[List[Optional[int]]] = None
        self._counters = _Counters()
        self._last_step = self.stats()  # step_stats() counts from here
        self._removed = False
        self._warned_aside = False
        self._originals: List[Any] = []
        if strict:
            self._check_connected()
        # Wrapped also when disabled: under torch.compile the wrapper is where
        # each layer's graph begins, and graphs must not depend on whether a
        # daemon answered.
        for index, layer in enumerate(self._layers):
            had_own = "forward" in layer.__dict__
            self._originals.append(layer.__dict__["forward"] if had_own else None)
            layer.forward = self._wrap(index, layer, layer.forward)

    @property
    def enabled(self) -> bool:
        return self._off is not None

    def _check_connected(self) -> None:
        if self._off is None:
            return
        stats = self._off.stats()
        if stats["connected"]:
            return
        logs.drain(_C)
        if stats["last_skip_code"] == errors.StatusCode.PERMISSION_DENIED:
            # The client refused the daemon it found (or the daemon refused it).
            raise errors.PermissionDenied(f"strict=True and {stats['last_skip_reason']}")
        raise errors.Unavailable(
            "strict=True and memoffloadd is not reachable (no session; "
            "stats()['last_skip_reason'] says why)"
        )

    def _step_aside(self, why: str) -> None:
        self._counters.stepped_aside += 1
        if not self._warned_aside:
            self._warned_aside = True
            logs.log(
                logging.WARNING,
                f"an offloaded layer runs {why}: it offloads nothing there, so that the "
                "other hooks (e.g. torch.utils.checkpoint around the layer) stay in force. "
                "To checkpoint and offload, pass checkpoint=True to offload_layers instead "
                "(logged once per handle)",
            )

    def _wrap(self, index: int, layer: nn.Module, forward: Callable) -> Callable:
        run = checkpointed(forward, self._reentrant) if self._checkpoint else forward

        @functools.wraps(forward)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            plan = self._enter(index, layer)
            if plan is _AS_IS:
                return forward(*args, **kwargs)
            if plan is _RUN:
                return run(*args, **kwargs)
            try:
                out = run(*args, **kwargs)
            except BaseException:
                self._leave(plan, None, failed=True)
                raise
            return self._leave(plan, out)

        # torch.compile (of the whole model, or layer.compile()): Dynamo skips
        # this frame and the bookkeeping (_enter/_leave run eagerly), but
        # compiles `run`'s frame, the layer itself. One graph break per layer,
        # the same whether offload is on or off, so results are bit-identical;
        # identical layers share one compiled graph (no recompiles).
        wrapped = torch.compiler.disable(
            wrapped, recursive=False, reason="memoffload: a layer's offload bookkeeping"
        )
        setattr(wrapped, _HANDLE_ATTR, self)
        return wrapped

    @torch.compiler.disable(reason="memoffload: a layer's offload bookkeeping")
    def _enter(self, index: int, layer: nn.Module) -> Any:
        """What a call of layer ``index`` does: _AS_IS (run the plain forward),
        _RUN (run it, checkpointed if asked, offloading nothing), or a plan
        ``(chain, pos, key)`` for _leave: its group ``key`` (None: not
        offloaded) is open and its saved-tensor hooks pushed."""
        if self._removed or not torch.is_grad_enabled():
            return _AS_IS
        if in_backward():
            # A checkpoint around this layer recomputes it: its tensors are
            # used at once, nothing to offload.
            if self._off is not None:
                self._step_aside("inside a backward pass (a recomputation)")
            return _AS_IS
        if self._off is None:
            return _RUN
        if foreign_hooks_active():
            self._step_aside("inside other saved-tensor hooks")
            return _RUN
        if index == 0 or self._chain is None:
            self._chain = []  # a new forward pass
            self._counters.steps += 1
        chain = self._chain
        pos = len(chain)
        if index not in self._offloaded:
            return (chain, pos, None)
        if self._strict:
            self._check_connected()
        key = next(_keys)
        self._off.begin_group(key, self._slot_base + index)
        pack = _make_pack(
            self._off, key, self._min_bytes, _ParamSkip([layer], self._weights), self._counters
        )
        torch._C._autograd._push_saved_tensors_default_hooks(pack, _unpack)
        return (chain, pos, key)

    @torch.compiler.disable(reason="memoffload: a layer's offload bookkeeping")
    def _leave(self, plan: Tuple[List[Optional[int]], int, Optional[int]], out: Any,
               failed: bool = False) -> Any:
        """Closes what _enter opened; on success, arms the prefetch of this
        layer's group (and the window before it) for when backward reaches
        the layer's output."""
        chain, pos, key = plan
        if key is not None:
            try:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            finally:
                self._off.close_group(key)
                logs.drain(_C)
        if failed:
            return None
        chain.append(key)
        t = _first_grad_tensor(out)
        if t is not None:
            t.register_hook(functools.partial(self._on_backward, chain, pos))
        return out

    def _on_backward(self, chain: List[Optional[int]], pos: int, grad: torch.Tensor) -> None:
        # Backward reached layer `pos`: make sure its group and the
        # `prefetch_window` groups before it are on their way back.
        for p in range(pos, max(-1, pos - self._window - 1), -1):
            key = chain[p] if p < len(chain) else None
            if key is not None:
                self._off.prefetch_group(key)
        return None

    def _handle_stats(self) -> GroupStats:
        own: Dict[str, Any] = _zero_stats(GroupStats)
        if self._off is not None:
            own.update(self._off.slot_stats(self._slot_base, self._slot_base + _SLOT_STRIDE))
        own.update(self._counters.as_dict())
        return own  # type: ignore[return-value]

    def stats(self) -> HandleStats:
        """Cumulative counters (:class:`HandleStats`). The top level is the
        process's offloader (shared by every handle on the same runtime dir
        and job id) plus this handle's kept bytes and ``steps``;
        ``stats()["handle"]`` counts this handle's groups only. A disabled
        handle reports zeros."""
        s: Dict[str, Any] = _zero_stats(OffloadStats)
        if self._off is not None:
            logs.drain(_C)
            s.update(self._off.stats())
        s.update(self._counters.as_dict())
        s["enabled"] = self._off is not None
        s["handle"] = self._handle_stats()
        return s  # type: ignore[return-value]

    def step_stats(self) -> HandleStats:
        """What changed since the previous ``step_stats()`` call (or since
        the handle was made): every numeric value of :meth:`stats` as a
        difference, ``handle`` included; ``steps`` is the number of forward
        passes in between. Call it once per optimizer step (or per log)."""
        now = self.stats()
        last = self._last_step
        self._last_step = now
        return _delta(now, last)  # type: ignore[return-value]

    def _take_arena_held_peak(self) -> int:
        """The most arena bytes the process's session held at once since the
        previous call (the framework callbacks' log windows)."""
        return 0 if self._off is None else int(self._off.take_arena_held_peak())

    def flush(self) -> None:
        """Waits until queued Commit/Prefetch/Release calls have run."""
        if self._off is not None:
            self._off.flush()
            logs.drain(_C)

    def remove(self) -> None:
        """Restores the layers' forward. Graphs already built keep working."""
        if self._removed:
            return
        self._removed = True
        for layer, original in zip(self._layers, self._originals):
            if getattr(layer.__dict__.get("forward"), _HANDLE_ATTR, None) is not self:
                continue  # not wrapped (disabled) or re-wrapped by someone else
            if original is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = original


def offload_layers(
    layers: Sequence[nn.Module],
    num_layers: Optional[int] = None,
    prefetch_window: int = 1,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    runtime_dir: Optional[str] = None,
    *,
    select: Optional[LayerSelection] = None,
    enabled: bool = True,
    offload_weights: bool = False,
    strict: bool = False,
    checkpoint: bool = False,
    use_reentrant: bool = False,
    job_id: Optional[str] = None,
) -> OffloadHandle:
    """Offloads the activations of ``layers`` (run in this order each step).

    ``num_layers``: offload the first N layers; ``None`` offloads all but the
    last, whose activations backward needs first. ``select`` instead: a
    predicate ``(index, layer) -> bool`` or the indices / layer modules to
    offload. ``prefetch_window``: groups brought back ahead of the one
    backward is in. ``min_tensor_bytes``: smaller saved tensors stay where
    they are. Parameters and buffers (by storage) are never moved; nor are
    low-precision copies of them (autocast's bf16 weights) unless
    ``offload_weights``.

    ``enabled=False``: no offload and no daemon contact (a switch for A/B
    runs); ``checkpoint`` still applies. ``strict=True``: raise
    :class:`memoffload.Unavailable` (here and at the start of an offloaded
    layer) when memoffloadd is not reachable, instead of training on with the
    activations in memory. ``checkpoint=True``: each layer runs under
    ``torch.utils.checkpoint`` (``use_reentrant`` as there) inside its group,
    so the group holds what the checkpoint keeps (the layer's inputs) and the
    layer is recomputed in backward. A layer already wrapped by another
    handle is refused (:class:`memoffload.FailedPrecondition`). ``job_id``:
    the session's job (:func:`get_offloader`; default ``$MEMOFFLOAD_JOB_ID``
    or ``"torch"``).
    """
    layers = list(layers)
    offloaded = _selected(layers, num_layers, select)
    job = _job_id_of(job_id)  # checked also when disabled
    off = get_offloader(runtime_dir, job) if enabled else None
    return OffloadHandle(
        layers,
        offloaded,
        prefetch_window,
        min_tensor_bytes,
        off,
        offload_weights=offload_weights,
        strict=strict,
        checkpoint=checkpoint,
        use_reentrant=use_reentrant,
    )


class offload_activations:  # noqa: N801 - used like a function: `with offload_activations():`
    """Offloads every tensor autograd saves inside the block, as one group.

    ``prefetch()`` starts bringing the group back before backward; otherwise
    the first unpack fetches it. ``slot`` names the recurring block (same size
    every step) so its space is reserved on entry; blocks of different sizes
    should use different slots. ``enabled=False``: the block runs as it is.
    ``job_id`` as in :func:`offload_layers`.
    """

    def __init__(
        self,
        min_tensor_bytes: int = 0,
        runtime_dir: Optional[str] = None,
        skip_modules: Iterable[nn.Module] = (),
        slot: int = _ACTIVATIONS_SLOT,
        *,
        enabled: bool = True,
        offload_weights: bool = False,
        job_id: Optional[str] = None,
    ) -> None:
        job = _job_id_of(job_id)
        self._off = get_offloader(runtime_dir, job) if enabled else None
        self._min_bytes = int(min_tensor_bytes)
        self._skip_modules = list(skip_modules)
        self._weights = offload_weights
        self._slot = slot
        self._counters = _Counters()
        self.key: Optional[int] = None
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def __enter__(self) -> "offload_activations":
        if self._off is None:
            return self
        self.key = next(_keys)
        self._off.begin_group(self.key, self._slot)
        pack = _make_pack(
            self._off,
            self.key,
            self._min_bytes,
            _ParamSkip(self._skip_modules, self._weights),
            self._counters,
        )
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._off is None:
            return
        assert self._hooks is not None and self.key is not None
        try:
            self._hooks.__exit__(*exc)
        finally:
            self._off.close_group(self.key)
            logs.drain(_C)

    def prefetch(self) -> None:
        if self._off is not None and self.key is not None:
            self._off.prefetch_group(self.key)

    def stats(self) -> OffloadStats:
        """The process's session counters plus this block's kept bytes
        (:class:`OffloadStats`); zeros when disabled."""
        s: Dict[str, Any] = _zero_stats(OffloadStats)
        if self._off is not None:
            logs.drain(_C)
            s.update(self._off.stats())
        s.update(self._counters.as_dict())
        return s  # type: ignore[return-value]


def find_layer_stack(model: nn.Module) -> nn.ModuleList:
    """The longest ``nn.ModuleList`` in ``model`` (a transformer's layers)."""
    best: Optional[nn.ModuleList] = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best)):
            best = module
    if best is None or len(best) == 0:
        raise ValueError("no nn.ModuleList of layers found; pass the layers explicitly")
    return best


def __getattr__(name: str) -> Any:
    # The Hugging Face callback lives in memoffload.hf and is loaded on first
    # use, so that importing memoffload.torch never imports transformers.
    if name == "MemoffloadCallback":
        from ..hf import MemoffloadCallback

        return MemoffloadCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
