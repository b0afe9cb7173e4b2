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

import functools
import itertools
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set

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
    from . import _C
except ImportError as exc:  # built against another torch, or not built at all
    raise ImportError(
        f"memoffload's native part (memoffload._C) does not load with torch {torch.__version__}: "
        f"{exc}. Reinstall it against this torch: "
        "pip install --no-build-isolation --force-reinstall <memoffload>/client/python"
    ) from exc
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
    "OffloadHandle",
    "daemon_status",
    "find_layer_stack",
    "get_offloader",
    "offload_activations",
    "offload_layers",
]

_log = logging.getLogger("memoffload")

_offloaders: Dict[str, "_C.GroupOffloader"] = {}
_offloaders_lock = threading.Lock()
_keys = itertools.count(1)
# Slots name recurring groups (a layer of one handle) so that the native side
# can reserve a group's space before its forward with last step's size.
_slot_bases = itertools.count(1)
_SLOT_STRIDE = 1 << 20
_ACTIVATIONS_SLOT = 0


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "-1"))
    except ValueError:
        return -1


def get_offloader(runtime_dir: Optional[str] = None) -> "_C.GroupOffloader":
    """The process's offloader (one session) for ``runtime_dir``.

    ``None`` or ``""`` means ``$MEMOFFLOAD_RUNTIME_DIR`` or the default runtime
    directory. The first call attaches (the only blocking RPC of a steady
    training loop); without a daemon it still succeeds and every group stays
    in memory until a daemon appears there.
    """
    key = runtime_dir or ""
    with _offloaders_lock:
        off = _offloaders.get(key)
        if off is None:
            off = _C.GroupOffloader(
                runtime_dir=key,
                job_id=os.environ.get("MEMOFFLOAD_JOB_ID", "torch"),
                rank=_env_int("RANK"),
                local_rank=_env_int("LOCAL_RANK"),
            )
            _offloaders[key] = off
        return off


def forget_offloader(runtime_dir: Optional[str] = None) -> None:
    """Drops the cached offloader of ``runtime_dir`` (its session ends once no
    live graph uses it). Mostly for tests that start and stop daemons."""
    with _offloaders_lock:
        _offloaders.pop(runtime_dir or "", None)


def daemon_status(runtime_dir: Optional[str] = None) -> Dict[str, Any]:
    """The daemon's GetStatus (capacity, used, reserved, committed, ...)."""
    return _C.daemon_status(runtime_dir or "")


def _storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage: the address of its StorageImpl, shared
    by every view of it (never its data pointer, which a transpose shares with
    other storages' tensors over time and which FSDP swaps in place)."""
    if hasattr(t, "untyped_storage"):  # torch >= 2.0
        return t.untyped_storage()._cdata
    return t.storage()._cdata


def _module_storages(modules: Iterable[nn.Module]) -> Set[int]:
    """Storage identities of the modules' parameters and buffers as they are
    now (FSDP swaps a parameter's storage around each forward)."""
    keys: Set[int] = set()
    for m in modules:
        for p in itertools.chain(m.parameters(), m.buffers()):
            keys.add(_storage_key(p))
    return keys


class _ParamSkip:
    """Decides which saved tensors are parameters or buffers of ``modules``.

    The storage set is taken at the group's first pack call, not before the
    forward: FSDP1 gathers a unit's full weights into a fresh storage inside
    its forward (and frees it in place after), FSDP2 in a pre-forward hook;
    either way the parameters' storages are final once the wrapped forward
    runs. Views of a parameter (FSDP1's unsharded weights are views of the
    FlatParameter, ``weight.t()`` of a weight) are recognised by their base
    too, which also covers nested units that unshard later in the group.
    """

    __slots__ = ("_modules", "_keys")

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._modules = list(modules)
        self._keys: Optional[Set[int]] = None

    def __call__(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return True
        base = t._base
        if base is not None and (
            isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)
        ):
            return True
        if self._keys is None:
            self._keys = _module_storages(self._modules)
        return bool(self._keys) and _storage_key(t) in self._keys


class _Packed:
    """What autograd keeps for an offloaded saved tensor. When autograd drops
    it, the entry is dropped; the group goes when its last entry does."""

    __slots__ = ("off", "key", "entry", "device", "__weakref__")

    def __init__(
        self, off: "_C.GroupOffloader", key: int, entry: int, device: Optional[torch.device]
    ) -> None:
        self.off = off
        self.key = key
        self.entry = entry
        self.device = device  # CUDA tensors: the device whose stream will use it

    def __del__(self) -> None:
        try:
            self.off.drop_entry(self.key, self.entry)
        except Exception:  # interpreter shutdown, or the group is gone
            pass


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Packed):
        if packed.device is None:
            return packed.off.get(packed.key, packed.entry)
        # The consumer stream waits (on the GPU) for the copy back; the block
        # is not reused before that stream is done with it.
        stream = torch.cuda.current_stream(packed.device)
        t = packed.off.get(packed.key, packed.entry, stream.cuda_stream)
        if t.is_cuda:
            t.record_stream(stream)
        return t
    return packed


class _Counters:
    __slots__ = ("small_bytes", "param_bytes")

    def __init__(self) -> None:
        self.small_bytes = 0
        self.param_bytes = 0


def _make_pack(
    off: "_C.GroupOffloader",
    key: int,
    min_tensor_bytes: int,
    is_param: Callable[[torch.Tensor], bool],
    counters: _Counters,
) -> Callable[[torch.Tensor], Any]:
    def pack(t: torch.Tensor) -> Any:
        if t.layout != torch.strided:
            return t
        nbytes = t.numel() * t.element_size()
        if nbytes < min_tensor_bytes:
            counters.small_bytes += nbytes
            return t
        if is_param(t):
            counters.param_bytes += nbytes
            return t
        stream = torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0
        # -1: the offloader cannot take this tensor; it counted it as skipped.
        entry = off.add(key, t, stream)
        if entry < 0:
            return t
        return _Packed(off, key, entry, t.device if t.is_cuda else None)

    return pack


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


class OffloadHandle:
    """Returned by :func:`offload_layers`: ``stats()`` and ``remove()``."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        offloaded: Set[int],
        prefetch_window: int,
        min_tensor_bytes: int,
        off: "_C.GroupOffloader",
    ) -> None:
        self._layers = list(layers)
        self._offloaded = offloaded
        self._window = max(0, int(prefetch_window))
        self._min_bytes = int(min_tensor_bytes)
        self._off = off
        self._slot_base = next(_slot_bases) * _SLOT_STRIDE
        self._chain: Optional[List[Optional[int]]] = None
        self._counters = _Counters()
        self._removed = False
        self._originals: List[Any] = []
        for index, layer in enumerate(self._layers):
            had_own = "forward" in layer.__dict__
            self._originals.append(layer.__dict__["forward"] if had_own else None)
            layer.forward = self._wrap(index, layer, layer.forward)

    def _wrap(self, index: int, layer: nn.Module, forward: Callable) -> Callable:
        @functools.wraps(forward)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self._removed or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            if index == 0 or self._chain is None:
                self._chain = []  # a new forward pass
            chain = self._chain
            pos = len(chain)
            if index in self._offloaded:
                key = next(_keys)
                self._off.begin_group(key, self._slot_base + index)
                pack = _make_pack(
                    self._off, key, self._min_bytes, _ParamSkip([layer]), self._counters
                )
                try:
                    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                        out = forward(*args, **kwargs)
                finally:
                    self._off.close_group(key)
                chain.append(key)
            else:
                out = forward(*args, **kwargs)
                chain.append(None)
            t = _first_grad_tensor(out)
            if t is not None:
                t.register_hook(functools.partial(self._on_backward, chain, pos))
            return out

        return wrapped

    def _on_backward(self, chain: List[Optional[int]], pos: int, grad: torch.Tensor) -> None:
        # Backward reached layer `pos`: make sure its group and the
        # `prefetch_window` groups before it are on their way back.
        for p in range(pos, max(-1, pos - self._window - 1), -1):
            key = chain[p] if p < len(chain) else None
            if key is not None:
                self._off.prefetch_group(key)
        return None

    def stats(self) -> Dict[str, Any]:
        """Counters of the process's offloader (shared by every handle on the
        same runtime dir) plus this handle's kept bytes."""
        s = dict(self._off.stats())
        s["kept_small_bytes"] = self._counters.small_bytes
        s["kept_param_bytes"] = self._counters.param_bytes
        return s

    def flush(self) -> None:
        """Waits until queued Commit/Prefetch/Release calls have run."""
        self._off.flush()

    def remove(self) -> None:
        """Restores the layers' forward. Graphs already built keep working."""
        if self._removed:
            return
        self._removed = True
        for layer, original in zip(self._layers, self._originals):
            if original is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = original


def offload_layers(
    layers: Sequence[nn.Module],
    num_layers: Optional[int] = None,
    prefetch_window: int = 1,
    min_tensor_bytes: int = 1 << 20,
    runtime_dir: Optional[str] = None,
) -> OffloadHandle:
    """Offloads the activations of ``layers`` (run in this order each step).

    ``num_layers``: offload the first N layers; ``None`` offloads all but the
    last, whose activations backward needs first. ``prefetch_window``: groups
    brought back ahead of the one backward is in. ``min_tensor_bytes``: smaller
    saved tensors stay where they are. Parameters and buffers (by storage) are
    never moved.
    """
    layers = list(layers)
    if num_layers is None:
        num_layers = max(0, len(layers) - 1)
    if not 0 <= num_layers <= len(layers):
        raise ValueError(f"num_layers={num_layers} must be within 0..{len(layers)}")
    off = get_offloader(runtime_dir)
    return OffloadHandle(layers, set(range(num_layers)), prefetch_window, min_tensor_bytes, off)


class offload_activations:  # noqa: N801 - used like a function: `with offload_activations():`
    """Offloads every tensor autograd saves inside the block, as one group.

    ``prefetch()`` starts bringing the group back before backward; otherwise
    the first unpack fetches it. ``slot`` names the recurring block (same size
    every step) so its space is reserved on entry; blocks of different sizes
    should use different slots.
    """

    def __init__(
        self,
        min_tensor_bytes: int = 0,
        runtime_dir: Optional[str] = None,
        skip_modules: Iterable[nn.Module] = (),
        slot: int = _ACTIVATIONS_SLOT,
    ) -> None:
        self._off = get_offloader(runtime_dir)
        self._min_bytes = int(min_tensor_bytes)
        self._skip_modules = list(skip_modules)
        self._slot = slot
        self._counters = _Counters()
        self.key: Optional[int] = None
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def __enter__(self) -> "offload_activations":
        self.key = next(_keys)
        self._off.begin_group(self.key, self._slot)
        pack = _make_pack(
            self._off, self.key, self._min_bytes, _ParamSkip(self._skip_modules), self._counters
        )
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None and self.key is not None
        try:
            self._hooks.__exit__(*exc)
        finally:
            self._off.close_group(self.key)

    def prefetch(self) -> None:
        if self.key is not None:
            self._off.prefetch_group(self.key)

    def stats(self) -> Dict[str, Any]:
        s = dict(self._off.stats())
        s["kept_small_bytes"] = self._counters.small_bytes
        s["kept_param_bytes"] = self._counters.param_bytes
        return s


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
        from .hf import MemoffloadCallback

        return MemoffloadCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
