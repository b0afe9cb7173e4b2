"""The rules of node-safe checkpoints that need no second node: where the
replicas go (ring order, never two copies on one node), which holder serves
a missing region, which checkpoint every rank can load, that keep_last
never deletes the newest node-safe checkpoint, and what replicas=1 says on
one node (issue 33). The two-node behaviour is in test_node_safe.py."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from memoffload.torch.checkpoint import store
from memoffload.torch.checkpoint.nodes.load import _assign, choose
from memoffload.torch.checkpoint.nodes.topology import Topology


def _topo(rank, nodes):
    return Topology(rank, tuple(f"host:/run/n{n}" for n in nodes))


def test_replicas_go_to_the_same_local_rank_of_the_next_nodes_never_twice_on_one_node():
    topo = _topo(0, [0, 0, 1, 1, 2, 2])
    assert [topo.buddies(r, 1) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert topo.buddies(0, 2) == [2, 4]
    assert topo.buddies(0, 5) == [2, 4]  # at most one copy per other node
    assert [topo.sources(r, 1) for r in range(6)] == [[4], [5], [0], [1], [2], [3]]
    for r in range(6):
        homes = [topo.node_of[b] for b in topo.buddies(r, 2)]
        assert topo.node_of[r] not in homes and len(set(homes)) == len(homes)
    assert [topo.leader(r) for r in range(6)] == [True, False, True, False, True, False]
    uneven = _topo(0, [0, 0, 0, 1])
    assert [uneven.buddies(r, 1) for r in range(4)] == [[3], [3], [3], [0]]
    assert uneven.sources(3, 1) == [0, 1, 2]
    assert _topo(0, [0, 0]).buddies(0, 1) == []  # one node: nowhere to put a replica


def test_a_missing_region_is_served_by_another_nodes_holder_not_yet_tried_spreading_the_load():
    nodes = ("n0", "n0", "n1", "n1")
    asks = [{"missing": [], "have": {"a": 1, "b": 1}},
            {"missing": [], "have": {"a": 1, "b": 1}},
            {"missing": ["a", "b"], "have": {}},
            {"missing": ["a", "c"], "have": {}}]
    plan = _assign(asks, set(), nodes)
    assert plan == [(2, "a", 0), (2, "b", 1), (3, "a", 0)]  # "c": nobody has it
    assert _assign(asks, {(0, "a"), (1, "b")}, nodes) == [(2, "a", 1), (2, "b", 0), (3, "a", 1)]
    assert _assign(asks, {(0, "a"), (1, "a"), (0, "b"), (1, "b")}, nodes) == []
    # Rank 0 found its node's copy of "x" damaged: rank 1, beside it, has the same copy.
    damaged = [{"missing": ["x"], "have": {}}, {"missing": [], "have": {"x": 1}},
               {"missing": [], "have": {"x": 1}}, {"missing": [], "have": {"x": 1}}]
    assert _assign(damaged, set(), nodes) == [(0, "x", 2)]


def _entry(files, committed=None, node_safe=False, layout=None):
    return {"files": files, "committed": committed, "node_safe": node_safe, "layout": layout}


def test_the_newest_checkpoint_every_rank_can_load():
    full = ["__0_0.distcp", "__1_0.distcp"]
    node0 = {"daemon": {"s2": _entry(full + [".metadata", ".layout", ".node-safe"], 2.0, True, full),
                        "s4": _entry(["__0_0.distcp", ".metadata", ".layout"], 4.0, False, full)},
             "files": {}}
    lost = {"daemon": {}, "files": {}}   # node 1's daemon is new: s4's __1_0 is gone
    assert choose([node0, lost], node_safe=False) == "s2"
    assert choose([node0, lost], node_safe=True) == "s2"
    node1 = {"daemon": {"s4": _entry(["__1_0.distcp", ".metadata", ".layout"], 4.1, False, full)},
             "files": {}}
    assert choose([node0, node1], node_safe=False) == "s4"
    assert choose([node0, node1], node_safe=True) == "s2"
    # Without a .layout (saved on one node), only a checkpoint every rank sees whole.
    legacy = {"daemon": {"s6": _entry(full + [".metadata"], 6.0)}, "files": {}}
    assert choose([legacy, lost], node_safe=False) is None
    assert choose([legacy, legacy], node_safe=False) == "s6"
    # Fallback files count only when every rank sees them; never as node-safe.
    shared = {"daemon": {}, "files": {"f9": 9.0}}
    assert choose([shared, shared], node_safe=False) == "f9"
    assert choose([shared, lost], node_safe=False) is None
    assert choose([shared, shared], node_safe=True) is None


def _fake_checkpoint(s, ckpt, node_safe):
    for name, blob in (("__0_0.distcp", b"x" * 10), (".node-safe", b"{}") if node_safe else (None, None),
                       (".metadata", b"m")):
        if name is None:
            continue
        w = s.create(store.region_name(ckpt, name), len(blob))
        w.append(blob)
        w.commit()


def test_keep_last_never_deletes_the_newest_node_safe_checkpoint(daemon):
    from memoffload.torch.checkpoint import latest_checkpoint

    job = f"keep-{uuid.uuid4().hex[:8]}"
    s, _ = store.attach(daemon.runtime_dir, job, -1, True)
    try:
        _fake_checkpoint(s, "a", node_safe=True)
        _fake_checkpoint(s, "b", node_safe=False)
        _fake_checkpoint(s, "c", node_safe=False)
        assert store.retain(s, 1, "c") == ["b"]
        assert sorted(store.stored_checkpoints(s)) == ["a", "c"]
        assert latest_checkpoint(job, daemon.runtime_dir, node_safe=True) == "a"
        assert latest_checkpoint(job, daemon.runtime_dir) == "c"
        _fake_checkpoint(s, "d", node_safe=True)
        assert sorted(store.retain(s, 1, "d")) == ["a", "c"]  # a node-safe one newer than "a"
        assert sorted(store.stored_checkpoints(s)) == ["d"]
    finally:
        for info in store.stored_checkpoints(s).values():
            store.delete_checkpoint(s, info)
        store.forget(s)


def test_replicas_on_one_node_say_not_node_safe_once(daemon, tmp_path, caplog):
    import torch.distributed.checkpoint as dcp

    from memoffload.torch.checkpoint import MemoffloadWriter

    job = f"one-{uuid.uuid4().hex[:8]}"
    writer = MemoffloadWriter(job_id=job, runtime_dir=daemon.runtime_dir, replicas=1,
                              fallback_dir=str(tmp_path / "fb"))
    with caplog.at_level(logging.WARNING, logger="memoffload"):
        for i in range(2):
            dcp.save({"w": torch.arange(10.0)}, storage_writer=writer, checkpoint_id=f"s{i}")
            rep = writer.wait_replication()
            assert writer.last_mode == "daemon"
            assert rep is not None and rep.node_safe is False and rep.why == "the job runs on one node"
    said = [r for r in caplog.records if "not node-safe" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    writer.close()
    s, _ = store.attach(daemon.runtime_dir, job, -1, True)
    for info in store.stored_checkpoints(s).values():
        store.delete_checkpoint(s, info)
    with pytest.raises(ValueError, match="replicas must be >= 0"):
        MemoffloadWriter(job_id=job, replicas=-1)
