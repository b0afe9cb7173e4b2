"""OffloadHandle: what :func:`memoffload.torch.offload_layers` returns. It
wraps each layer's forward; every call of an offloaded layer is one group,
whose saved tensors move into the arena after the forward and come back,
``prefetch_window`` groups ahead, when backward reaches the layer."""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ... import errors, logs
from . import module_names as _module_names
from .checkpointing import checkpointed, foreign_hooks_active, in_backward
from .counters import GroupStats, HandleStats, OffloadStats, _Counters, _delta, _zero_stats
from .hooks import _keys, _make_pack, _unpack
from .._native import _C
from .param_skip import _ParamSkip

# Slots name recurring groups (a layer of one handle) so that the native side
# can reserve a group's space before its forward with last step's size.
_slot_bases = itertools.count(1)
_SLOT_STRIDE = 1 << 20


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
        logs.forward(_C)
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
                logs.forward(_C)
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
            logs.forward(_C)
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
            logs.forward(_C)

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
