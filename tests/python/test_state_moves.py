"""Placed state that follows its daemon (issue 42), against real daemons.

In this process, a plain CPU model with AdamW (a ZeRO-offload style CPU
optimizer, ``place_state(None, opt)``) trains next to an unplaced copy,
compared bit for bit at every step, while its daemon

- is restarted with SIGTERM: the drain asks the state's session to leave,
  the state moves into this process's memory at the next step and the
  daemon exits within a second; once a new daemon is up the state is placed
  again into its arena;
- crashes (SIGKILL) and a new one starts: the next step moves the state
  straight into the new arena (a daemon already up answers the attach well
  within the step's wait, rehome.ATTACH_WAIT_S);
- is drained with ``memoffloadctl drain``: the daemon holds nothing within a
  second, and after ``undrain`` the state is placed again.

Each time the old arena's chunks leave this process's mappings (in
``/proc/self/smaps``, the ``memfd:memoffload-chunk-N (deleted)`` mappings of
the old inodes) within the step that moved the state. And two FSDP2 ranks,
their shards, AdamW states and kept gradients, through a SIGTERM restart
(state_moves_worker.py).
"""

from __future__ import annotations

import array
import json
import logging
import os
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import List

import uuid

import pytest
import torch
import torch.multiprocessing as mp

import memoffload.torch as mot
import state_moves_worker
from state_moves_worker import chunk_inodes
from conftest import Daemon, bin_dir, free_port
from memoffload.torch.state import rehome
from models import DecoderStack, tokens

WORLD_SIZE = 2


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class Pair:
    """A placed model+AdamW and its unplaced twin, stepped together."""

    def __init__(self, runtime_dir: str, job_id: str) -> None:
        torch.manual_seed(0)
        self.model = DecoderStack(layers=1, dim=128, heads=4)
        torch.manual_seed(0)
        self.ref = DecoderStack(layers=1, dim=128, heads=4)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.opt_ref = torch.optim.AdamW(self.ref.parameters(), lr=1e-2)
        self.placement = mot.place_state(None, self.opt, runtime_dir=runtime_dir, job_id=job_id,
                                         min_bytes=4096)
        self.gen = torch.Generator().manual_seed(1)
        self.mismatches: List[str] = []
        self.steps = 0

    def step(self) -> None:
        batch = tokens(batch=2, length=16).random_(0, 97, generator=self.gen)
        losses = []
        for m, o in ((self.model, self.opt), (self.ref, self.opt_ref)):
            o.zero_grad()
            loss = m(batch)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        self.steps += 1
        if not torch.equal(bits(losses[0]), bits(losses[1])):
            self.mismatches.append(f"step {self.steps}: loss")
        for i, (p, q) in enumerate(zip(self.model.parameters(), self.ref.parameters())):
            if not torch.equal(bits(p), bits(q)):
                self.mismatches.append(f"step {self.steps}: parameter {i}")
            for key in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(bits(self.opt.state[p][key]), bits(self.opt_ref.state[q][key])):
                    self.mismatches.append(f"step {self.steps}: {key} {i}")

    def placed(self) -> int:
        """How many AdamW states are in the arena now."""
        return sum(self.placement.holds(st[k]) for st in self.opt.state.values()
                   for k in ("exp_avg", "exp_avg_sq"))

    def states(self) -> int:
        return sum(st["exp_avg"].numel() * 4 >= 4096 for st in self.opt.state.values()) * 2


@pytest.fixture
def restartable(tmp_path, monkeypatch):
    """A daemon the test stops and starts again on the same runtime dir;
    the placement tries a new session at every step."""
    monkeypatch.setattr(rehome, "REATTACH_S", 0.0)
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    daemons = [Daemon(rt, "256MiB", "16MiB", ["--drain-timeout=30s"]).start()]
    yield daemons
    for d in daemons:
        d.stop()


def step_until_moved(pair: Pair) -> None:
    """Steps until the placement moved its state (the daemon's request to
    leave arrives on its own time)."""
    deadline = time.monotonic() + 10
    while pair.placement.stats()["moves"] == 0 and time.monotonic() < deadline:
        pair.step()
        time.sleep(0.01)
    assert pair.placement.stats()["moves"] == 1, pair.placement.stats()


def step_until_placed(pair: Pair) -> None:
    """Steps until the state is in an arena again (the attach thread's
    session is taken by the first step after it is granted)."""
    deadline = time.monotonic() + 10
    while pair.placement.stats()["session_id"] is None and time.monotonic() < deadline:
        pair.step()
        time.sleep(0.01)
    pair.step()  # the optimizer's state is placed by its own step hook


def session_of(d: Daemon, job: str) -> int:
    (s,) = [s for s in d.sessions() if s["job_id"] == job]
    return int(s["session_id"])


def test_a_sigterm_restart_moves_the_state_out_and_back(restartable, caplog):
    caplog.set_level(logging.INFO, logger="memoffload")
    d = restartable[0]
    others = chunk_inodes()  # chunks of other tests' sessions in this process
    pair = Pair(d.runtime_dir, "moves-term")
    for _ in range(2):
        pair.step()
    assert pair.placed() == pair.states() > 0
    old = chunk_inodes() - others
    assert old
    d.proc.terminate()
    # The drain asks the session to leave; the state moves at the next step
    # after the request came, and the daemon exits within a second of it,
    # not after its 30 s drain timeout.
    step_until_moved(pair)
    assert d.proc.wait(timeout=1.0) == 0, d.log.read_text()
    s = pair.placement.stats()
    assert s["session_id"] is None and pair.placed() == 0, s
    assert s["moves"] == 1 and "SIGTERM" in s["last_move"], s
    assert s["left_reasons"][rehome.MOVED_OUT] == pair.states(), s
    pair.step()
    assert not (old & chunk_inodes()), "the old arena is still mapped"
    warned = [r for r in caplog.records if "moved" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, [r.getMessage() for r in warned]
    assert "into this process's memory" in warned[0].getMessage()

    new = Daemon(Path(d.runtime_dir), "256MiB", "16MiB")
    restartable.append(new.start())
    # The new session is asked for on a thread of its own; a later step places.
    step_until_placed(pair)
    s = pair.placement.stats()
    assert pair.placed() == pair.states(), s
    assert s["session_id"] == session_of(new, "moves-term"), s
    assert rehome.MOVED_OUT not in s["left_reasons"], s
    assert new.status()["committed_bytes"] == s["held_bytes"]
    for _ in range(2):
        pair.step()
    assert pair.mismatches == [], pair.mismatches[:10]


def test_a_crashed_daemon_s_state_moves_into_the_new_one_at_the_next_step(restartable, caplog):
    caplog.set_level(logging.INFO, logger="memoffload")
    d = restartable[0]
    others = chunk_inodes()
    pair = Pair(d.runtime_dir, "moves-kill")
    for _ in range(2):
        pair.step()
    old_session = pair.placement.stats()["session_id"]
    old = chunk_inodes() - others
    assert old
    d.kill()
    new = Daemon(Path(d.runtime_dir), "256MiB", "16MiB")
    restartable.append(new.start())
    pair.step()
    s = pair.placement.stats()
    assert pair.placed() == pair.states() > 0, s
    # Session ids count from 1 in each daemon: the new daemon lists this one.
    assert s["session_id"] == session_of(new, "moves-kill"), s
    assert s["moves"] == 1 and f"ended session {old_session}" in s["last_move"], s
    assert not (old & chunk_inodes()), "the old arena is still mapped after the step"
    assert new.status()["committed_bytes"] == s["held_bytes"]
    moved = [r for r in caplog.records if "moved" in r.getMessage()]
    assert [r.levelno for r in moved] == [logging.INFO], [r.getMessage() for r in moved]
    pair.step()
    assert pair.mismatches == [], pair.mismatches[:10]


def ctl(d: Daemon, *args: str) -> None:
    subprocess.run([str(bin_dir() / "memoffloadctl"), "--runtime-dir", d.runtime_dir, *args],
                   check=True, capture_output=True, timeout=30)


def test_a_drained_daemon_gets_its_memory_back_within_a_second(restartable):
    d = restartable[0]
    others = chunk_inodes()
    pair = Pair(d.runtime_dir, "moves-drain")
    for _ in range(2):
        pair.step()
    held = pair.placement.stats()["held_bytes"]
    assert d.status()["used_bytes"] >= held > 0
    old = chunk_inodes() - others
    assert old
    ctl(d, "drain")
    step_until_moved(pair)
    deadline = time.monotonic() + 1.0
    while d.status()["used_bytes"] != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.status()["used_bytes"] == 0, d.status()
    assert pair.placement.stats()["session_id"] is None
    assert "memoffloadctl drain" in pair.placement.stats()["last_move"]
    pair.step()
    assert not (old & chunk_inodes())
    assert d.sessions() == []
    ctl(d, "undrain")
    step_until_placed(pair)
    s = pair.placement.stats()
    assert pair.placed() == pair.states() and s["session_id"] == session_of(d, "moves-drain"), s
    assert d.status()["committed_bytes"] == s["held_bytes"] == held, (d.sessions(), s, pair.placement._left)
    pair.step()
    assert pair.mismatches == [], pair.mismatches[:10]


def progress(out: Path, rank: int) -> List[dict]:
    path = out / f"progress-rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what.__doc__ or what}")


def test_fsdp2_shards_states_and_kept_gradients_follow_a_restart(restartable, tmp_path):
    """Two FSDP2 ranks train while their daemon is restarted with SIGTERM:
    the drain ends within a second, the state moves into process memory and
    back into the new daemon's arena, training stays bit-exact and the old
    arena leaves every rank's mappings."""
    d = restartable[0]
    out = tmp_path / "out"
    out.mkdir()
    job = f"moves-fsdp-{uuid.uuid4().hex[:8]}"
    ctx = mp.spawn(state_moves_worker.run,
                   args=(WORLD_SIZE, free_port(), d.runtime_dir, str(out), job, 2000),
                   nprocs=WORLD_SIZE, join=False)
    try:
        def placed():
            """both ranks placing shards, states and gradients"""
            last = [progress(out, r)[-1:] for r in range(WORLD_SIZE)]
            return all(p and p[0]["step"] >= 3 and p[0]["grads"] > 0 for p in last) and last
        before = [p[0] for p in wait_for(placed)]
        d.proc.terminate()

        def moved():
            """both ranks moved their state out"""
            return all(progress(out, r)[-1]["moves"] == 1 for r in range(WORLD_SIZE))
        wait_for(moved, 10)
        # Within a second of the step that moved it, not its 30 s drain timeout.
        assert d.proc.wait(timeout=1.0) == 0
        new = Daemon(Path(d.runtime_dir), "256MiB", "16MiB")
        restartable.append(new.start())
        sessions = {}

        def back():
            """both ranks placed again in the new daemon, as much as before"""
            sessions.update({int(s["rank"]): int(s["session_id"]) for s in new.sessions()
                             if s["job_id"] == job})
            last = [progress(out, r)[-1] for r in range(WORLD_SIZE)]
            # What the daemon holds is what the two placements hold.
            return all(p["session_id"] == sessions.get(r) and p["tensors"] == b["tensors"]
                       and p["grads"] == b["grads"] for r, (p, b) in enumerate(zip(last, before))
                       ) and new.status()["committed_bytes"] == sum(p["held_bytes"] for p in last)
        wait_for(back)
        (out / "stop").touch()
        ctx.join(timeout=120)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    for r in range(WORLD_SIZE):
        res = json.loads((out / f"result-rank{r}.json").read_text())
        assert res["mismatches"] == [], res["mismatches"][:10]
        steps = progress(out, r)
        b = before[r]
        assert b["shards"] > 0 and b["states"] > 0 and b["grads"] > 0, b
        out_of_arena = [p for p in steps if p["session_id"] is None]
        assert out_of_arena and out_of_arena[0]["moves"] == 1, steps[-3:]
        # The step that moved the state out unmapped the old arena.
        assert out_of_arena[0]["first_chunks_mapped"] == 0, out_of_arena[0]
        assert b["first_chunks_mapped"] > 0
        last = steps[-1]
        assert (last["shards"], last["states"], last["grads"]) == (b["shards"], b["states"],
                                                                   b["grads"]), (b, last)


def test_a_request_that_crosses_the_leave_notice_is_served(restartable):
    """A raw client of the attach protocol (a state session) sends a request
    with the daemon's leave notice still unread in its socket, as a client
    does when the notice comes right after it looked. The daemon must serve
    it, not close the connection as a slow reader's: the kernel counts an
    unread frame as a few hundred bytes of socket buffer, not its payload
    (the daemon compared against the payload and closed it)."""
    d = restartable[0]

    def frame(payload: bytes) -> bytes:
        return struct.pack("<I", len(payload)) + payload

    def header(kind: int) -> bytes:
        return struct.pack("<IHB", 0x4C464F4D, 3, kind)

    job = b"crossing"
    hello = header(1) + struct.pack("<I", len(job)) + job + struct.pack("<iiQQB", 0, 0, 0, 0, 2)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(Path(d.runtime_dir) / "broker.sock"))
        s.sendall(frame(hello))
        time.sleep(0.3)
        _, ancillary, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(4 * 240))  # reply and fds
        for _, _, fds in ancillary:
            for fd in array.array("i", fds[:len(fds) - len(fds) % 4]):
                os.close(fd)
        ctl(d, "drain")
        time.sleep(0.3)  # the notice is in the socket, unread
        s.sendall(frame(header(6)))  # a LinkKeyRequest
        time.sleep(0.3)
        s.settimeout(1)
        got = b""
        closed = False
        try:
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    closed = True
                    break
                got += chunk
        except socket.timeout:
            pass
    assert not closed, d.log.read_text()
    # The notice (type 8), then the key reply (type 7: this daemon serves none).
    notice_len = struct.unpack_from("<I", got)[0]
    assert got[4 + 6] == 8 and got[4 + notice_len + 4 + 6] == 7, got
    assert "before reading its last reply" not in d.log.read_text()
