"""A rank's long-lived host state in the node arena: FSDP2's CPU-offloaded
parameter shards and a CPU optimizer's states (``place_state``).

Each tensor moves into one block of the arena (``_C.HostStateStore``, a
session of its own): exact size (page-rounded only, never to a power of
two), counted by the daemon against the rank's session, job and uid like
any group (quotas, ``memoffloadctl sessions``, ``/metrics``), registered with
CUDA where there is a GPU, and freed by the daemon the moment the rank dies.
The values are copied bit for bit, so training is identical to the same run
without it. A tensor's block goes back when the tensor dies.

What moves, once each:

- FSDP2 (``fully_shard(..., offload_policy=CPUOffloadPolicy())``): each
  FSDPParam's padded CPU shard (``_sharded_param_data``), its parameter's local
  tensor re-viewed onto it, as FSDP2's own ``reset_sharded_param`` does. This
  reads FSDP2 internals, so it runs only on the torch versions it was tested
  with (``TESTED_TORCH``) and refuses others with a message.
- the optimizer's state tensors on the CPU (AdamW's ``exp_avg`` and
  ``exp_avg_sq``; a DTensor's local tensor), with or without FSDP2 (ZeRO-offload
  style CPU optimizers). Optimizers create their state at the first step, so
  a step post-hook moves new state after each step (a dict walk when nothing
  is new).

- the parameters' CPU gradients after the second step, when the trainer
  keeps them (``zero_grad(set_to_none=False)``: they are added into in place
  from then on); gradients made anew at each step (``set_to_none=True``) stay
  in torch's memory, never copied (FSDP2's: tested torch versions only).

What stays in torch's memory, counted in ``stats()``: tensors under
``min_bytes`` (AdamW's ``step`` scalars: a page each would cost more than
they hold), tensors larger than an arena chunk (a block is contiguous), and
the gradients above.

Without a daemon, or when a quota refuses a tensor, it says so once (the
daemon's message names the limit) and training goes on with torch's own
memory; ``strict=True`` raises instead. The daemon lets placed state hold at
most ``quotas.state_share`` of the job's limit (half by default), and
``place_state(max_bytes=)`` lowers it per rank.

When the daemon drains, restarts or crashes, the state moves at the next
optimizer step: into the arena of the daemon now serving, else into this
process's memory and back once a daemon takes a new session (rehome.py).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, List, Optional, Set

import torch

from ... import errors, logs
from .._native import _C
from .._settings import _env_int, _job_id_of
from .fsdp import (FSDP_PARAM_FIELDS, fsdp_params, give_back_freed_memory, set_fsdp_shard,
                   torch_minor)
from .rehome import Rehoming

__all__ = ["place_state", "StatePlacement", "TESTED_TORCH"]

# torch versions whose FSDP2 internals place_state was tested against.
TESTED_TORCH = ("2.11", "2.13")

class StatePlacement(Rehoming):
    """What ``place_state`` placed, and the hooks that place more (and move it
    when its daemon drains or restarts: rehome.py).

    ``stats()``: ``tensors``/``bytes``/``held_bytes`` now in the arena (live:
    a tensor that died gave its block back), ``left``/``left_bytes`` kept in
    torch's memory and ``left_reasons`` (reason -> count), ``refused`` (the
    daemon said no), ``unpinned_bytes`` (chunks CUDA did not register),
    ``session_id`` (``memoffloadctl sessions``) or ``None`` without a daemon,
    ``moves`` (times the state moved out of an arena it had to leave) and
    ``last_move`` (why, the last time).
    """

    def __init__(self, runtime_dir: str, job_id: str, strict: bool, min_bytes: int,
                 max_bytes: int = 0) -> None:
        self._strict = strict
        self._min_bytes = min_bytes
        self._runtime_dir = runtime_dir
        self._job_id = job_id
        self._max_bytes = max_bytes
        self._store: Optional[Any] = None
        # What place_state watches (weakly: the placement never keeps them alive).
        self._model: Optional["weakref.ref[torch.nn.Module]"] = None
        self._optimizers: List["weakref.ref[torch.optim.Optimizer]"] = []
        self._init_rehoming()
        self._warned: Set[str] = set()
        self._left: Dict[str, List[int]] = {}  # reason -> [count, bytes]
        # State tensors already placed or left, by id, with a weak reference
        # to tell a live one from a new tensor that reuses a dead one's id
        # (optimizer.load_state_dict replaces every state tensor).
        self._decided: Dict[int, "weakref.ref[torch.Tensor]"] = {}
        self._hooks: List[Any] = []
        # Gradients are placed while the trainer keeps them: each seen once
        # (by its parameter's id) before it is placed.
        self._gradients = True
        self._grad_seen: Dict[int, "weakref.ref[torch.Tensor]"] = {}
        self._reported_step = False
        self._store = self._attach(quiet=False)
        logs.forward(_C)

    def _attach(self, quiet: bool) -> Optional[Any]:
        """A new session of the daemon (a store), or None: the first time it
        says why (``strict`` raises); later tries (``quiet``) say nothing."""
        try:
            return _C.HostStateStore(
                runtime_dir=self._runtime_dir, job_id=self._job_id, rank=_env_int("RANK"),
                local_rank=_env_int("LOCAL_RANK"), max_bytes=self._max_bytes,
            )
        except errors.Error as e:
            if quiet:
                return None
            if self._strict:
                raise
            self._warn_once(
                "attach",
                f"place_state: no memoffloadd session ({e}); the model and optimizer state stay "
                f"in torch's own memory (a session is tried again at each step, at most every "
                f"second)", e.code,
            )
            return None

    def _place_again(self) -> None:
        """A daemon took a new session while the state was in torch's memory
        (called from an optimizer's step hook): everything is placed as at
        the start and counted anew, the FSDP2 shards now, each optimizer's
        state and gradients by its own step hook (this one's right after)."""
        self._left.clear()
        self._decided.clear()
        self._rearm_gradients()
        model = self._model() if self._model is not None else None
        if model is not None:
            self._place_fsdp(model)

    # ---- placing ----

    def _warn_once(self, key: str, message: str, code: errors.StatusCode = errors.StatusCode.OK,
                   level: int = logging.WARNING) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logs.log(level, message, code)

    def _leave(self, reason: str, nbytes: int) -> None:
        entry = self._left.setdefault(reason, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def _arena_copy(self, t: torch.Tensor, strict: Optional[bool] = None
                    ) -> Optional[torch.Tensor]:
        """A copy of the plain CPU tensor ``t`` in the arena, or None (and why
        is counted) when it stays where it is; ``strict`` (default the
        placement's) raises the daemon's refusal instead."""
        nbytes = t.numel() * t.element_size()
        if self._store is None:
            self._leave("no daemon", nbytes)
            return None
        if nbytes < max(self._min_bytes, 1):
            self._leave("under min_bytes", nbytes)
            return None
        try:
            raw = self._store.empty(nbytes)
        except errors.Error as e:
            if self._strict if strict is None else strict:
                raise
            reason = "larger than a chunk" if "larger than a chunk" in e.message else e.code.name
            self._leave(reason, nbytes)
            self._warn_once(
                reason,
                f"place_state: a tensor of {nbytes} bytes stays in torch's memory: {e} "
                f"(logged once per reason; stats() counts them)", e.code,
            )
            return None
        # The same strides as ``t`` where its layout is dense (channels_last,
        # a transposed parameter's state): fused optimizers (AdamW(fused=True))
        # walk a parameter, its gradient and its states as flat memory and
        # need them laid out alike. Else (overlapping, gaps) contiguous.
        strides = torch.empty_like(t, device="meta").stride()
        out = raw.view(t.dtype).as_strided(t.shape, strides)
        out.copy_(t)
        return out

    def _placeable(self, t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and t.device.type == "cpu"
                and t.layout == torch.strided and not t.is_quantized)

    def _place_fsdp(self, model: torch.nn.Module) -> int:
        params = list(fsdp_params(model))
        if not params:
            # Only FSDP2's CPU-offloaded shards are the model's to place.
            for p in model.parameters():
                self._leave("model not FSDP2 with CPUOffloadPolicy", p.numel() * p.element_size())
            return 0
        if torch_minor() not in TESTED_TORCH:
            raise errors.FailedPrecondition(
                f"place_state reads FSDP2 internals and was tested with torch "
                f"{', '.join(TESTED_TORCH)}, not {torch.__version__}: refusing to patch them blindly "
                f"(pass model=None to place the optimizer's state only)")
        moved = 0
        for fp in params:
            missing = [f for f in FSDP_PARAM_FIELDS if not hasattr(fp, f)]
            if missing:
                raise errors.FailedPrecondition(
                    f"this torch's FSDPParam lacks {', '.join(missing)}: place_state cannot place "
                    f"FSDP2's shards here")
            if not fp.offload_to_cpu:
                local = fp.sharded_param._local_tensor
                self._leave("model not FSDP2 with CPUOffloadPolicy", local.numel() * local.element_size())
                continue
            data = fp._sharded_param_data
            if not self._placeable(data):
                continue
            new = self._arena_copy(data)
            if new is None:
                continue
            if getattr(fp, "pin_memory", False) and not new.is_pinned():
                # CUDA did not register the chunk. FSDP2's reset_sharded_param
                # (lazy init, load_state_dict, _apply) would re-pin the local
                # tensor into a copy of its own and leave _sharded_param_data
                # here: the optimizer would update one, the all-gather read
                # the other. The shard stays where it is (``new`` dies and
                # gives its block back).
                nbytes = new.numel() * new.element_size()
                del new
                self._leave("not page-locked", nbytes)
                self._warn_once(
                    "not page-locked",
                    "place_state: CUDA did not page-lock an arena chunk and FSDP2 was asked for "
                    "pinned CPU shards (CPUOffloadPolicy(pin_memory=True)); such shards stay in "
                    "torch's pinned memory (logged once; stats() counts them)")
                continue
            set_fsdp_shard(fp, new)
            moved += 1
        if moved:
            give_back_freed_memory()
        return moved

    @staticmethod
    def _rewrap(v: torch.Tensor, new_local: torch.Tensor) -> torch.Tensor:
        """``new_local`` (a copy of ``v``'s local tensor) as ``v`` was: a
        DTensor with ``v``'s mesh and placements, or itself."""
        if not hasattr(v, "_local_tensor"):
            return new_local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(new_local, v.device_mesh, v.placements, run_check=False,
                                  shape=v.shape, stride=v.stride())

    def _place_value(self, v: torch.Tensor) -> Optional[torch.Tensor]:
        local = getattr(v, "_local_tensor", v)
        if not self._placeable(local):
            return None
        new_local = self._arena_copy(local)
        return None if new_local is None else self._rewrap(v, new_local)

    def _is_decided(self, t: torch.Tensor) -> bool:
        ref = self._decided.get(id(t))
        return ref is not None and ref() is t

    def _decide(self, t: torch.Tensor) -> None:
        key, decided = id(t), self._decided

        def forget(ref: Any) -> None:
            if decided.get(key) is ref:
                del decided[key]

        decided[key] = weakref.ref(t, forget)

    def _place_gradients(self, optimizer: torch.optim.Optimizer) -> int:
        """Moves the CPU gradients of the optimizer's parameters that the
        trainer keeps between steps (``zero_grad(set_to_none=False)``; FSDP2
        and autograd then add into them in place), once each: a gradient is
        placed at the step after the one it was first seen at, if it is
        still the same tensor. When it was replaced (``set_to_none=True``,
        the default, makes them anew) placing them would copy every step:
        it stops and says so once."""
        if not self._gradients:
            return 0
        moved = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or self._is_decided(g):
                    continue
                seen = self._grad_seen.get(id(p))
                if seen is None:
                    self._grad_seen[id(p)] = weakref.ref(g)
                    continue
                if seen() is not g:
                    self._gradients = False
                    self._grad_seen.clear()
                    self._leave("gradients made anew each step", g.numel() * g.element_size())
                    # torch's default, not a problem: said at INFO.
                    self._warn_once(
                        "gradients",
                        "place_state: the gradients are made anew at each step "
                        "(zero_grad(set_to_none=True)), so they stay in torch's memory; "
                        "zero_grad(set_to_none=False) keeps them in the arena",
                        level=logging.INFO)
                    return moved
                if hasattr(g, "_local_tensor") and torch_minor() not in TESTED_TORCH:
                    self._leave("gradients on an untested torch", g.numel() * g.element_size())
                    self._decide(g)
                    continue
                new = self._place_value(g)
                self._decide(g if new is None else new)
                if new is not None:
                    p.grad = new
                    moved += 1
        return moved

    def place_optimizer_state(self, optimizer: torch.optim.Optimizer) -> int:
        """Moves the optimizer's CPU state tensors (and its parameters'
        gradients) not moved (or left) yet; returns how many moved. The step
        post-hook calls this."""
        moved = 0
        for state in optimizer.state.values():
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor) or self._is_decided(value):
                    continue
                new = self._place_value(value)
                if new is None:
                    self._decide(value)
                    continue
                state[key] = new
                self._decide(new)
                moved += 1
        # After the state, which stays for the whole run: the gradients come
        # second when a limit leaves room for only some.
        moved += self._place_gradients(optimizer)
        if moved:
            give_back_freed_memory()
        return moved

    def _watch(self, optimizer: torch.optim.Optimizer) -> None:
        this = weakref.ref(self)

        def after_step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            placement = this()
            if placement is not None:
                placement._follow_daemon()
                placement.place_optimizer_state(opt)
                if placement._placed_again:
                    placement._placed_again = False
                    placement._report("placed again (a daemon took a new session)")
                if not placement._reported_step and opt.state:
                    # The optimizer makes its state at its first step.
                    placement._reported_step = True
                    placement._report("after the optimizer's first step")

        def after_load(opt: torch.optim.Optimizer) -> None:
            placement = this()
            if placement is not None:
                placement._rearm_gradients()

        self._optimizers.append(weakref.ref(optimizer))
        self._hooks.append(optimizer.register_step_post_hook(after_step))
        self._hooks.append(optimizer.register_load_state_dict_post_hook(after_load))
        self.place_optimizer_state(optimizer)

    def _rearm_gradients(self) -> None:
        """After optimizer.load_state_dict (a resume; DCP's set_state_dict
        calls it): the gradients are watched anew. DCP's get_state_dict on
        a fresh optimizer runs a step on zero gradients and then drops them
        (zero_grad(set_to_none=True)), which looks like gradients made anew
        each step although the trainer keeps its own."""
        self._gradients = True
        self._grad_seen.clear()

    def _report(self, when: str) -> None:
        """One INFO line: what is in the arena, what stays in torch's memory
        and why."""
        st = self.stats()
        where = (f"in the arena (session {st['session_id']})" if st["session_id"] is not None
                 else "in the arena (no daemon)")
        left = "; ".join(f"{reason}: {count} ({_mib(nbytes)})"
                         for reason, (count, nbytes) in sorted(self._left.items()))
        logs.log(logging.INFO,
                 f"place_state {when}: {st['tensors']} tensors ({_mib(st['bytes'])}) {where}; "
                 + (f"{st['left']} left in torch's memory ({_mib(st['left_bytes'])}): {left}"
                    if st["left"] else "nothing left in torch's memory"))

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage (a DTensor's local tensor's) is in the arena,
        placed by this placement and still alive."""
        local = getattr(t, "_local_tensor", t)
        if self._store is None or local.untyped_storage().nbytes() == 0:
            return False
        return bool(self._store.holds(local.untyped_storage().data_ptr()))

    def remove(self) -> None:
        """Stops placing new optimizer state; what is placed stays placed."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def stats(self) -> Dict[str, Any]:
        native = self._store.stats() if self._store is not None else {}
        return {
            "tensors": native.get("tensors", 0),
            "bytes": native.get("bytes", 0),
            "held_bytes": native.get("held_bytes", 0),
            "refused": native.get("refused", 0),
            "unpinned_bytes": native.get("unpinned_bytes", 0),
            "left": sum(c for c, _ in self._left.values()),
            "left_bytes": sum(b for _, b in self._left.values()),
            "left_reasons": {r: c for r, (c, _) in self._left.items()},
            "session_id": native.get("session_id"),
            "moves": self._moves,
            "last_move": self._last_move,
        }


def place_state(
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    job_id: Optional[str] = None,
    runtime_dir: Optional[str] = None,
    strict: bool = False,
    min_bytes: int = 64 * 1024,
    max_bytes: Optional[int] = None,
) -> StatePlacement:
    """Moves ``model``'s FSDP2 CPU-offloaded shards and ``optimizer``'s CPU
    state into the node arena (see the module's docstring), now and (for the
    optimizer) after each step. Call it after ``fully_shard`` and after the
    optimizer is made, before training. Keep the returned placement while you
    want new optimizer state placed; the memory stays with the tensors.

    ``job_id``/``runtime_dir`` as for :func:`memoffload.torch.offload_layers`.
    ``strict=True`` raises the daemon's error (``memoffload.Unavailable``,
    ``ResourceExhausted``, ...) instead of leaving a tensor in torch's memory.
    ``min_bytes``: smaller tensors stay in torch's memory. ``max_bytes``: this
    rank's placed state holds at most that many bytes (page-rounded per
    tensor), below the daemon's own share for placed state
    (``quotas.state_share`` of the job's limit, half by default); what does
    not fit stays in torch's memory, said once in a WARNING naming the limit.

    When the daemon drains or restarts, the placed tensors move at the next
    optimizer step: into the arena of the daemon now serving, else into this
    process's memory, and back into the arena once a daemon takes a new
    session (tried at most every second). Training stays bit for bit the same.

    It says at INFO, on the "memoffload" logger, what it placed and what it
    left in torch's memory and why (a model that is not FSDP2 with
    ``CPUOffloadPolicy``, tensors under ``min_bytes``, gradients made anew at
    each step, ...): once now, and once after the optimizer's first step,
    which makes the optimizer's state. ``stats()`` counts the same.
    """
    if min_bytes < 0:
        raise errors.InvalidArgument(f"min_bytes must be >= 0, not {min_bytes}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise errors.InvalidArgument(f"max_bytes must be a positive int or None, not {max_bytes!r}")
    placement = StatePlacement(runtime_dir or "", _job_id_of(job_id), strict, min_bytes,
                               max_bytes or 0)
    if model is not None:
        placement._model = weakref.ref(model)
        placement._place_fsdp(model)
    if optimizer is not None:
        placement._watch(optimizer)
    logs.forward(_C)
    placement._report("at the start")
    return placement


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
