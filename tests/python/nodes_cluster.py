"""Jobs on several simulated "nodes" for the tests of checkpoints between
nodes (test_node_safe.py, test_link_security.py).

Each node is a memoffloadd with its own runtime dir; its ranks (FSDP2 on
gloo over lo, node_worker.py) use that daemon and reach the other nodes'
ranks from a loopback address of their own (127.0.0.2 for node 0,
127.0.0.3 for node 1, ...). By default every daemon has the same
replication key file (secure mode, as an operator sets it up); with
``secure=False`` none has one, and the ranks use a key from the job's store.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from conftest import Daemon, free_port

WORKER = Path(__file__).resolve().parent / "node_worker.py"
WORLD = 4
NODE_OF = [0, 0, 1, 1]



class Cluster:
    """Two nodes' daemons, and the jobs run on them."""

    def __init__(self, base: Path, node_of: List[int] = NODE_OF, secure: bool = True,
                 daemon_args: Dict[int, List[str]] = {}, worker: Path = WORKER) -> None:
        self.base = base
        self.worker = worker
        self.node_of = node_of
        self.world = len(node_of)
        self.out = base / "out"
        self.out.mkdir()
        self.job_id = f"nodes-{uuid.uuid4().hex[:8]}"
        self.key_file = base / "replication-key"
        extra = []
        if secure:  # one cluster secret, every node's daemon reads it
            self.key_file.write_text(f"k1 {secrets.token_hex(32)}\n")
            self.key_file.chmod(0o400)
            extra = [f"--replication-key-file={self.key_file}"]
        self.daemons: List[Daemon] = []
        for node in sorted(set(node_of)):
            rt = base / f"node{node}"
            rt.mkdir(mode=0o700)
            args = daemon_args.get(node, extra)  # a node's own, else the cluster's
            self.daemons.append(Daemon(rt, "256MiB", "16MiB", args).start())
        self.procs: List[subprocess.Popen] = []

    def start(self, phase: str, env_of: Dict[int, Dict[str, str]] = {}, **extra: Any) -> None:
        port = self.port = free_port()
        self.phase = phase
        self.procs = []
        for rank in range(self.world):
            node = self.node_of[rank]
            cfg = {"phase": phase, "world": self.world, "out": str(self.out), "job_id": self.job_id,
                   "runtime_dir": self.daemons[node].runtime_dir,
                   "fallback_dir": str(self.base / f"fallback{node}"), **extra}
            path = self.out / f"{phase}-cfg{rank}.json"
            path.write_text(json.dumps(cfg))
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.world),
                       LOCAL_RANK=str(self.node_of[:rank].count(node)),
                       LOCAL_WORLD_SIZE=str(self.node_of.count(node)),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                       MEMOFFLOAD_REPLICATION_ADDRESS=f"127.0.0.{2 + node}",
                       MEMOFFLOAD_REPLICATION_TIMEOUT_S=str(extra.get("timeout_s", 60)))
            env.pop("MEMOFFLOAD_JOB_ID", None)
            env.update(env_of.get(rank, {}))
            err = open(self.out / f"{phase}-rank{rank}.stderr", "wb")
            self.procs.append(subprocess.Popen([sys.executable, str(self.worker), str(path), str(rank)],
                                               env=env, stdout=subprocess.DEVNULL, stderr=err))

    def err(self, rank: int) -> str:
        return (self.out / f"{self.phase}-rank{rank}.stderr").read_text()[-4000:]

    def wait(self, ranks=None, timeout: float = 180) -> None:
        for rank in range(self.world) if ranks is None else ranks:
            try:
                self.procs[rank].wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"rank {rank} of {self.phase} did not finish: {self.err(rank)}")
            assert self.procs[rank].returncode == 0, \
                f"rank {rank} exited {self.procs[rank].returncode}: {self.err(rank)}"

    def wait_for(self, name: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        for rank in range(self.world):
            path = self.out / f"{name}-rank{rank}"
            while not path.exists():
                if self.procs[rank].poll() is not None:
                    pytest.fail(f"rank {rank} exited {self.procs[rank].returncode}: {self.err(rank)}")
                if time.monotonic() > deadline:
                    self.kill()
                    pytest.fail(f"{path} did not appear: {self.err(rank)}")
                time.sleep(0.05)

    def kill(self, ranks=None) -> None:
        for rank in range(self.world) if ranks is None else ranks:
            p = self.procs[rank]
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()

    def lose_node(self, node: int) -> None:
        """SIGKILLs the node's ranks and its daemon, then starts a fresh,
        empty daemon in its runtime dir."""
        self.kill([r for r in range(self.world) if self.node_of[r] == node])
        self.daemons[node].kill()
        self.daemons[node].start()

    def result(self, rank: int, phase: str = "") -> Dict[str, Any]:
        return json.loads((self.out / f"{phase or self.phase}-rank{rank}.json").read_text())

    def state(self, phase: str, tag: str, rank: int) -> Dict[str, torch.Tensor]:
        return torch.load(self.out / f"{phase}-{tag}-rank{rank}.pt", weights_only=False)

    def regions(self, node: int) -> List[str]:
        from memoffload.torch.checkpoint import store

        s, _ = store.attach(self.daemons[node].runtime_dir, self.job_id, -1, True)
        names = [r["name"] for r in s.list("dcp/")]
        store.forget(s)
        return names

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for d in self.daemons:
            d.stop()
