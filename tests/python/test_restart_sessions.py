"""A restart of the daemon with a state store keeps its sessions
(docs/restarts.md, "Sessions resume"): at SIGTERM the daemon freezes its
table, writes its sessions into the store with its regions, tells each
process so on its broker connection, and exits; the next start places the
sessions back and each process resumes its own. Training goes on across it
bit for bit: calls made while no daemon runs wait for the resume instead of
failing. A daemon drained on purpose ends its sessions at SIGTERM, as
without a store."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from typing import List

import pytest
import torch  # noqa: F401

from memoffload import _C
from memoffload.torch.state import rehome

import keeper_wire as kw
from conftest import Daemon, bin_dir
from restart_writer import SIZE, content
from test_takeover import Training, read_back, wait_for_log, write

ARGS = ["--log-level=info", "--drain-timeout=30s"]


@pytest.fixture
def node(tmp_path):
    """A runtime dir with a keeper in it; the daemons are the test's."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    keeper = kw.start_keeper(str(rt), tmp_path / "keeper.log")
    daemons: List[Daemon] = []
    yield rt, daemons
    for d in daemons:
        d.stop()
    keeper.terminate()
    keeper.wait(timeout=10)


def own_lines(d: Daemon) -> str:
    """The lines of d's process in the log its runtime dir's daemons share."""
    tag = f"memoffloadd[{d.proc.pid}] "
    return "\n".join(line for line in d.log.read_text().splitlines() if line.startswith(tag))


def test_training_goes_on_across_a_restart_and_the_sessions_resume(node, monkeypatch, caplog):
    """Offloaded activations, placed AdamW state, a region being read and
    node checkpoints across two SIGTERM restarts through the keeper: the
    same sessions (ids, memory), every step bit for bit against unoffloaded
    twins, no group skipped, nothing moved out of the arena; steps taken
    while no daemon runs wait for the next one."""
    rt, daemons = node
    monkeypatch.setattr(rehome, "REATTACH_S", 0.0)
    caplog.set_level(logging.INFO, logger="memoffload")
    old = Daemon(rt, "256MiB", "16MiB", ARGS).start()
    daemons.append(old)
    instance = write(rt, "ckpt", ["a", "b"])
    reader = _C.RegionStore(runtime_dir=str(rt), job_id="ckpt", rank=0)
    opened = reader.open("a", verify=True)
    t = Training(rt, "restart")
    serving = old
    for n in range(2):
        # Training goes on in a thread while the daemon restarts; the next
        # one starts half a second after the old one exits (from this
        # thread: a daemon dies with the thread that spawned it). This thread
        # is not held up meanwhile: the waiting call does not keep the GIL.
        stop = threading.Event()
        spans: List[tuple] = []
        failed: List[BaseException] = []

        def train() -> None:
            try:
                while not stop.is_set():
                    t0 = time.monotonic()
                    t.step()
                    spans.append((t0, time.monotonic()))
            except BaseException as e:  # reported below
                failed.append(e)

        trainer = threading.Thread(target=train)
        trainer.start()
        try:
            time.sleep(0.2)
            serving.proc.terminate()
            assert serving.proc.wait(timeout=30) == 0, serving.log.read_text()
            time.sleep(0.5)
            new = Daemon(rt, "256MiB", "16MiB", ARGS).spawn()
            daemons.append(new)
            spawned = time.monotonic()
            wait_for_log(new, f"memoffloadd[{new.proc.pid}] INFO no handed session waits", 30)
            steps = len(spans)
            deadline = time.monotonic() + 30
            while len(spans) < steps + 3 and not failed:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            stop.set()
            trainer.join(timeout=60)
        assert not failed, failed
        # A step waited for the next daemon rather than failing.
        assert any(a < spawned < b for a, b in spans), (spawned, spans)
        old_log = own_lines(serving)
        kept = re.search(r"received SIGTERM: keeping (\d+) sessions", old_log)
        assert kept is not None and "draining" not in old_log, old_log
        count = int(kept.group(1))
        assert count >= 3, old_log  # the offloader's, the placement's, the reader's
        assert f"and {count} sessions for the next start" in old_log, old_log
        new_log = own_lines(new)
        assert f"restart: {count} of {count} sessions handed on" in new_log, new_log
        assert f"no handed session waits any more: {count} resumed, 0 closed unresumed" in \
            new_log, new_log
        assert read_back(rt, "ckpt", ["a", "b"]) == instance
        t.check_kept(f"restart {n}")
        serving = new
    # The region opened before the first restart still reads, through the
    # same session.
    assert opened.read_bytes(0, SIZE - 7) == content("a")
    opened.close()
    reader.close()
    assert any("resumed on the memoffloadd that took the node over or restarted" in
               r.getMessage() for r in caplog.records)
    t.off.remove()


@pytest.mark.parametrize("how", ["memoffloadctl drain", "--keep-sessions=never"])
def test_a_drained_daemon_ends_its_sessions_at_sigterm(node, how):
    """memoffloadctl drain (or lifecycle.keep_sessions = "never"), then
    SIGTERM: the sessions end as without a store (the placed state moves
    out), and the regions are kept."""
    rt, daemons = node
    never = how.startswith("--")
    d = Daemon(rt, "64MiB", "16MiB", [*ARGS, *([how] if never else [])]).start()
    daemons.append(d)
    write(rt, "job", ["kept"])
    store = _C.RegionStore(runtime_dir=str(rt), job_id="job", rank=0)
    if not never:
        ctl = subprocess.run([str(bin_dir() / "memoffloadctl"), f"--runtime-dir={rt}", "drain"],
                             capture_output=True, text=True, timeout=30)
        assert ctl.returncode == 0, ctl.stderr
    d.proc.terminate()
    assert d.proc.wait(timeout=30) == 0, d.log.read_text()
    log = d.log.read_text()
    assert "received SIGTERM: draining" in log and "keeping" not in log, log
    assert "and 0 sessions for the next start" in log, log
    store.close()
    again = Daemon(rt, "64MiB", "16MiB", ARGS).start()
    daemons.append(again)
    assert "sessions handed on" not in again.log.read_text()
    assert read_back(rt, "job", ["kept"])


def test_a_daemon_that_sees_no_pid_of_a_session_drains_at_sigterm(node, tmp_path):
    """A daemon in a pid namespace of its own (a container without the
    host's) sees no pid for the processes outside it: their sessions could
    never be resumed after a restart, so SIGTERM drains and ends them, as
    without a store, and says why; the regions are kept."""
    rt, daemons = node
    log = tmp_path / "ns-daemon.log"
    exe = bin_dir() / "memoffloadd"
    outer = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", str(exe), f"--runtime-dir={rt}",
         "--arena-size=64MiB", "--chunk-size=16MiB", "--metrics-address=none",
         "--prefault-threads=1", *ARGS],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "clients: export" not in log.read_text():
            assert outer.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        write(rt, "job", ["kept"])
        store = _C.RegionStore(runtime_dir=str(rt), job_id="job", rank=0)
        inner = subprocess.run(["pgrep", "-P", str(outer.pid)], capture_output=True, text=True)
        assert inner.returncode == 0, inner
        os.kill(int(inner.stdout.split()[0]), signal.SIGTERM)
        assert outer.wait(timeout=30) == 0, log.read_text()
        text = log.read_text()
        assert "has no known pid" in text and "received SIGTERM: draining" in text, text
        assert "and 0 sessions for the next start" in text, text
        store.close()
    finally:
        if outer.poll() is None:
            outer.kill()
            outer.wait()
    again = Daemon(rt, "64MiB", "16MiB", ARGS).start()
    daemons.append(again)
    assert "sessions handed on" not in again.log.read_text()
    assert read_back(rt, "job", ["kept"])
