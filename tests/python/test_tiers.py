"""The checkpoint tiers through CheckpointManager (issue 44): node
checkpoints persisted in the background to the durable dir in DCP's own
layout, restores from the fastest tier that has a checkpoint, persists
killed at each window, retention per tier.

Every job is real: ranks on gloo (tiers_worker.py), real daemons
(nodes_cluster.Cluster; two "nodes" on loopback for the replica case), a
real durable dir. The reference is the same training run uninterrupted, in
this process (tiers_worker.App)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from conftest import bin_dir, bit_equal
from nodes_cluster import Cluster
from tiers_worker import App

WORKER = Path(__file__).resolve().parent / "tiers_worker.py"


def reference(rank: int, steps: int) -> Dict[str, torch.Tensor]:
    app = App(rank, 64)
    for step in range(1, steps + 1):
        app.train(step)
    return app.snapshot()


def assert_same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b), what
    different = [k for k in a if not bit_equal(a[k], b[k])]
    assert not different, f"{what}: {different}"


def run(c: Cluster, phase: str, env_of=None, **cfg) -> List[dict]:
    cfg.setdefault("durable_dir", str(c.base / "durable"))
    c.start(phase, env_of=env_of or {}, **cfg)
    c.wait()
    results = [c.result(r) for r in range(c.world)]
    assert len({json.dumps(r["restored"]) for r in results}) == 1, results  # every rank agrees
    return results


def durable_ids(c: Cluster) -> List[str]:
    d = c.base / "durable"
    return sorted(n for n in os.listdir(d) if not n.startswith(".")) if d.exists() else []


def partial_ids(c: Cluster) -> List[str]:
    d = c.base / "durable" / ".memoffload-persisting"  # a dir per job in it
    return sorted(n for job in d.iterdir() for n in os.listdir(job)) if d.exists() else []


# Loads a persisted checkpoint with DCP's plain FileSystemReader in a process
# where memoffload cannot be imported, and lists the modules its .metadata names.
PLAIN_LOAD = r"""
import pickle, sys
sys.modules["memoffload"] = None
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
path, out = sys.argv[1], sys.argv[2]
if "://" in path:  # an object store: DCP's own fsspec reader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as FileSystemReader
    import fsspec
    _fs, _root = fsspec.core.url_to_fs(path)
    open = lambda p, mode: _fs.open(_root + p[len(path):], mode)
modules = set()
class Names(pickle.Unpickler):
    def find_class(self, module, name):
        modules.add(module)
        return super().find_class(module, name)
with open(path + "/.metadata", "rb") as f:
    Names(f).load()
md = FileSystemReader(path).read_metadata()
sd = {k: torch.empty(v.size, dtype=v.properties.dtype)
      for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
torch.save({"state": sd, "modules": sorted(modules)}, out)
"""


def plain_load(path: "Path | str", out: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(path), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)


def as_snapshot(state: Dict[str, torch.Tensor], rank: int) -> Dict[str, torch.Tensor]:
    """A plain load's flat keys (app.model0.0.weight, app.optim0.state.0.exp_avg)
    as App.snapshot's (p.0.weight, o.0.exp_avg)."""
    out = {}
    for key, value in state.items():
        if key.startswith(f"app.model{rank}."):
            out["p." + key[len(f"app.model{rank}."):]] = value
        elif key.startswith(f"app.optim{rank}.state."):
            out["o." + key[len(f"app.optim{rank}.state."):]] = value
    return out


@pytest.fixture
def one_node(tmp_path: Path):
    c = Cluster(tmp_path, node_of=[0, 0], worker=WORKER)
    yield c
    c.stop()


def test_persisted_checkpoints_load_with_plain_dcp_and_each_tier_keeps_its_own(one_node):
    c = one_node
    results = run(c, "train", steps=6, node_every=1, durable_every=2, keep_last_node=2,
                  keep_last_durable=2)
    for r in results:
        assert [n["checkpoint_id"] for n in r["status"]["node"]] == ["step-6", "step-5"], r
    # The coordinator's close() waits until its last persist is published.
    status = results[0]["status"]
    assert [n["persisted"] for n in status["node"]] == [True, False], status
    assert status["durable"] == ["step-6", "step-4"], status
    assert status["persisting"] is None and status["partial"] == [], status
    assert status["last_persisted"]["step"] == 6, status
    assert any("is persisted to" in line for line in results[0]["log"]), results[0]["log"]
    assert durable_ids(c) == ["step-4", "step-6"] and partial_ids(c) == []
    # The operator's view: which node checkpoints are persisted.
    listed = subprocess.run([str(bin_dir() / "memoffloadctl"),
                             "--runtime-dir", c.daemons[0].runtime_dir, "regions", "dcp/"],
                            capture_output=True, text=True, timeout=30).stdout
    assert "dcp/step-6/.persisted" in listed and "dcp/step-5/.persisted" not in listed, listed
    files = sorted(os.listdir(c.base / "durable" / "step-6"))
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files), files
    loaded = plain_load(c.base / "durable" / "step-6", c.base / "plain.pt")
    assert all(m.split(".")[0] in ("torch", "builtins", "collections") for m in loaded["modules"]), \
        loaded["modules"]
    for rank in range(2):
        final = c.state("train", "final", rank)
        assert_same(as_snapshot(loaded["state"], rank), final, f"rank {rank}, plain FileSystemReader")
        assert_same(final, reference(rank, 6), f"rank {rank}, trained")


def test_a_daemon_restarted_empty_restores_from_the_durable_tier_bit_for_bit(one_node):
    c = one_node
    run(c, "train", steps=5, node_every=1, durable_every=2)
    c.daemons[0].kill()
    c.daemons[0].start()  # empty: the node tier is gone
    results = run(c, "resume", steps=6, node_every=1, durable_every=2)
    for rank, r in enumerate(results):
        assert r["restored"] == 4 and r["tier"] == "filesystem", r
        assert any("restored checkpoint 'step-4' from durable storage" in line for line in r["log"]), \
            r["log"]
        assert_same(c.state("resume", "loaded", rank), reference(rank, 4), f"rank {rank} loaded")
        assert_same(c.state("resume", "final", rank), reference(rank, 6), f"rank {rank} trained on")


@pytest.mark.parametrize("window,daemon_kept", [
    ("w", False),  # while the ranks write their shards, and the node tier lost meanwhile: removed
    ("m", True),   # every shard written, no .metadata yet: finished
    ("n", True),   # .metadata written, not published: published by the rename
])
def test_a_persist_killed_leaves_nothing_visible_and_the_next_start_finishes_or_removes_it(
        one_node, window, daemon_kept):
    c = one_node
    pause = c.base / "pause"
    pause.mkdir()
    (pause / "windows").write_text(window)
    env = {r: {"MEMOFFLOAD_TEST_SAVE_PAUSE": str(pause)} for r in range(2)}
    c.start("train", env_of=env, durable_dir=str(c.base / "durable"), steps=2, node_every=2,
            durable_every=2, async_save=False)
    waiting = [0, 1] if window == "w" else [0]
    deadline = time.monotonic() + 120
    while not all((pause / f"at-{window}-{r}").exists() for r in waiting):
        assert time.monotonic() < deadline, c.err(0)
        for r in range(2):
            assert c.procs[r].poll() is None, c.err(r)
        time.sleep(0.02)
    c.kill()
    # Nothing visible: no checkpoint dir, DCP finds nothing, latest_checkpoint neither.
    assert durable_ids(c) == [] and partial_ids(c) == ["step-2"]
    from memoffload.torch.checkpoint import store as _store

    assert _store.filesystem_checkpoints(str(c.base / "durable"), c.job_id) == {}
    if not daemon_kept:
        c.daemons[0].kill()
        c.daemons[0].start()
    results = run(c, "resume", steps=2, node_every=2, durable_every=2)
    assert partial_ids(c) == []
    if not daemon_kept:  # nothing to finish it from: removed; the job starts over
        assert results[0]["restored"] is None, results[0]
        assert any("removed what an unfinished persist of checkpoint 'step-2'" in line
                   for line in results[0]["log"]), results[0]["log"]
    elif window == "n":  # its .metadata was written: published with its rename
        assert results[0]["restored"] == 2, results[0]
        assert any("published checkpoint 'step-2', which a killed persist had finished" in line
                   for line in results[0]["log"]), results[0]["log"]
    else:
        assert results[0]["restored"] == 2 and results[0]["tier"] == "daemon", results[0]
        assert any("was not persisted by the run that saved it: persisting it now" in line
                   for line in results[0]["log"]), results[0]["log"]
    assert durable_ids(c) == ["step-2"]  # finished, or saved again by the new start
    loaded = plain_load(c.base / "durable" / "step-2", c.base / "plain.pt")
    for rank in range(2):
        assert_same(as_snapshot(loaded["state"], rank), reference(rank, 2), f"rank {rank}")


def test_two_nodes_restore_from_the_replica_then_after_a_second_loss_from_durable(tmp_path):
    c = Cluster(tmp_path, node_of=[0, 1], worker=WORKER)
    try:
        run(c, "train", steps=6, node_every=2, durable_every=4, replicas=1)
        assert durable_ids(c) == ["step-4"]
        c.lose_node(1)
        results = run(c, "after_one", steps=6, node_every=2, durable_every=4, replicas=1)
        for rank, r in enumerate(results):
            assert r["restored"] == 6 and r["tier"] == "daemon", r
            remote = [w for w in r["sources"].values() if w != "local daemon"]
            assert bool(remote) == (rank == 1), r["sources"]  # rank 1's shard from node 0's replica
            assert_same(c.state("after_one", "loaded", rank), reference(rank, 6), f"rank {rank}")
        c.lose_node(0)  # the second loss: node 1 holds nothing saved since it came back
        results = run(c, "after_two", steps=8, node_every=2, durable_every=4, replicas=1)
        for rank, r in enumerate(results):
            assert r["restored"] == 4 and r["tier"] == "filesystem", r
            assert_same(c.state("after_two", "loaded", rank), reference(rank, 4), f"rank {rank}")
            assert_same(c.state("after_two", "final", rank), reference(rank, 8), f"rank {rank}")
    finally:
        c.stop()


def test_a_piece_missing_from_the_node_tier_is_read_from_its_persisted_file(one_node):
    c = one_node
    run(c, "train", steps=6, node_every=2, durable_every=2)
    from memoffload.torch.checkpoint import store as _store

    store, _ = _store.attach(c.daemons[0].runtime_dir, c.job_id, -1, True)
    store.delete("dcp/step-6/__0_0.distcp")  # rank 0's shard gone from the node, the rest there
    _store.forget(store)
    results = run(c, "resume", steps=6, node_every=2, durable_every=2)
    for rank, r in enumerate(results):
        assert r["restored"] == 6 and r["tier"] == "daemon", r
        from_durable = [line for line in r["log"] if "is read from durable storage" in line]
        assert bool(from_durable) == (rank == 0), r["log"]
        assert_same(c.state("resume", "loaded", rank), reference(rank, 6), f"rank {rank}")
    # The file is checked against the CRC32C its rank recorded before a byte is used.
    import torch.distributed.checkpoint as dcp
    from memoffload.errors import DataLoss
    from memoffload.torch.checkpoint import MemoffloadReader

    shard = c.base / "durable" / "step-6" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    reader = MemoffloadReader(job_id=c.job_id, runtime_dir=c.daemons[0].runtime_dir,
                              fallback_dir=str(c.base / "durable"))
    md = reader.read_metadata() if reader.reset("step-6") is None else None
    template = {k: torch.empty(v.size, dtype=v.properties.dtype)
                for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException around it
        dcp.load(template, storage_reader=reader, checkpoint_id="step-6", no_dist=True)
    inner = list(getattr(raised.value, "failures", {0: raised.value}).values())[0]
    inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, its traceback)
    assert isinstance(inner, DataLoss) and "CRC32C" in str(inner), inner


def test_an_object_store_as_the_durable_tier_through_fsspec(one_node):
    c = one_node
    url = f"file://{c.base}/bucket/run"  # fsspec's local file system: an object store's API
    run(c, "train", durable_dir=url, steps=4, node_every=1, durable_every=2, keep_last_durable=1)
    bucket = c.base / "bucket" / "run"
    assert sorted(p.name for p in bucket.iterdir()) == ["step-4"]  # retention: the newest only
    loaded = plain_load(f"{url}/step-4", c.base / "plain.pt")  # DCP's FsspecReader, no memoffload
    for rank in range(2):
        assert_same(as_snapshot(loaded["state"], rank), reference(rank, 4), f"rank {rank}")
    c.daemons[0].kill()
    c.daemons[0].start()  # the node tier gone: restored from the bucket
    results = run(c, "resume", durable_dir=url, steps=6, node_every=1, durable_every=2,
                  keep_last_durable=1)
    for rank, r in enumerate(results):
        assert r["restored"] == 4 and r["tier"] == "filesystem", r
        assert_same(c.state("resume", "loaded", rank), reference(rank, 4), f"rank {rank} loaded")
        assert_same(c.state("resume", "final", rank), reference(rank, 6), f"rank {rank} trained on")
    assert sorted(p.name for p in bucket.iterdir()) == ["step-6"]


def test_persists_that_cannot_keep_up_wait_one_at_a_time_and_the_dropped_leave_nothing(one_node):
    c = one_node
    # Every step durable, each persist slowed to a hundredth of its share:
    # step-2 waits behind step-1, step-3 drops it, step-4 drops step-3.
    results = run(c, "train", steps=4, node_every=1, durable_every=1, share=0.01, keep_last_node=4,
                  keep_last_durable=None, async_save=False, persist_timeout_s=60)
    log = [line for r in results for line in r["log"]]
    dropped = [line for line in log if "is not persisted:" in line]
    assert dropped, log
    assert not any("within" in line for line in log), log  # nobody waited for a dropped one
    assert "step-1" in durable_ids(c) and "step-4" in durable_ids(c), durable_ids(c)
    assert partial_ids(c) == []
    loaded = plain_load(c.base / "durable" / "step-4", c.base / "plain.pt")
    for rank in range(2):
        assert_same(as_snapshot(loaded["state"], rank), reference(rank, 4), f"rank {rank}")
