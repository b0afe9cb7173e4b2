"""One rank of a job whose ranks are on two simulated nodes, started by
test_node_safe.py as ``node_worker.py CONFIG RANK``: 4 ranks of FSDP2 on
gloo, 2 per node, each node with a daemon and runtime dir of its own and its
own loopback address for the replicas (``$MEMOFFLOAD_REPLICATION_ADDRESS``).

Phases (``cfg["phase"]``):

- ``train``: trains steps 1..6, saving ``step-2`` (``dcp.save``) and
  ``step-4`` (``dcp.async_save``) with ``replicas=1`` (``cfg["replicas"]``);
  keeps what was saved at step 4 and the final state of this
  uninterrupted run (``<out>/<phase>-<tag>-rank<r>.pt``); then, with
  ``cfg["hold"]``, writes ``held-rank<r>`` and waits to be SIGKILLed.
- ``restore``: new ranks (a node's daemon may be new and empty) load
  ``latest_checkpoint(node_safe=True)`` (``cfg["node_safe"]``), keep the loaded state, train to
  step 6 and keep the final state.
- ``die_mid_save``: saves ``step-2``, then during the save of ``step-4``
  rank ``cfg["killer"]`` SIGKILLs ``cfg["daemon_pid"]`` (its node's daemon:
  the node is lost) and itself, or, without one, only itself 2 s later.
  ``restore`` with ``cfg["resave"]`` saves ``step-4`` again.
- ``flip``: saves ``step-2`` through ``stage()`` (the staged tensors are the
  committed region's bytes), flips a byte of rank 0's shard through them,
  and loads ``step-2`` back on every rank.
- ``writer_per_save``: a new writer for each of ``step-1`` and ``step-2``,
  saved one right after the other (with ``cfg["slow_records"]``, each
  save's .metadata reaches the other node that much later).
- ``wait_timeout``: ``wait_replication(timeout=0.01)`` expires, then the
  next save.
- ``in_transit``: ``step-1`` with rank 2's pieces "changed on the way" (its
  CRC-32s off), then a good ``step-2`` whose load on rank 0 finds its own
  copy damaged and every other copy arriving damaged.
- ``only_copy_damaged``: ``step-1`` without replicas, the shard that
  holds a plain tensor every rank reads damaged in its node's daemon,
  then loaded on every rank.
- ``write_refused``: rank 2's daemon refuses its shard of ``step-1``
  once; ``step-2`` is saved after it.
- ``latest_on_rank_0``: after a save, rank 0 alone calls
  ``latest_checkpoint``; then every rank saves again and trains on.
- ``exit_early``: saves ``step-1`` and exits at once, its replication
  slowed down: the exit waits for it.
- ``bad_device``: a save where one rank's replication address is not its
  host's (the test sets it): every rank's save must say so, and training
  goes on.
- ``strangers``: three saves while a stranger attacks every listener it
  finds (test_link_security.py); rank 3 starts each save's streams late,
  so the others' listeners wait for it a while: the stranger's window. The
  process's descriptors are counted before and after each save.
- ``peer_down``: saves ``step-2``; then waits until the test killed node 1's
  daemon (its ranks live on), saves ``step-4``, trains on and answers
  ``latest_checkpoint(node_safe=True)``.

Each rank writes ``<out>/<phase>-rank<r>.json``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist

from memoffload import errors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import fsdp_decoder_and_adamw as _model_and_opt  # noqa: E402
from models import local_copies as _flat  # noqa: E402
from models import tokens  # noqa: E402
from log_records import Records  # noqa: E402

LAST_STEP = 6




def _step(model, opt, step: int, rank: int) -> None:
    opt.zero_grad()
    gen = torch.Generator().manual_seed(1000 * step + rank)
    model(tokens(batch=2, length=16).random_(0, 97, generator=gen)).backward()
    opt.step()


def _state(model, opt, step: int) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def _keep(cfg: Dict[str, Any], tag: str, model, opt, rank: int) -> None:
    torch.save(_flat(_state(model, opt, 0)), Path(cfg["out"], f"{cfg['phase']}-{tag}-rank{rank}.pt"))


def _writer(cfg: Dict[str, Any]):
    from memoffload.torch.checkpoint import MemoffloadWriter

    return MemoffloadWriter(job_id=cfg["job_id"], runtime_dir=cfg["runtime_dir"],
                            fallback_dir=cfg["fallback_dir"], replicas=cfg.get("replicas", 1),
                            keep_last=cfg.get("keep_last", 1))


def _save(writer, model, opt, step: int, result: Dict[str, Any], ckpt: str, group=None,
          wait: bool = True) -> None:
    """A save, then (``wait``) its replication waited for; with ``group``,
    dcp.async_save on it (the writer stages, DCP's thread saves)."""
    import torch.distributed.checkpoint as dcp

    if group is None:
        where = writer.result(dcp.save(_state(model, opt, step), storage_writer=writer,
                                       checkpoint_id=ckpt)).where
    else:
        where = writer.result(dcp.async_save(_state(model, opt, step), storage_writer=writer,
                                             checkpoint_id=ckpt, process_group=group)).where
    if not wait:
        return
    rep = writer.wait_replication()
    result[ckpt] = {"mode": writer.last_mode, "where": where,
                    "node_safe": rep.node_safe if rep else None,
                    "why": rep.why if rep else None,
                    "held": rep.held_for_others if rep else None,
                    "deleted": writer.last_deleted}


def _trained_and_saved(cfg: Dict[str, Any], model, opt, rank: int, result: Dict[str, Any]):
    """Steps 1 and 2, then ``step-2`` saved: the writer."""
    writer = _writer(cfg)
    for step in (1, 2):
        _step(model, opt, step, rank)
    _save(writer, model, opt, 2, result, "step-2")
    return writer


def _load(cfg: Dict[str, Any], model, opt, ckpt: str, result: Dict[str, Any]) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from memoffload.torch.checkpoint import MemoffloadReader

    state = _state(model, opt, -1)
    reader = MemoffloadReader(job_id=cfg["job_id"], runtime_dir=cfg["runtime_dir"],
                              fallback_dir=cfg["fallback_dir"])
    dcp.load(state, storage_reader=reader, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    result["sources"] = reader.last_sources
    result["load_mode"] = reader.last_mode
    return int(state["step"])


def main(cfg: Dict[str, Any], rank: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world"])
    from memoffload.torch.checkpoint import latest_checkpoint

    records = Records()
    logging.getLogger("memoffload").addHandler(records)
    logging.getLogger("memoffload").setLevel(logging.INFO)
    phase = cfg["phase"]
    if cfg.get("slow_records"):
        # A slow link (or a busy worker thread): a save's node records (its
        # .metadata on the other nodes) land a while after dcp.save returned.
        from memoffload.torch.checkpoint.nodes.save import SaveJob

        commit = SaveJob._commit_node_records

        def slow(self, *args, **kwargs):
            time.sleep(cfg["slow_records"])
            return commit(self, *args, **kwargs)

        SaveJob._commit_node_records = slow
    if cfg.get("piece_bytes"):  # many pieces per region: every round of the streams
        from memoffload.torch.checkpoint.nodes import session as _session

        _session.PIECE_BYTES = cfg["piece_bytes"]
    result: Dict[str, Any] = {"rank": rank}
    out = Path(cfg["out"], f"{phase}-rank{rank}.json")
    model, opt = _model_and_opt()
    try:
        if phase == "train":
            writer = _writer(cfg)
            group = dist.new_group(backend="gloo")
            for step in range(1, LAST_STEP + 1):
                _step(model, opt, step, rank)
                if step in (2, 4):  # step 4 through dcp.async_save
                    _save(writer, model, opt, step, result, f"step-{step}", group if step == 4 else None)
                if step == 4:
                    _keep(cfg, "saved", model, opt, rank)
            _keep(cfg, "final", model, opt, rank)
        elif phase == "restore":
            ckpt = latest_checkpoint(cfg["job_id"], cfg["runtime_dir"], cfg["fallback_dir"],
                                     node_safe=cfg.get("node_safe", True))
            result["latest"] = ckpt
            step = _load(cfg, model, opt, ckpt, result)
            result["step"] = step
            _keep(cfg, "loaded", model, opt, rank)
            for s in range(step + 1, LAST_STEP + 1):
                _step(model, opt, s, rank)
                if s == 4 and cfg.get("resave"):  # the id of the save that died
                    writer = _writer(cfg)
                    _save(writer, model, opt, s, result, "step-4")
                    result["collected"] = writer.last_collected
            _keep(cfg, "final", model, opt, rank)
        elif phase == "die_mid_save":
            writer = _trained_and_saved(cfg, model, opt, rank, result)
            _keep(cfg, "saved", model, opt, rank)
            out.write_text(json.dumps(result))
            for step in (3, 4):
                _step(model, opt, step, rank)
            if rank == cfg.get("killer", 2):
                def lose_the_node(region: str, written: int) -> None:
                    if cfg.get("daemon_pid"):
                        os.kill(cfg["daemon_pid"], signal.SIGKILL)
                    else:  # only this rank dies: the others commit their shards meanwhile
                        time.sleep(2)
                    os.kill(os.getpid(), signal.SIGKILL)
                writer._after_append = lose_the_node
            try:
                _save(writer, model, opt, 4, result, "step-4")
            except BaseException as exc:  # noqa: BLE001 - the other ranks see the node go
                result["save_failed"] = type(exc).__name__
        elif phase == "flip":
            import torch.distributed.checkpoint as dcp

            writer = _writer(cfg)
            for step in (1, 2):
                _step(model, opt, step, rank)
            staged = writer.stage(_state(model, opt, 2))
            dcp.save(staged, storage_writer=writer, checkpoint_id="step-2")
            rep = writer.wait_replication()
            result["node_safe"] = rep.node_safe
            _keep(cfg, "saved", model, opt, rank)
            if rank == 0:  # a stray write through a mapping of the committed region
                victim = next(t for t in _flat_views(staged) if t.numel() > 64)
                victim.view(-1).view(torch.uint8)[7] ^= 0x40
            dist.barrier()
            _step(model, opt, 3, rank)  # other values, so that a load that did nothing shows
            result["step"] = _load(cfg, model, opt, "step-2", result)
            _keep(cfg, "loaded", model, opt, rank)
        elif phase == "peer_down":
            writer = _trained_and_saved(cfg, model, opt, rank, result)
            Path(cfg["out"], f"saved-rank{rank}").write_text("")
            while not Path(cfg["out"], "go").exists():
                time.sleep(0.05)
            for step in (3, 4):
                _step(model, opt, step, rank)
            _save(writer, model, opt, 4, result, "step-4")
            for step in (5, 6):
                _step(model, opt, step, rank)
            result["trained_to"] = 6
            result["latest_node_safe"] = latest_checkpoint(
                cfg["job_id"], cfg["runtime_dir"], cfg["fallback_dir"], node_safe=True)
        elif phase == "writer_per_save":  # README's pattern, saves close together
            for step in (1, 2):
                _step(model, opt, step, rank)
                _save(_writer(cfg), model, opt, step, result, f"step-{step}", wait=False)
                _keep(cfg, f"saved{step}", model, opt, rank)
        elif phase == "wait_timeout":
            writer = _writer(cfg)
            _step(model, opt, 1, rank)
            _save(writer, model, opt, 1, result, "step-1", wait=False)
            _keep(cfg, "saved1", model, opt, rank)
            try:
                writer.wait_replication(timeout=0.01)
            except TimeoutError:
                result["timed_out"] = True
            _step(model, opt, 2, rank)
            _save(writer, model, opt, 2, result, "step-2")
        elif phase == "in_transit":
            import torch.distributed.checkpoint as dcp

            from memoffload.torch.checkpoint.nodes import session as _session

            writer = _writer(cfg)
            _step(model, opt, 1, rank)
            if rank == 2:  # every piece rank 2 sends "changes on the way"
                _session.TEST_CORRUPT_EVERY = 1
            _save(writer, model, opt, 1, result, "step-1")
            _session.TEST_CORRUPT_EVERY = 0
            _step(model, opt, 2, rank)
            staged = writer.stage(_state(model, opt, 2))
            dcp.save(staged, storage_writer=writer, checkpoint_id="step-2")
            result["step-2"] = {"node_safe": writer.wait_replication().node_safe}
            if rank == 0:  # its own copy damaged, and every other copy arrives damaged
                next(t for t in _flat_views(staged) if t.numel() > 64).view(-1).view(torch.uint8)[7] ^= 0x40
            if rank in (2, 3):  # what node 1 sends to rank 0 changes on the way
                _session.TEST_CORRUPT_EVERY = 1
            dist.barrier()
            try:
                _load(cfg, model, opt, "step-2", result)
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException
                result["load_error"] = f"{type(exc).__name__}: {exc}"
        elif phase == "only_copy_damaged":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.metadata import MetadataIndex

            from memoffload.torch.checkpoint import MemoffloadReader

            writer = _writer(cfg)  # replicas=0: a region's only copy is in its rank's node
            _step(model, opt, 1, rank)
            # A plain tensor every rank holds: DCP writes it from one rank,
            # and every rank reads it back from that rank's region.
            staged = writer.stage({**_state(model, opt, 1), "shared": torch.arange(4096.0)})
            dcp.save(staged, storage_writer=writer, checkpoint_id="step-1")
            writer.wait_replication()
            reader = MemoffloadReader(job_id=cfg["job_id"], runtime_dir=cfg["runtime_dir"])
            reader.reset("step-1")
            index = MetadataIndex("shared", torch.Size([0]))
            holder = result["holder"] = reader.read_metadata().storage_data[index].region
            if holder == f"dcp/step-1/__{rank}_0.distcp":
                staged["shared"].view(torch.uint8)[7] ^= 0x40
            dist.barrier()
            try:
                dcp.load({**_state(model, opt, -1), "shared": torch.zeros(4096)},
                         storage_reader=MemoffloadReader(job_id=cfg["job_id"],
                                                         runtime_dir=cfg["runtime_dir"]),
                         checkpoint_id="step-1")
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException
                result["load_error"] = f"{type(exc).__name__}: {exc}"
        elif phase == "write_refused":
            writer = _writer(cfg)
            _step(model, opt, 1, rank)
            if rank == 2:  # its daemon refuses its shard once (a region limit, say)
                def refuse(region: str, written: int) -> None:
                    writer._after_append = None
                    raise errors.ResourceExhausted("refused once by the test")
                writer._after_append = refuse
            _save(writer, model, opt, 1, result, "step-1")  # skipped, not raised (issue 41)
            _step(model, opt, 2, rank)
            _save(writer, model, opt, 2, result, "step-2")
        elif phase == "latest_on_rank_0":
            writer = _writer(cfg)
            _step(model, opt, 2, rank)
            _save(writer, model, opt, 2, result, "step-2")
            if rank == 0:  # a misuse: "log the newest checkpoint" on one rank of a multi-node job
                t = time.monotonic()
                try:
                    latest_checkpoint(cfg["job_id"], cfg["runtime_dir"], cfg["fallback_dir"])
                except Exception as exc:  # noqa: BLE001 - recorded for the test
                    result["alone"] = f"{type(exc).__name__}: {exc}"
                result["alone_s"] = time.monotonic() - t
            _step(model, opt, 4, rank)
            t = time.monotonic()
            _save(writer, model, opt, 4, result, "step-4")
            result["save_s"] = time.monotonic() - t
            _step(model, opt, 5, rank)
            result["trained_to"] = 5
        elif phase == "exit_early":
            from memoffload.torch.checkpoint.nodes.save import SaveJob

            SaveJob._before_replicas = lambda: time.sleep(1.5)  # still replicating at exit
            import torch.distributed.checkpoint as dcp

            _step(model, opt, 1, rank)
            dcp.save(_state(model, opt, 1), storage_writer=_writer(cfg), checkpoint_id="step-1")
        elif phase == "strangers":
            from memoffload.torch.checkpoint.nodes.session import Session

            if rank == 3:
                exchange = Session.exchange

                def late(self, *args, **kwargs):
                    time.sleep(cfg["late_s"])
                    return exchange(self, *args, **kwargs)

                Session.exchange = late
            writer = _writer(cfg)
            result["fds"] = [len(os.listdir("/proc/self/fd"))]
            for step in (1, 2, 3):
                _step(model, opt, step, rank)
                _save(writer, model, opt, step, result, f"step-{step}")
                result["fds"].append(len(os.listdir("/proc/self/fd")))
        elif phase == "bad_device":
            _step(model, opt, 1, rank)
            try:
                _save(_writer(cfg), model, opt, 1, result, "step-1")
            except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException(BaseException)
                result["error"] = f"{type(exc).__name__}: {exc}"
            _step(model, opt, 2, rank)
            result["trained_to"] = 2
        else:
            raise SystemExit(f"unknown phase {phase!r}")
    finally:
        result["log"] = records.lines
        out.write_text(json.dumps(result, default=str))
    dist.barrier()
    if cfg.get("hold"):
        Path(cfg["out"], f"held-rank{rank}").write_text("")
        while True:  # the test SIGKILLs us
            time.sleep(1)
    dist.destroy_process_group()


def _flat_views(sd: Any):
    """The staged tensors themselves (views of the region), not copies."""
    if isinstance(sd, dict):
        for v in sd.values():
            yield from _flat_views(v)
    elif isinstance(sd, torch.Tensor):
        yield sd.to_local() if hasattr(sd, "to_local") else sd


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2]))
