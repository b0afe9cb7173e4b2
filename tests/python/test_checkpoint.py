"""memoffload.torch.checkpoint with a real daemon and a real 2-rank FSDP2
(gloo, CPU) job of plain processes (ckpt_worker.py), so that the test can
SIGKILL every rank:

* run A trains, checkpoints into the daemon (keep_last=2), is SIGKILLed
  during a last save (rank 1 mid-write, then rank 0); run B, new processes
  with the same job id, loads latest_checkpoint() and must see exactly what A
  saved, then train to exactly A's final state;
* the killed save leaves no complete checkpoint and deletes nothing;
* run B's shards also load a checkpoint one process saved of the whole model
  (each reads a slice of a stored tensor);
* when one rank has no daemon, every rank writes a filesystem checkpoint,
  says so in one warning line on stderr, and loads it back bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from conftest import bit_equal, free_port

WORKER = Path(__file__).resolve().parent / "ckpt_worker.py"
WORLD_SIZE = 2



class Job:
    """WORLD_SIZE worker processes of one phase."""

    def __init__(self, cfg: Dict[str, Any]) -> None:
        port = free_port()
        self.cfg = cfg
        self.procs: List[subprocess.Popen] = []
        self.stderr: List[Path] = []
        for rank in range(WORLD_SIZE):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.pop("MEMOFFLOAD_JOB_ID", None)
            err = Path(cfg["out"]) / f"{cfg['phase']}-rank{rank}.stderr"
            self.stderr.append(err)
            self.procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg)],
                                               env=env, stdout=subprocess.DEVNULL, stderr=open(err, "wb")))

    def wait(self, timeout: float = 120) -> None:
        for rank, p in enumerate(self.procs):
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"rank {rank} of {self.cfg['phase']} did not finish: {self.err(rank)}")
            assert p.returncode == 0, f"rank {rank} exited {p.returncode}: {self.err(rank)}"

    def wait_for(self, rank: int, path: Path, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.procs[rank].poll() is not None:
                pytest.fail(f"rank {rank} exited {self.procs[rank].returncode}: {self.err(rank)}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{path} did not appear")
            time.sleep(0.05)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()

    def err(self, rank: int) -> str:
        return self.stderr[rank].read_text()[-4000:]

    def result(self, rank: int) -> Dict[str, Any]:
        return json.loads((Path(self.cfg["out"]) / f"{self.cfg['phase']}-rank{rank}.json").read_text())


def snapshot(out: Path, phase: str, name: str, rank: int) -> Dict[str, Any]:
    return torch.load(out / f"{phase}-{name}-rank{rank}.pt", weights_only=False)


def assert_same_state(a: Dict[str, Any], b: Dict[str, Any], what: str) -> None:
    """Every entry bit for bit (tensors) or equal (the rest); "step" may differ
    only as the saved step counter of the snapshot."""
    assert sorted(a) == sorted(b), what
    n_tensors = 0
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert bit_equal(a[key], b[key]), f"{what}: {key} differs"
            n_tensors += 1
        else:
            assert a[key] == b[key], f"{what}: {key}: {a[key]!r} != {b[key]!r}"
    assert n_tensors > 10, (what, sorted(a))
    assert any(k.startswith(".optim.state.") for k in a), sorted(a)  # AdamW moments are there
    assert any(k.startswith(".rng_") for k in a), sorted(a)


JOBS: List[str] = []  # job ids whose regions the module deletes at its end


@pytest.fixture(scope="module")
def region_daemon(daemon):
    """The module's daemon. At the end the checkpoints of JOBS are deleted
    and this process's region sessions end, before the daemon stops (its
    SIGTERM drain waits for the memory they hold)."""
    yield daemon
    from memoffload.torch.checkpoint import store

    for job in JOBS:
        s, _ = store.attach(daemon.runtime_dir, job, -1, True)
        for info in store.stored_checkpoints(s).values():
            store.delete_checkpoint(s, info)
    store.forget_all()


@pytest.fixture(scope="module")
def crash_and_restart(region_daemon, tmp_path_factory):
    """Run A (SIGKILLed in a save), then run B of the same job id."""
    out = tmp_path_factory.mktemp("ckpt")
    cfg = {"out": str(out), "job_id": f"ckpt-{uuid.uuid4().hex[:8]}",
           "runtime_dir": region_daemon.runtime_dir,
           "fallback_dir": str(out / "fallback")}
    JOBS.append(cfg["job_id"])
    a = Job(dict(cfg, phase="run_a", kill_save=True))
    a.wait_for(0, out / "run_a-rank0.json")
    a.wait_for(1, out / "run_a-rank1.json")
    # rank 1 SIGKILLs itself mid-write; then we SIGKILL rank 0 (blocked in the save).
    a.procs[1].wait(timeout=60)
    assert a.procs[1].returncode == -signal.SIGKILL, a.err(1)
    a.kill()
    assert a.procs[0].returncode == -signal.SIGKILL
    after_kill = regions_of(cfg)
    full_job = save_full_model(cfg)
    b = Job(dict(cfg, phase="run_b", full_job=full_job))
    b.wait()
    return out, cfg, a, b, after_kill


def save_full_model(cfg: Dict[str, Any]) -> str:
    """Checkpoint "full" of a job of its own: the unsharded initial model of
    ckpt_worker with every parameter + 1, saved by this one process."""
    import torch.distributed.checkpoint as dcp
    import ckpt_worker
    from memoffload.torch.checkpoint import MemoffloadWriter

    job = cfg["job_id"] + "-full"
    JOBS.append(job)
    torch.manual_seed(0)
    state = {k: v + 1 for k, v in ckpt_worker.Net().state_dict().items()}
    writer = MemoffloadWriter(job_id=job, runtime_dir=cfg["runtime_dir"], fallback_dir=cfg["fallback_dir"])
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": state}, storage_writer=writer, checkpoint_id="full", no_dist=True)
    assert writer.last_mode == "daemon"
    return job


def regions_of(cfg: Dict[str, Any]) -> Dict[str, Any]:
    from memoffload.torch.checkpoint import store

    s, reason = store.attach(cfg["runtime_dir"], cfg["job_id"], -1, True)
    assert s is not None, reason
    return {c.checkpoint_id: {"complete": c.complete, "regions": sorted(c.regions)}
            for c in store.stored_checkpoints(s).values()}


def test_restart_loads_exactly_what_was_saved_and_trains_on_identically(crash_and_restart):
    out, cfg, a, b, _ = crash_and_restart
    for rank in range(WORLD_SIZE):
        ra, rb = a.result(rank), b.result(rank)
        assert [s["mode"] for s in ra["saves"]] == ["daemon"] * 3, ra
        assert rb["latest"] == "step-4", rb
        assert rb["loads"] == [{"checkpoint_id": "step-4", "mode": "daemon", "step": 4}], rb
        saved = snapshot(out, "run_a", "saved", rank)
        loaded = snapshot(out, "run_b", "loaded", rank)
        assert_same_state(saved, loaded, f"rank {rank}: loaded vs saved")
        assert_same_state(snapshot(out, "run_a", "final", rank), snapshot(out, "run_b", "final", rank),
                          f"rank {rank}: final state of the restarted run vs the uninterrupted one")
        # Training moved on after the save, so the comparison is not vacuous.
        final = snapshot(out, "run_a", "final", rank)
        assert any(isinstance(v, torch.Tensor) and not bit_equal(v, saved[k]) for k, v in final.items())


def test_a_rank_loads_part_of_a_stored_tensor_when_resharding(crash_and_restart):
    """Run B's shards read slices of the tensors one process stored whole."""
    out, cfg, a, b, _ = crash_and_restart
    narrowed = 0
    for rank in range(WORLD_SIZE):
        got = b.result(rank)["resharded"]
        assert len(got) == 6, got
        for name, (shape, equal) in got.items():
            assert equal, f"rank {rank}: {name} (local shape {shape}) differs from init + 1"
        narrowed += sum(shape[0] < 64 and shape[0] > 0 for shape, _ in got.values())
    assert narrowed >= 4, got  # the 64-row weights and biases were split between the ranks


def test_keep_last_deletes_only_after_the_new_checkpoint_committed(crash_and_restart):
    out, cfg, a, b, after_kill = crash_and_restart
    # The save killed mid-write deleted nothing.
    assert sorted(c for c, v in after_kill.items() if v["complete"]) == ["step-3", "step-4"], after_kill
    ra = a.result(0)
    by_step = ra["regions_after"]
    assert sorted(by_step["2"]) == ["step-2"]
    assert sorted(by_step["3"]) == ["step-2", "step-3"]
    assert sorted(by_step["4"]) == ["step-3", "step-4"], by_step["4"]  # step-2 went after step-4 committed
    assert [s["deleted"] for s in ra["saves"]] == [[], [], ["step-2"]]
    for ckpt in by_step["4"].values():
        assert ckpt["complete"]
        assert len(ckpt["regions"]) == WORLD_SIZE + 1  # one region per rank + .metadata
    # Run B's save of step-6 deleted the dead save's leftovers (the same id)
    # before writing, and step-3 after its commit.
    rb = b.result(0)
    assert [s["collected"] for s in rb["saves"]] == [["step-6"]], rb
    assert [s["deleted"] for s in rb["saves"]] == [["step-3"]], rb
    assert [s["collected"] for s in ra["saves"]] == [[], [], []], ra
    final = rb["regions_after"]["6"]
    assert sorted(final) == ["step-4", "step-6"] and all(c["complete"] for c in final.values()), final


def test_a_save_killed_mid_write_leaves_no_complete_checkpoint(crash_and_restart):
    out, cfg, a, b, after_kill = crash_and_restart
    from memoffload.torch.checkpoint import latest_checkpoint

    killed = after_kill.get("step-6")
    assert killed is not None, after_kill  # rank 0's region had committed
    assert not killed["complete"], killed
    # rank 1 died before committing: its region is gone with it.
    assert killed["regions"] == ["dcp/step-6/__0_0.distcp"], killed
    assert b.result(0)["latest"] == "step-4"
    assert latest_checkpoint(cfg["job_id"], cfg["runtime_dir"], cfg["fallback_dir"]) == "step-6"  # B's


def test_without_a_daemon_on_one_rank_all_fall_back_to_files_visibly(region_daemon, tmp_path):
    """Rank 0 reaches the daemon, rank 1 has none: the coordinator sends both
    to the filesystem (never half a checkpoint in each); both load it back
    bit for bit, rank 0 because the daemon does not have it."""
    missing = str(tmp_path / "no-daemon")
    cfg = {"out": str(tmp_path), "job_id": f"fb-{uuid.uuid4().hex[:8]}",
           "runtime_dir": [region_daemon.runtime_dir, missing],
           "fallback_dir": str(tmp_path / "fallback"), "phase": "fallback"}
    job = Job(cfg)
    job.wait()
    path = str(Path(cfg["fallback_dir"]) / "step-2")
    assert (Path(path) / ".metadata").exists()
    assert sorted(p.name for p in Path(path).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for rank in range(WORLD_SIZE):
        r = job.result(rank)
        assert [s["mode"] for s in r["saves"]] == ["filesystem"], r
        assert r["loads"] == [{"checkpoint_id": "step-2", "mode": "filesystem", "step": 2}], r
        assert r["latest"] == "step-2"
        assert_same_state(snapshot(tmp_path, "fallback", "saved", rank),
                          snapshot(tmp_path, "fallback", "loaded", rank), f"rank {rank}")
        # One line per save and per load, naming the runtime dir, the reason and the path.
        lines = [line for line in job.err(rank).splitlines() if "falls back to the filesystem" in line]
        assert len(lines) == 2, job.err(rank)
        save, load = lines
        assert f"no memoffload daemon reachable at {missing} (rank 1: UNAVAILABLE" in save, save
        assert save.endswith(f"; using {path}"), save
        if rank == 0:
            want = f"the memoffload daemon at {region_daemon.runtime_dir} has no checkpoint 'step-2'"
            assert want in load, load
        else:
            assert f"no memoffload daemon reachable at {missing} (UNAVAILABLE" in load, load
        assert load.endswith(f"; using {path}"), load


def test_job_id_must_be_explicit(monkeypatch):
    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter, latest_checkpoint

    monkeypatch.delenv("MEMOFFLOAD_JOB_ID", raising=False)
    for make in (MemoffloadWriter, MemoffloadReader, latest_checkpoint):
        with pytest.raises(ValueError, match="explicit job id"):
            make()
    monkeypatch.setenv("MEMOFFLOAD_JOB_ID", "from-env")
    assert MemoffloadWriter().job_id == "from-env"
    assert MemoffloadWriter(job_id="arg").job_id == "arg"


def test_checkpoint_ids_name_one_directory_level():
    from memoffload.torch.checkpoint import MemoffloadWriter

    assert MemoffloadWriter.validate_checkpoint_id("step-100")
    for bad in ("", "a/b", "..", "has space", "x" * 201, 7):
        assert not MemoffloadWriter.validate_checkpoint_id(bad), bad


def _tiny_state() -> Dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {"w": torch.randn(4, 8, generator=gen), "b": torch.randn(8, generator=gen).to(torch.bfloat16),
            "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5), "extra": {"epoch": 3, "name": "x"}}


def test_one_process_round_trip_and_an_existing_id_is_refused(region_daemon, tmp_path):
    import memoffload
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter

    job = f"one-{uuid.uuid4().hex[:8]}"
    JOBS.append(job)
    kw = dict(job_id=job, runtime_dir=region_daemon.runtime_dir, fallback_dir=str(tmp_path / "fb"))
    state = _tiny_state()
    writer = MemoffloadWriter(keep_last=None, **kw)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=writer, checkpoint_id="a", no_dist=True)
    assert writer.last_mode == "daemon"
    back = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {}) for k, v in state.items()}
    back["extra"] = {"epoch": 0, "name": ""}
    reader = MemoffloadReader(**kw)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(back, storage_reader=reader, checkpoint_id="a", no_dist=True)
    assert reader.last_mode == "daemon"
    for key in ("w", "b", "empty", "scalar"):
        assert bit_equal(back[key], state[key]), key
    assert back["extra"] == state["extra"]
    # The same id again: refused before anything is written; the old one stays.
    with pytest.raises(CheckpointException) as refused, pytest.warns(UserWarning):
        dcp.save(state, storage_writer=MemoffloadWriter(**kw), checkpoint_id="a", no_dist=True)
    assert isinstance(refused.value.failures[0][0], memoffload.AlreadyExists), refused.value
    with pytest.warns(UserWarning):
        dcp.load(back, storage_reader=MemoffloadReader(**kw), checkpoint_id="a", no_dist=True)
    # An id that is nowhere: the error names both places.
    with pytest.raises(CheckpointException) as missing, pytest.warns(UserWarning):
        dcp.load(back, storage_reader=MemoffloadReader(**kw), checkpoint_id="nope", no_dist=True)
    error = missing.value.failures[0][0]
    assert isinstance(error, (FileNotFoundError, AssertionError)), missing.value
    text = str(missing.value)
    assert "has no checkpoint 'nope'" in text and str(tmp_path / "fb" / "nope") in text, text


def test_checkpoints_do_not_survive_a_daemon_restart_and_the_writer_reattaches(own_daemon, tmp_path):
    """The daemon is SIGKILLed and started again: its regions are gone
    (docs/checkpoints.md says so), latest_checkpoint() says None, and the
    same writer's next save attaches a new session and lands in the daemon."""
    import torch.distributed.checkpoint as dcp
    from memoffload.torch.checkpoint import store as _checkpoint_store
    from memoffload.torch.checkpoint import MemoffloadWriter, latest_checkpoint

    job = f"restart-{uuid.uuid4().hex[:8]}"
    kw = dict(job_id=job, runtime_dir=own_daemon.runtime_dir, fallback_dir=str(tmp_path / "fb"))
    writer = MemoffloadWriter(**kw)
    try:
        with pytest.warns(UserWarning):
            dcp.save(_tiny_state(), storage_writer=writer, checkpoint_id="before", no_dist=True)
        assert writer.last_mode == "daemon"
        assert latest_checkpoint(**kw) == "before"
        own_daemon.kill()
        own_daemon.start()
        assert latest_checkpoint(**kw) is None
        with pytest.warns(UserWarning):
            dcp.save(_tiny_state(), storage_writer=writer, checkpoint_id="after", no_dist=True)
        assert writer.last_mode == "daemon"
        assert latest_checkpoint(**kw) == "after"
        assert not (tmp_path / "fb").exists()  # never fell back
    finally:
        s, _ = _checkpoint_store.attach(own_daemon.runtime_dir, job, -1, True)
        if s is not None:
            for info in _checkpoint_store.stored_checkpoints(s).values():
                _checkpoint_store.delete_checkpoint(s, info)
        _checkpoint_store.forget_all()


def test_a_region_takes_cpu_and_cuda_tensors_and_refuses_others_with_invalid_argument(region_daemon):
    """RegionWriter.append copies a CPU tensor, or a CUDA one straight from the
    device (test_gpu_training.py); a tensor on any other device is refused
    with INVALID_ARGUMENT naming it, and nothing is written. read_into takes
    CPU tensors only."""
    import memoffload
    from memoffload import _C

    job = f"dev-{uuid.uuid4().hex[:8]}"
    JOBS.append(job)
    store = _C.RegionStore(runtime_dir=region_daemon.runtime_dir, job_id=job, rank=0,
                           checksums=True, rpc_timeout_ms=10000)
    writer = store.create("r", 64, 60)
    with pytest.raises(memoffload.InvalidArgument, match="CPU or CUDA tensors .* got one on meta"):
        writer.append(torch.empty(4, device="meta"))
    assert writer.written == 0
    data = torch.arange(16, dtype=torch.float32)
    assert writer.append(data) == 0
    writer.commit()
    reader = store.open("r")
    with pytest.raises(memoffload.InvalidArgument, match="only CPU tensors .* out of a region"):
        reader.read_into(0, torch.empty(16, device="meta"))
    back = torch.empty(16)
    reader.read_into(0, back)
    assert torch.equal(back, data)
    reader.close()
    store.delete("r")
    store.close()
