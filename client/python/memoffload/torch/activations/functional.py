"""offload_activations: everything autograd saves inside a ``with`` block,
offloaded as one group."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch
from torch import nn

from ... import logs
from .counters import OffloadStats, _Counters, _zero_stats
from .hooks import _keys, _make_pack, _unpack
from .._native import _C
from .offloaders import _job_id_of, get_offloader
from .param_skip import _ParamSkip

_ACTIVATIONS_SLOT = 0


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
            logs.forward(_C)

    def prefetch(self) -> None:
        if self._off is not None and self.key is not None:
            self._off.prefetch_group(self.key)

    def stats(self) -> OffloadStats:
        """The process's session counters plus this block's kept bytes
        (:class:`OffloadStats`); zeros when disabled."""
        s: Dict[str, Any] = _zero_stats(OffloadStats)
        if self._off is not None:
            logs.forward(_C)
            s.update(self._off.stats())
        s.update(self._counters.as_dict())
        return s  # type: ignore[return-value]
