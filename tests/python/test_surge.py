"""A DaemonSet's surge update (`maxSurge: 1`; docs/restarts.md, "Take-over
across pods") with processes in place of pods: each pod is a keeper on a
socket of its own (`lifecycle.keeper_socket`) and a daemon with
`take_over = auto` and `after_handover = wait`, both pods on one runtime
dir, each pod's health port on an address of its own (a pod IP). The new
pod takes the node over with every session and region; the old pod waits,
unready, until it is deleted, and a restart of its container does not take
the node back; the new pod's keeper holds the node, so a crash of the new
daemon before the old pod goes, or after, keeps every region."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch  # noqa: F401

import keeper_wire as kw
from conftest import Daemon, bin_dir, free_port
from memoffload.torch.state import rehome
from test_takeover import Training, read_back, wait_for_log, write

POD_ARGS = ["--log-level=info", "--state-store=keeper", "--take-over=auto",
            "--after-handover=wait", "--drain-timeout=30s"]


class Pod:
    """A keeper and a daemon sharing the runtime dir `rt` with other pods."""

    def __init__(self, rt: Path, name: str, address: str, health_port: int) -> None:
        self.sock = rt / f"keeper-{name}.sock"
        self.keeper_log = rt.parent / f"keeper-{name}.log"
        self.keeper = kw.start_keeper(str(rt), self.keeper_log, sock=self.sock)
        self.health = f"{address}:{health_port}"
        self.daemon = Daemon(rt, "256MiB", "16MiB",
                             [*POD_ARGS, f"--keeper-socket={self.sock}",
                              f"--health-address={self.health}"])

    def probe(self, path: str) -> tuple:
        try:
            with urllib.request.urlopen(f"http://{self.health}{path}", timeout=5) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def delete(self) -> None:
        """What the kubelet does to a pod it deletes: SIGTERM to both."""
        for proc in (self.daemon.proc, self.keeper):
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in (self.daemon.proc, self.keeper):
            if proc is not None:
                try:
                    proc.wait(timeout=20)
                except Exception:
                    proc.kill()
                    proc.wait()
                    raise


@pytest.fixture
def pods(tmp_path):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    made = []

    def make(name: str, address: str, port: int) -> Pod:
        pod = Pod(rt, name, address, port)
        made.append(pod)
        return pod

    yield rt, make
    for pod in made:
        for proc in (pod.daemon.proc, pod.keeper):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def own_lines(d: Daemon) -> str:
    return "\n".join(line for line in d.log.read_text().splitlines()
                     if f"memoffloadd[{d.proc.pid}]" in line)


def test_a_surge_pod_takes_the_node_and_the_old_pod_waits_to_be_deleted(pods, monkeypatch,
                                                                        caplog):
    monkeypatch.setattr(rehome, "REATTACH_S", 0.0)
    caplog.set_level(logging.INFO, logger="memoffload")
    rt, make = pods
    port = free_port()
    old = make("old", "127.0.0.2", port)
    old.daemon.start()
    assert "lifecycle.take_over = auto: no daemon serves" in own_lines(old.daemon)
    instance = write(rt, "ckpt", ["a", "b"])
    t = Training(rt, "surge")

    # The surge pod: the same health port on its own address, as a pod IP.
    new = make("new", "127.0.0.3", port)
    new.daemon.spawn()
    deadline = time.monotonic() + 30
    while f"the node is pid {new.daemon.proc.pid}'s now" not in old.daemon.log.read_text():
        assert time.monotonic() < deadline, old.daemon.log.read_text()[-3000:]
        assert new.daemon.proc.poll() is None, new.daemon.log.read_text()[-3000:]
        t.step()
    wait_for_log(new.daemon, f"memoffloadd[{new.daemon.proc.pid}] INFO took over the node: "
                             "2 checkpoint regions")
    took = own_lines(new.daemon)
    # Said as a take-over, not as a restart from the new pod's (empty) keeper.
    assert "take-over: 2 of 2 sessions handed on" in took, took
    assert "recovered the node from the serving daemon: 2 of 2 checkpoint regions" in took, took
    for _ in range(3):
        t.step()
    t.check_kept("surge take-over")
    assert read_back(rt, "ckpt", ["a", "b"]) == instance
    assert any("resumed on the memoffloadd that took the node over" in r.getMessage()
               for r in caplog.records)

    # The old pod stays, alive and unready, holding nothing of the node: a
    # container that exited would be started again by the kubelet.
    wait_for_log(old.daemon, "handed over: waiting for a signal to exit")
    assert old.daemon.proc.poll() is None
    assert old.probe("/livez") == (200, "ok\n")
    status, body = old.probe("/readyz")
    assert status == 503 and "handed the node over to a new daemon" in body, body
    assert new.probe("/readyz")[0] == 200
    # The new pod's keeper holds every chunk (the very memory the old pod's
    # keeper holds), the journal and a snapshot.
    held, old_held = kw.take(str(rt), new.sock), kw.take(str(rt), old.sock)
    try:
        chunks = sorted(n for n in held if n.startswith("mo-chunk-"))
        assert len(chunks) == 16, sorted(held)
        assert any(n.startswith("mo-journal") for n in held), sorted(held)
        assert any(n.startswith("mo-snapshot") for n in held), sorted(held)
        # Every one as it was: the sessions' chunks, and those never handed
        # to a process (no second copy of the arena).
        renewed = [n for n in chunks
                   if os.fstat(held[n]).st_ino != os.fstat(old_held[n]).st_ino]
        assert renewed == [], renewed
    finally:
        for fd in [*held.values(), *old_held.values()]:
            os.close(fd)

    # The old pod's daemon container dies and the kubelet starts it again
    # while the new one serves: it finds the hand-over mark in its keeper and
    # stands by, unready; it neither takes the node back nor serves.
    old.daemon.kill()
    old.daemon.spawn()
    wait_for_log(old.daemon, f"memoffloadd[{old.daemon.proc.pid}] INFO standing by: waiting")
    standby = own_lines(old.daemon)
    assert "holds the mark of a hand-over" in standby, standby
    assert "taking over" not in standby and "arena" not in standby, standby
    assert old.probe("/livez")[0] == 200 and old.probe("/readyz")[0] == 503
    t.step()
    t.check_kept("the old pod's daemon started again")
    assert "take-over requested" not in own_lines(new.daemon)

    t.off.remove()
    t.pair.placement.remove()
    # The new daemon crashes before the old pod is deleted: its next start
    # finds no daemon serving (the waiting one let go of the instance lock)
    # and takes the node back from its own pod's keeper.
    new.daemon.kill()
    restarted = Daemon(rt, "256MiB", "16MiB", new.daemon.extra_args).start()
    new.daemon = restarted
    lines = own_lines(restarted)
    assert "lifecycle.take_over = auto: no daemon serves" in lines, lines
    assert f"recovered the node from the keeper at {new.sock}: 2 of 2 checkpoint regions" in \
        lines, lines
    assert read_back(rt, "ckpt", ["a", "b"]) == instance

    # The rollout deletes the old pod: its daemon exits 0 at once, without a
    # drain, and its keeper leaves no file behind; the node is untouched.
    old.delete()
    assert old.daemon.proc.returncode == 0
    old_lines = own_lines(old.daemon)
    assert "after the hand-over" in old_lines and "draining" not in old_lines, old_lines
    assert "exiting; the node was not touched" in old_lines, old_lines
    assert not old.sock.exists() and not Path(f"{old.sock}.lock").exists()
    assert new.sock.exists()
    assert read_back(rt, "ckpt", ["a", "b"]) == instance


def test_a_surge_pod_takes_the_node_from_a_keeper_whose_daemon_died(pods):
    """The old pod's daemon dies just as the update starts: no daemon holds
    the runtime dir, and the new pod's empty keeper has nothing to start
    from. The new daemon takes the node from the old pod's keeper (it holds
    the regions) and marks it, so that the old daemon, started again, stands
    by; a third pod later takes it from the second's keeper, never from the
    marked first one."""
    rt, make = pods
    port = free_port()
    first = make("first", "127.0.0.2", port)
    first.daemon.start()
    instance = write(rt, "ckpt", ["a", "b"])
    first.daemon.kill()
    second = make("second", "127.0.0.3", port)
    second.daemon.start()
    lines = own_lines(second.daemon)
    assert f"recovered the node from the keeper at {first.sock} (another pod's: its daemon " \
        "does not run): 2 of 2 checkpoint regions" in lines, lines
    assert read_back(rt, "ckpt", ["a", "b"]) == instance
    # Its record was believed (it was that keeper's daemon's), then disowned:
    # what this pod hands out is in its own keeper's record only.
    assert "mo-handed-chunks not used" not in lines, lines
    assert record_generation(first.sock) == 0
    write(rt, "ckpt", ["c"])
    first.daemon.spawn()  # the kubelet starts the old container again
    wait_for_log(first.daemon, f"memoffloadd[{first.daemon.proc.pid}] INFO standing by")
    assert read_back(rt, "ckpt", ["a", "b", "c"]) == instance

    second.daemon.kill()
    third = make("third", "127.0.0.4", port)
    third.daemon.start()
    lines = own_lines(third.daemon)
    assert f"recovered the node from the keeper at {second.sock} (another pod's: its daemon " \
        "does not run): 3 of 3 checkpoint regions" in lines, lines
    assert str(first.sock) not in lines, lines
    assert read_back(rt, "ckpt", ["a", "b", "c"]) == instance
    first.delete()
    second.delete()
    assert read_back(rt, "ckpt", ["a", "b", "c"]) == instance


def test_daemons_that_share_a_keeper_clear_the_hand_over_mark(tmp_path):
    """after_handover = wait beside one keeper for both daemons: the old one
    marks the store as handed over, the new one (whose store it is too)
    clears the mark, so its own restart serves again rather than standing by."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    keeper = kw.start_keeper(str(rt), tmp_path / "keeper.log")
    args = POD_ARGS
    old = Daemon(rt, "64MiB", "16MiB", args).start()
    new = restarted = None
    try:
        write(rt, "ckpt", ["a"])
        new = Daemon(rt, "64MiB", "16MiB", args).spawn()
        wait_for_log(old, "handed over: waiting for a signal to exit", 30)
        wait_for_log(new, f"memoffloadd[{new.proc.pid}] INFO took over the node")
        new.kill()
        restarted = Daemon(rt, "64MiB", "16MiB", args).start()
        lines = own_lines(restarted)
        assert "holds the mark" not in lines and "recovered the node" in lines, lines
        read_back(rt, "ckpt", ["a"])
    finally:
        for d in (old, new, restarted):
            if d is not None:
                d.stop()
        keeper.terminate()
        keeper.wait(timeout=10)


def test_a_keeper_killed_in_its_pod_starts_again_on_its_socket(tmp_path):
    """A keeper SIGKILLed (its memory limit) leaves its socket; the sidecar
    started again takes the name back (the lock says no keeper lives)."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    sock = rt / "keeper-a.sock"
    log = tmp_path / "keeper.log"
    keeper = kw.start_keeper(str(rt), log, sock=sock)
    keeper.kill()
    keeper.wait()
    assert sock.exists()
    keeper = kw.start_keeper(str(rt), log, sock=sock)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert keeper.poll() is None, log.read_text()
            try:
                assert kw.take(str(rt), sock) == {}
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
    finally:
        keeper.terminate()
        keeper.wait(timeout=10)
    assert not sock.exists() and not Path(f"{sock}.lock").exists()


def test_a_keeper_refuses_a_dir_others_can_write_even_sticky(tmp_path):
    """In a sticky dir another uid could still take the socket's or the
    lock's name first: the keeper does not start there."""
    shared = Path(tempfile.mkdtemp(prefix="mo-sticky-"))
    try:
        os.chmod(shared, 0o1777)
        out = subprocess.run([str(bin_dir() / "memoffloadd"), "keeper",
                              f"--keeper-socket={shared}/keeper-a.sock"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 1, out
        assert "writable by its group or others" in out.stderr, out.stderr
        assert list(shared.iterdir()) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_marked_keeper_is_taken_from_when_no_other_holds_the_node(pods):
    """A pod marks the keeper it takes the node from at once, then dies
    before keeping the node itself: the next pod finds only the marked
    keeper with a node, and takes it from there rather than start empty."""
    rt, make = pods
    port = free_port()
    first = make("first", "127.0.0.2", port)
    first.daemon.start()
    instance = write(rt, "ckpt", ["a"])
    first.daemon.kill()
    mark = kw.sealed_memfd(b"taken by pid 1")
    try:
        kw.put(str(rt), "mo-handed-over", mark, sock=first.sock)
    finally:
        os.close(mark)
    second = make("second", "127.0.0.3", port)
    second.daemon.start()
    lines = own_lines(second.daemon)
    assert f"recovered the node from the keeper at {first.sock} (another pod's" in lines, lines
    assert read_back(rt, "ckpt", ["a"]) == instance
    # What the pod that marked it handed out is in no record here: every
    # chunk with no region counts as handed out.
    assert "mo-handed-chunks not used (the store holds the hand-over mark" in lines, lines


def record_generation(sock: Path) -> int:
    """The generation in a keeper's record of the chunks handed out."""
    held = kw.take(str(sock.parent), sock)
    try:
        return int.from_bytes(os.pread(held["mo-handed-chunks"], 8, 16), "little")
    finally:
        for fd in held.values():
            os.close(fd)


def test_a_take_over_disowns_the_old_pods_record_of_handed_chunks(pods):
    """The chunks go to the new pod's daemon, which hands them on and
    records that in its own keeper only: the old keeper's record is never
    believed again (generation 0), whatever later starts from that keeper."""
    rt, make = pods
    port = free_port()
    old = make("old", "127.0.0.2", port)
    old.daemon.start()
    write(rt, "ckpt", ["a"])
    assert record_generation(old.sock) != 0
    new = make("new", "127.0.0.3", port)
    new.daemon.spawn()
    wait_for_log(new.daemon, f"memoffloadd[{new.daemon.proc.pid}] INFO took over the node")
    assert record_generation(old.sock) == 0
    # The new daemon's is believed once the node is its own.
    wait_for_log(new.daemon, f"memoffloadd[{new.daemon.proc.pid}] INFO listening")
    assert record_generation(new.sock) != 0


def test_keepers_of_other_runtime_dirs_are_never_taken_from(tmp_path):
    """Keeper sockets in one dir for daemons of two runtime dirs: a start
    of the second never takes the first's node, which its daemon serves."""
    keepers = tmp_path / "keepers"
    keepers.mkdir(mode=0o700)
    rts = [tmp_path / "rt1", tmp_path / "rt2"]
    procs, daemons = [], []
    try:
        for i, rt in enumerate(rts):
            rt.mkdir(mode=0o700)
            sock = keepers / f"keeper-{i}.sock"
            procs.append(kw.start_keeper(str(keepers), tmp_path / f"keeper-{i}.log", sock=sock))
            daemons.append(Daemon(rt, "64MiB", "16MiB", [*POD_ARGS, f"--keeper-socket={sock}"]))
        daemons[0].start()
        instance = write(rts[0], "ckpt", ["a"])
        daemons[1].start()
        lines = own_lines(daemons[1])
        assert "nothing kept, starting empty" in lines and "another pod's" not in lines, lines
        assert "mo-handed-over" not in kw.take_names(str(keepers), keepers / "keeper-0.sock")
        assert read_back(rts[0], "ckpt", ["a"]) == instance
    finally:
        for d in daemons:
            d.stop()
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def test_a_keeper_never_replaces_a_live_socket(tmp_path):
    """A listener at the keeper's path that does not hold its lock (a keeper
    of an earlier version locked another name) is left alone."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(rt / "keeper.sock"))
    live.listen(1)
    try:
        inode = os.stat(rt / "keeper.sock").st_ino
        out = subprocess.run([str(bin_dir() / "memoffloadd"), "keeper", f"--runtime-dir={rt}"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 1 and "a keeper already listens at" in out.stderr, out
        assert os.stat(rt / "keeper.sock").st_ino == inode
    finally:
        live.close()


def test_a_take_over_makes_an_old_open_lock_private(tmp_path):
    """An instance lock of an earlier version (0644, which any uid could
    open and hold) is replaced by a 0600 one when the node passes by a
    take-over too."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    old = Daemon(rt, "64MiB", "16MiB", ["--log-level=info"]).start()
    new = None
    try:
        lock = rt / "memoffloadd.lock"
        os.chmod(lock, 0o644)
        before = os.stat(lock).st_ino
        new = Daemon(rt, "64MiB", "16MiB", ["--log-level=info", "--take-over"]).spawn()
        wait_for_log(new, f"memoffloadd[{new.proc.pid}] INFO took over the node", 30)
        assert old.proc.wait(timeout=20) == 0
        st = os.stat(lock)
        assert st.st_mode & 0o7777 == 0o600 and st.st_ino != before
        assert "replaced by one of mode 0600" in own_lines(new)
        new.status()
    finally:
        for d in (old, new):
            if d is not None:
                d.stop()
