"""Checkpoints of a job on two "nodes", and their replicas (issue 33).

Each simulated node is a memoffloadd with its own runtime dir; its 2 ranks
(of 4, FSDP2 on gloo over lo) use that daemon and send the replicas from a
loopback address of their own (127.0.0.2 for node 0, 127.0.0.3 for node 1).
Everything is real: the daemons, their sockets, gloo between the ranks.

- A save with ``replicas=1`` is node-safe; node 1's ranks *and* its daemon
  are SIGKILLed, node 1 gets a fresh empty daemon, and 4 new ranks load the
  newest node-safe checkpoint bit for bit (node 1's shards from the
  replicas on node 0), then train on bit-identical to the run that was not
  interrupted.
- A node lost during a save leaves the previous node-safe checkpoint usable.
- A flipped byte in one copy is DATA_LOSS, and the reader takes the other.
- A peer whose daemon is down (its ranks live) makes the save say it is not
  node-safe, and training goes on.
"""

from __future__ import annotations

import re

import signal
import time
from pathlib import Path
from typing import Dict

import pytest
import torch

from conftest import bit_equal
from nodes_cluster import NODE_OF, WORLD, Cluster

@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


def assert_same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b), what
    different = [k for k in a if not bit_equal(a[k], b[k])]
    assert not different, f"{what}: {different[:5]}"


def test_a_lost_node_restores_from_the_replicas_bit_for_bit_and_trains_on(cluster):
    cluster.start("train", hold=True, piece_bytes=3000)  # many rounds per stream
    cluster.wait_for("held")
    for rank in range(cluster.world):
        r = cluster.result(rank)
        for ckpt in ("step-2", "step-4"):
            assert r[ckpt]["mode"] == "daemon", r
            assert r[ckpt]["node_safe"] is True, r[ckpt]["why"]
        assert r["step-4"]["held"], r  # each rank holds its buddy's shard
        assert r["step-4"]["deleted"] == (["step-2"] if rank in (0, 2) else []), r
    assert any("is node-safe" in line for line in cluster.result(0)["log"])
    # Each node holds every piece: its own shards, the other node's, .metadata.
    for node in (0, 1):
        names = cluster.regions(node)
        assert {f"dcp/step-4/__{r}_0.distcp" for r in range(WORLD)} <= set(names), names
        assert {"dcp/step-4/.metadata", "dcp/step-4/.node-safe"} <= set(names), names
    cluster.lose_node(1)
    cluster.kill()  # the job restarts as a whole
    assert cluster.regions(1) == []

    cluster.start("restore", piece_bytes=3000)
    cluster.wait()
    for rank in range(cluster.world):
        r = cluster.result(rank)
        assert r["latest"] == "step-4" and r["step"] == 4 and r["load_mode"] == "daemon", r
        assert_same(cluster.state("restore", "loaded", rank), cluster.state("train", "saved", rank),
                    f"rank {rank} loaded")
        assert_same(cluster.state("restore", "final", rank), cluster.state("train", "final", rank),
                    f"rank {rank} trained on")
        replica = [where for where in r["sources"].values() if where != "local daemon"]
        assert bool(replica) == (NODE_OF[rank] == 1), r["sources"]
        for where in replica:  # "the daemon of rank N's node (memoffloadd instance ...)"
            assert NODE_OF[int(where.split("rank ")[1].split("'")[0])] == 0, where


def test_without_replicas_each_node_finds_every_piece_after_a_restart(cluster):
    """Before issue 33 only the coordinator's node got .metadata: node 1's
    ranks could not load, and no rank could read a piece DCP had stored once
    in another node's region (a replicated item, deduplicated)."""
    cluster.start("train", replicas=0)
    cluster.wait()
    for rank in range(cluster.world):
        r = cluster.result(rank)
        assert r["step-4"]["mode"] == "daemon" and r["step-4"]["node_safe"] is False, r
        assert r["step-4"]["why"] == "", r
    for node in (0, 1):
        names = set(cluster.regions(node))
        assert "dcp/step-4/.metadata" in names and "dcp/step-4/.layout" in names, names
        assert "dcp/step-4/.node-safe" not in names, names
        assert "dcp/step-2/.metadata" not in names, names  # keep_last=1 on each node
    cluster.start("restore", node_safe=False)
    cluster.wait()
    for rank in range(cluster.world):
        r = cluster.result(rank)
        assert r["latest"] == "step-4" and r["step"] == 4, r
        assert_same(cluster.state("restore", "loaded", rank), cluster.state("train", "saved", rank),
                    f"rank {rank} loaded")
        assert_same(cluster.state("restore", "final", rank), cluster.state("train", "final", rank),
                    f"rank {rank} trained on")
    # Node 1 lost without replicas: no rank may start from step-4 (its shards are gone).
    cluster.lose_node(1)
    cluster.start("restore", node_safe=False)
    for rank in range(WORLD):
        cluster.procs[rank].wait(timeout=180)
    assert all(cluster.result(rank)["latest"] is None for rank in range(WORLD))


def test_a_node_lost_during_a_save_leaves_the_previous_node_safe_checkpoint(cluster):
    cluster.start("die_mid_save", daemon_pid=cluster.daemons[1].proc.pid)
    deadline = time.monotonic() + 180
    while cluster.procs[2].poll() is None:  # rank 2 kills its daemon and itself mid-write
        assert time.monotonic() < deadline, cluster.err(2)
        time.sleep(0.05)
    assert cluster.procs[2].returncode == -signal.SIGKILL, cluster.err(2)
    r = cluster.result(0)
    assert r["step-2"]["node_safe"] is True, r
    cluster.kill()
    cluster.daemons[1].proc.wait()
    cluster.daemons[1].start()

    cluster.start("restore")
    cluster.wait()
    for rank in range(cluster.world):
        r = cluster.result(rank)
        assert r["latest"] == "step-2" and r["step"] == 2, r
        assert_same(cluster.state("restore", "loaded", rank),
                    cluster.state("die_mid_save", "saved", rank), f"rank {rank} loaded")


def test_a_save_that_died_leaves_pieces_on_other_nodes_and_its_id_saves_again(cluster):
    """Rank 0 dies in the save of step-4 after the others committed their
    shards: node 1 (not the coordinator's) keeps regions of a checkpoint
    without .metadata. The restarted job loads step-2, and its save of
    step-4 collects them on each node first (before issue 33's fix, only the
    coordinator's node was collected: node 1's region names were taken)."""
    cluster.start("die_mid_save", killer=0)
    deadline = time.monotonic() + 180
    while cluster.procs[0].poll() is None:
        assert time.monotonic() < deadline, cluster.err(0)
        time.sleep(0.05)
    cluster.kill()
    assert "dcp/step-4/__2_0.distcp" in cluster.regions(1)
    assert "dcp/step-4/.metadata" not in cluster.regions(1)
    cluster.start("restore", resave=True)
    cluster.wait()
    for rank in range(WORLD):
        r = cluster.result(rank)
        assert r["latest"] == "step-2", r
        assert r["step-4"]["mode"] == "daemon" and r["step-4"]["node_safe"] is True, r
        assert r["collected"] == (["step-4"] if rank in (0, 2) else []), r
        assert_same(cluster.state("restore", "loaded", rank),
                    cluster.state("die_mid_save", "saved", rank), f"rank {rank} loaded")


def test_a_flipped_byte_is_data_loss_and_the_reader_takes_the_other_copy(cluster):
    cluster.start("flip")
    cluster.wait()
    for rank in range(cluster.world):
        r = cluster.result(rank)
        assert r["node_safe"] is True and r["step"] == 2, r
        assert_same(cluster.state("flip", "loaded", rank), cluster.state("flip", "saved", rank),
                    f"rank {rank} loaded")
    r0 = cluster.result(0)
    assert r0["sources"]["dcp/step-2/__0_0.distcp"].startswith("the daemon of rank 2"), r0["sources"]
    assert any("is damaged" in line and "DATA_LOSS" in line.upper() for line in r0["log"]), r0["log"]
    for rank in (1, 2, 3):
        assert set(cluster.result(rank)["sources"].values()) == {"local daemon"}


def test_a_peer_daemon_down_makes_the_save_not_node_safe_and_training_goes_on(cluster):
    cluster.start("peer_down")
    cluster.wait_for("saved")
    cluster.daemons[1].kill()  # node 1's ranks live on
    (cluster.out / "go").write_text("")
    cluster.wait()
    for rank in range(cluster.world):
        r = cluster.result(rank)
        assert r["step-2"]["node_safe"] is True, r
        assert r["step-4"]["node_safe"] is False and r["step-4"]["mode"] == "filesystem", r
        assert "filesystem" in r["step-4"]["why"], r
        assert r["trained_to"] == 6
        assert r["latest_node_safe"] == "step-2", r


def test_three_nodes_a_lost_middle_node_restores_from_the_next_one(tmp_path):
    """3 nodes of 1 rank: rank r's replica is on node r+1 (ring), so no node
    holds both copies of a shard; node 1 lost, its shard comes from node 2."""
    cluster = Cluster(tmp_path, node_of=[0, 1, 2])
    try:
        cluster.start("train")
        cluster.wait()
        for rank in range(3):
            r = cluster.result(rank)
            assert r["step-4"]["node_safe"] is True, r
            held = r["step-4"]["held"]  # async_save: tensors in _0, other items in _1
            assert held and all(n.startswith(f"dcp/step-4/__{(rank - 1) % 3}_") for n in held), r
        for node in range(3):
            shards = {n.split("/")[-1].split("_")[2] for n in cluster.regions(node) if n.endswith(".distcp")}
            assert shards == {str(node), str((node - 1) % 3)}, (node, shards)
        cluster.lose_node(1)
        cluster.start("restore")
        cluster.wait()
        for rank in range(3):
            r = cluster.result(rank)
            assert r["latest"] == "step-4", r
            assert_same(cluster.state("restore", "loaded", rank), cluster.state("train", "saved", rank),
                        f"rank {rank} loaded")
        assert cluster.result(1)["sources"]["dcp/step-4/__1_0.distcp"].startswith("the daemon of rank 2")
    finally:
        cluster.stop()


def test_a_rank_whose_replication_address_is_not_its_own_fails_every_save_clearly(cluster):
    """Not a 10-minute gloo rendezvous timeout on the other ranks: each
    rank's device is tried when the job learns its nodes."""
    cluster.start("bad_device", env_of={3: {"MEMOFFLOAD_REPLICATION_ADDRESS": "192.0.2.1"}})
    cluster.wait(timeout=120)
    for rank in range(WORLD):
        r = cluster.result(rank)
        assert r["trained_to"] == 2, r
        assert "rank 3: $MEMOFFLOAD_REPLICATION_ADDRESS='192.0.2.1'" in r["error"], r["error"]
        assert "FailedPrecondition" in r["error"] or "FAILED_PRECONDITION" in r["error"], r["error"]


def test_a_trainer_that_exits_right_after_its_save_leaves_it_node_safe(cluster):
    cluster.start("exit_early")
    cluster.wait(timeout=120)
    for node in (0, 1):
        names = set(cluster.regions(node))
        assert {"dcp/step-1/.metadata", "dcp/step-1/.node-safe"} <= names, (node, names)


def _both_nodes_hold(cluster: Cluster, ckpt: str) -> None:
    for node in (0, 1):
        names = set(cluster.regions(node))
        shards = {f"dcp/{ckpt}/__{r}_0.distcp" for r in range(WORLD)} | {f"dcp/{ckpt}/.metadata"}
        assert shards <= names, (node, sorted(names))


def test_a_writer_per_save_waits_for_the_previous_saves_replication(cluster):
    """The next save used to wait only for its own writer's replication: with
    a writer per save it collected the previous save's regions on node 1 as
    a dead save's (its .metadata was not there yet)."""
    cluster.start("writer_per_save", slow_records=1.0, keep_last=2)
    cluster.wait()
    cluster.start("restore", node_safe=True)
    cluster.wait()
    _both_nodes_hold(cluster, "step-1")
    _both_nodes_hold(cluster, "step-2")
    for rank in range(WORLD):
        assert cluster.result(rank)["latest"] == "step-2"
        assert_same(cluster.state("restore", "loaded", rank),
                    cluster.state("writer_per_save", "saved2", rank), f"rank {rank}")


def test_wait_replication_that_times_out_raises_and_the_next_save_waits(cluster):
    cluster.start("wait_timeout", slow_records=1.0, keep_last=2)
    cluster.wait()
    for rank in range(WORLD):
        r = cluster.result(rank)
        assert r["timed_out"] is True and r["step-2"]["node_safe"] is True, r
    _both_nodes_hold(cluster, "step-1")
    _both_nodes_hold(cluster, "step-2")


def test_latest_checkpoint_on_one_rank_of_a_multi_node_job_fails_clearly_and_training_goes_on(cluster):
    """It is a collective there. Rank 0 alone waits the replication timeout
    and gets DEADLINE_EXCEEDED naming the rule. The ranks' next save is
    where they meet again (issue 40): it is node-safe, not "out of step
    until the job restarts" as on the gloo link."""
    cluster.start("latest_on_rank_0", timeout_s=5)
    cluster.wait(timeout=120)
    r0 = cluster.result(0)
    assert r0["alone"].startswith("DeadlineExceeded") and "on every rank" in r0["alone"], r0
    assert r0["alone_s"] < 30, r0
    for rank in range(WORLD):
        r = cluster.result(rank)
        assert r["step-2"]["node_safe"] is True, r
        assert r["step-4"]["node_safe"] is True, r
        assert r["save_s"] < 30 and r["trained_to"] == 5, r


def test_bytes_changed_between_nodes_are_caught_end_to_end(cluster):
    """A replica whose pieces' CRC-32 differ from what was read on the
    sender is not committed (not node-safe); a load whose every copy of a
    region is damaged fails with DATA_LOSS naming each copy tried, after a
    WARNING per copy."""
    cluster.start("in_transit")
    cluster.wait()
    for rank in range(WORLD):
        r = cluster.result(rank)
        assert r["step-1"]["node_safe"] is False and "arrived damaged" in r["step-1"]["why"], r
        assert r["step-2"]["node_safe"] is True, r
        assert "load_error" in r, r
    r0 = cluster.result(0)
    assert "DataLoss" in r0["load_error"] or "DATA_LOSS" in r0["load_error"], r0["load_error"]
    assert "damaged:" in r0["load_error"] and "from rank 2" in r0["load_error"], r0["load_error"]
    assert sum("could not be used" in line for line in r0["log"]) == 2, r0["log"]


def test_a_region_whose_only_copy_is_damaged_is_data_loss_on_every_rank(cluster):
    """Issue 41: one error per cause on every rank. Every rank needs the
    shard that holds a plain tensor of the state, whose only copy is
    damaged: the
    ranks of the other node used to fail with NOT_FOUND ("no node holds an
    intact copy") while those of the holder's node said DATA_LOSS."""
    cluster.start("only_copy_damaged", replicas=0)
    cluster.wait()
    for rank in range(WORLD):
        error = cluster.result(rank)["load_error"]
        failures = re.findall(r"^memoffload\.errors\.(\w+): ", error, re.M)
        assert len(failures) == WORLD and set(failures) == {"DataLoss"}, (rank, error)
        assert cluster.result(rank)["holder"] in error, error


def test_a_save_one_rank_could_not_write_is_skipped_and_the_next_one_is_node_safe(cluster):
    """The failed save's background work used to commit a .metadata of None
    on the other node (a TypeError), which left the link out of step: every
    later save of the process was not node-safe."""
    cluster.start("write_refused")
    cluster.wait()
    for rank in range(WORLD):
        r = cluster.result(rank)
        assert r["step-1"]["where"] == "skipped" and "rank 2" in r["step-1"]["why"], r
        assert "refused once by the test" in r["step-1"]["why"], r
        assert r["step-2"]["node_safe"] is True, r
