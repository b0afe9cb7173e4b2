"""`memoffloadd --take-over` against a real serving daemon (docs/restarts.md,
"Take-over"): the serving daemon drains, hands on its arena, its checkpoint
regions, its instance id and its listening sockets, and exits; training
goes on across it bit for bit. Only a process of the daemon's uid may ask,
a state the new daemon cannot read is refused (the old one serves on), and
a new daemon never takes a forged state."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch  # noqa: F401

import memoffload.torch as mot
from memoffload import _C
from memoffload.torch.state import rehome

import keeper_wire as kw
from conftest import Daemon, bin_dir, clone_model, free_port, step_both
from models import DecoderStack, tokens
from restart_writer import SIZE, content
from test_state_moves import Pair

NOBODY = 65534


def write(rt: Path, job: str, names) -> int:
    store = _C.RegionStore(runtime_dir=str(rt), job_id=job, rank=0)
    try:
        for name in names:
            w = store.create(name, SIZE)
            w.append(content(name))
            w.commit()
        return store.instance_id
    finally:
        store.close()


def read_back(rt: Path, job: str, names) -> int:
    store = _C.RegionStore(runtime_dir=str(rt), job_id=job, rank=0)
    try:
        assert sorted(r["name"] for r in store.list("")) == sorted(names)
        for name in names:
            r = store.open(name, verify=True)
            assert r.read_bytes(0, SIZE - 7) == content(name), name
            r.close()
        return store.instance_id
    finally:
        store.close()


class Training:
    """Layers that offload their activations, stepped beside an unoffloaded
    twin, and a placed AdamW pair (test_state_moves.Pair): what handing the
    node on must leave running bit for bit. Two steps taken."""

    def __init__(self, rt: Path, job: str) -> None:
        self.pair = Pair(str(rt), job)
        torch.manual_seed(0)
        self.model = DecoderStack(layers=3)
        self.ref = clone_model(self.model)
        self.off = mot.offload_layers(self.model.layers, min_tensor_bytes=0, runtime_dir=str(rt))
        for _ in range(2):
            self.step()
        self.off.flush()
        assert self.pair.placed() == self.pair.states() > 0
        self.before = self.off.stats()
        self.state_session = self.pair.placement.stats()["session_id"]

    def step(self) -> None:
        step_both(self.model, self.ref, tokens())
        self.pair.step()

    def check_kept(self, what: str) -> None:
        """Since the last check: the same sessions, nothing moved out or
        skipped, offload went on, every step bit for bit."""
        self.off.flush()
        placement = self.pair.placement.stats()
        assert placement["session_id"] == self.state_session, (what, placement)
        assert placement["moves"] == 0, (what, placement)
        assert self.pair.placed() == self.pair.states()
        s = self.off.stats()
        assert s["skipped_bytes"] == self.before["skipped_bytes"], (what, str(s))
        assert s["reconnects"] == self.before["reconnects"] and s["connected"], (what, s)
        assert s["offloaded_bytes"] > self.before["offloaded_bytes"], what
        self.before = s
        assert self.pair.mismatches == [], self.pair.mismatches[:10]


def wait_for_log(d: Daemon, text: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in d.log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in: {d.log.read_text()}"
        time.sleep(0.02)


def wait_undrained(d: Daemon) -> None:
    """A take-over that did not happen undoes its drain just after it says so."""
    deadline = time.monotonic() + 10
    while d.status()["draining"]:
        assert time.monotonic() < deadline, d.log.read_text()[-2000:]
        time.sleep(0.01)


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


@pytest.fixture
def rt(tmp_path):
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def daemons():
    """Every daemon a test spawns, stopped at its end whatever happened."""
    started = []
    yield started
    for d in started:
        d.stop()


def test_training_goes_on_across_a_take_over_and_the_node_is_kept(rt, monkeypatch, caplog,
                                                                   daemons):
    """Offloaded activations, placed AdamW state and node checkpoints across
    two take-overs: the sessions resume on the new daemon (same ids, same
    memory), every step bit for bit against unoffloaded twins, no group
    skipped and nothing moved out of the arena."""
    monkeypatch.setattr(rehome, "REATTACH_S", 0.0)
    caplog.set_level(logging.INFO, logger="memoffload")
    port = free_port()
    args = ["--log-level=info", f"--metrics-address=127.0.0.1:{port}", "--drain-timeout=30s"]
    old = Daemon(rt, "256MiB", "16MiB", args).start()
    daemons.append(old)
    instance = write(rt, "ckpt", ["a", "b"])
    t = Training(rt, "takeover")
    assert "memoffload_uptime_seconds" in metrics(port)

    serving = old
    for n in range(2):
        new = Daemon(rt, "256MiB", "16MiB", [*args, "--take-over"]).spawn()
        daemons.append(new)
        # Training goes on meanwhile: calls the old daemon answers with the
        # take-over's pause are sent again, to the new one once the sessions
        # resumed there.
        deadline = time.monotonic() + 30
        while serving.proc.poll() is None:
            assert time.monotonic() < deadline, serving.log.read_text()
            t.step()
        assert serving.proc.returncode == 0, serving.log.read_text()
        log = serving.log.read_text()
        assert f"take-over: the node is pid {new.proc.pid}'s now" in log, log
        assert "handed over: exiting, leaving the runtime dir to the new daemon" in log, log
        assert "pausing the sessions" in log and "draining" not in log, log
        for _ in range(3):
            t.step()
        new_log = new.log.read_text()
        assert f"memoffloadd[{new.proc.pid}] INFO took over the node: 2 checkpoint regions" in \
            new_log
        assert "sessions to resume" in new_log, new_log
        resumed = [line for line in new_log.splitlines()
                   if f"memoffloadd[{new.proc.pid}]" in line and " resumed after " in line]
        assert len(resumed) == 2, new_log  # the offloader's session and the placement's
        # The same node, the same sessions, the same memory.
        assert read_back(rt, "ckpt", ["a", "b"]) == instance
        t.check_kept(f"take-over {n}")
        if n == 0:
            # Its metrics on the same port, and the sockets, lock and token.
            assert "memoffload_state_recovered_regions" in metrics(port)
            for name in ("broker.sock", "memoffload.sock", "memoffloadd.lock", "admin.token",
                         "takeover.sock"):
                assert (rt / name).exists(), name
        serving = new
    assert any("resumed on the memoffloadd that took the node over" in r.getMessage()
               for r in caplog.records)
    t.off.remove()
    pair = t.pair
    # A plain SIGTERM at the end: the placed state moves out at the next
    # step and the daemon exits without waiting out its drain.
    new.proc.terminate()
    deadline = time.monotonic() + 20
    while pair.placement.stats()["moves"] == 0:
        assert time.monotonic() < deadline, new.log.read_text()[-3000:]
        pair.step()
        time.sleep(0.01)
    assert new.proc.wait(timeout=20) == 0, new.log.read_text()[-3000:]
    assert pair.mismatches == [], pair.mismatches[:10]
    assert not (rt / "broker.sock").exists()  # the last one cleans up after itself


def test_a_handed_session_resumes_only_from_its_own_process(rt):
    """A session a take-over handed on waits for its process: another
    process of the uid that learned its token is refused (the table's tests
    cover another uid and the token alone over gRPC); its own process
    resumes it, once."""
    old = Daemon(rt, "64MiB", "16MiB", ["--log-level=info"]).start()
    holder = subprocess.Popen([str(bin_dir() / "resume_probe"), "hold", str(rt)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        head = holder.stdout.readline().split()
        assert head[0] == "SESSION", head
        sid, token = head[1], head[2]
        new = Daemon(rt, "64MiB", "16MiB", ["--log-level=info", "--take-over"]).spawn()
        assert old.proc.wait(timeout=30) == 0, old.log.read_text()
        wait_for_log(new, "sessions to resume")

        def resume(*extra: str) -> str:
            out = subprocess.run([str(bin_dir() / "resume_probe"), "resume", str(rt), sid, token,
                                  *extra], capture_output=True, text=True, timeout=30)
            return out.stdout.strip()

        thief = resume()
        assert thief.startswith(f"ANSWER PERMISSION_DENIED session {sid} may be resumed only by "
                                "the process that attached it"), thief
        assert str(holder.pid) not in thief  # nothing of whose it is
        holder.stdin.write("resume\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "ANSWER OK", new.log.read_text()
        assert f"session {sid} resumed after " in new.log.read_text()
        # Once: it is attached now.
        holder.stdin.write("resume\n")
        holder.stdin.flush()
        assert holder.stdout.readline().startswith("ANSWER NOT_FOUND")
        assert resume().startswith("ANSWER NOT_FOUND")
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 10
        while new.status()["sessions"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        for d in (old, new):
            if d.proc.poll() is None:
                d.stop()


def test_only_the_daemon_s_uid_may_ask(tmp_path):
    # A runtime dir every uid can reach, and the take-over socket opened to
    # everyone: the serving daemon still checks the peer's uid.
    rt = Path(tempfile.mkdtemp(prefix="mo-takeover-"))
    try:
        os.chmod(rt, 0o755)
        d = Daemon(rt, "64MiB", "16MiB", ["--log-level=info"]).start()
        try:
            os.chmod(rt / "takeover.sock", 0o666)
            assert kw.probe_as(NOBODY, rt / "takeover.sock", b'takeover 9') in ("b''", "closed")
            log = d.log.read_text()
            assert f"take-over: refused a request from uid {NOBODY}" in log, log
            assert "draining" not in log
            write(rt, "job", ["still-served"])
            # A new daemon of another uid is refused the same way.
            other = subprocess.run(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 str(bin_dir() / "memoffloadd"), f"--runtime-dir={rt}", "--take-over",
                 "--arena-size=64MiB", "--chunk-size=16MiB", "--metrics-address=none"],
                capture_output=True, text=True, timeout=60)
            assert other.returncode != 0
            assert "must be a socket of this user" in other.stderr, other.stderr
        finally:
            d.stop()
    finally:
        shutil.rmtree(rt, ignore_errors=True)


def _ask(rt: Path, version: int = 1):
    """Asks the serving daemon for the node as a new daemon would; returns
    the socket after its state (frames and fds read)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(rt / "takeover.sock"))
    kw.send(s, f"takeover {version}".encode())
    head, fds = kw.recv(s)
    assert head is not None and head.startswith(b"state "), head
    frames = [(head, fds)]
    while True:
        payload, fds = kw.recv(s)
        frames.append((payload, fds))
        if payload == b"end":
            return s, frames


def test_a_refused_or_abandoned_take_over_leaves_the_old_daemon_serving(rt):
    d = Daemon(rt, "64MiB", "16MiB", ["--log-level=info", "--drain-timeout=20s"]).start()
    holder = None
    try:
        write(rt, "job", ["kept"])
        # A requester that hangs up during the drain (a rank holds groups, so
        # the drain waits): the old daemon undrains and closes no session.
        holder = subprocess.Popen([str(bin_dir() / "offload_worker"), "hold", str(rt), "2",
                                   str(1 << 20)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().startswith("HELD")
        store = _C.RegionStore(runtime_dir=str(rt), job_id="job", rank=0)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(rt / "takeover.sock"))
        kw.send(s, b"takeover 1")
        wait_for_log(d, "draining (up to")
        s.close()
        wait_for_log(d, "the new daemon went away during the drain; serving on")
        assert [r["name"] for r in store.list("")] == ["kept"]  # its session lives on
        store.close()
        assert holder.poll() is None and len(d.sessions()) == 1
        holder.kill()
        holder.wait()
        # An operator's drain outlives a refused take-over.
        subprocess.run([str(bin_dir() / "memoffloadctl"), "--runtime-dir", str(rt), "drain"],
                       check=True, capture_output=True, timeout=30)
        s, frames = _ask(rt)
        for _, fds in frames:
            for fd in fds:
                os.close(fd)
        kw.send(s, b"refuse not now")
        wait_for_log(d, "refused the state: not now")
        s.close()
        assert d.status()["draining"] is True
        subprocess.run([str(bin_dir() / "memoffloadctl"), "--runtime-dir", str(rt), "undrain"],
                       check=True, capture_output=True, timeout=30)
        # Refused: the new daemon could not use the state.
        s, frames = _ask(rt)
        assert sum(len(f) for _, f in frames) == 1 + 4  # the snapshot and 4 chunks
        for _, fds in frames:
            for fd in fds:
                os.close(fd)
        kw.send(s, b"refuse cannot read it")
        wait_for_log(d, "take-over did not happen: the new daemon refused the state: cannot "
                        "read it; serving on")
        s.close()
        wait_undrained(d)
        write(rt, "job", ["after-refusal"])  # new regions: no longer draining
        # Abandoned: the new daemon died after the state came.
        s, frames = _ask(rt)
        for _, fds in frames:
            for fd in fds:
                os.close(fd)
        s.close()
        wait_for_log(d, "the new daemon went away")
        wait_undrained(d)
        write(rt, "job", ["after-abandon"])
        read_back(rt, "job", ["kept", "after-refusal", "after-abandon"])
        # One that reads an older format only is refused before any drain.
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(rt / "takeover.sock"))
        kw.send(s, b"takeover 0")
        payload, _ = kw.recv(s)
        assert payload.startswith(b"refused it names no state format it reads"), payload
        s.close()
        assert d.proc.poll() is None
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        d.stop()


def test_an_idle_session_resumes_without_a_call(rt):
    """The client library watches its lifeline: a process that makes no
    call through the take-over (a long evaluation, say) is resumed as soon
    as the old daemon exits, well within the new daemon's window."""
    old = Daemon(rt, "64MiB", "16MiB", ["--log-level=info"]).start()
    write(rt, "job", ["kept"])
    store = _C.RegionStore(runtime_dir=str(rt), job_id="job", rank=0)
    new = Daemon(rt, "64MiB", "16MiB", ["--log-level=info", "--take-over"]).spawn()
    try:
        assert old.proc.wait(timeout=30) == 0, old.log.read_text()
        wait_for_log(new, "no handed session waits any more: 1 resumed, 0 closed unresumed")
        assert [r["name"] for r in store.list("")] == ["kept"]
        store.close()
    finally:
        new.stop()


def test_calls_paused_by_a_refused_take_over_go_on_on_the_old_daemon(rt):
    """A new daemon that reads v2 freezes the serving one without a drain;
    a call made meanwhile waits, and once the take-over is refused it is
    answered by the old daemon, which serves on."""
    import threading

    d = Daemon(rt, "64MiB", "16MiB", ["--log-level=info"]).start()
    try:
        write(rt, "job", ["before"])
        store = _C.RegionStore(runtime_dir=str(rt), job_id="job", rank=0)
        s, frames = _ask(rt, version=2)
        wait_for_log(d, "sessions paused")
        answers = []
        t = threading.Thread(target=lambda: answers.append(
            sorted(r["name"] for r in store.list(""))))
        t.start()
        time.sleep(0.5)
        assert t.is_alive() and not answers  # paused, not refused
        for _, fds in frames:
            for fd in fds:
                os.close(fd)
        kw.send(s, b"refuse not today")
        t.join(timeout=10)
        assert answers == [["before"]]
        s.close()
        log = d.log.read_text()
        assert "take-over did not happen: the new daemon refused the state: not today" in log, log
        assert "draining" not in log, log
        w = store.create("after", 4096)
        w.append(b"x" * 4096)
        w.commit()
        store.close()
        assert d.proc.poll() is None
    finally:
        d.stop()


def test_chunk_owners_are_handed_on_whole_job_ids_with_spaces_too(rt):
    d = Daemon(rt, "64MiB", "16MiB", ["--log-level=info", "--tenant=job"]).start()
    try:
        write(rt, "my job", ["r"])
        s, frames = _ask(rt)
        chunks = [p for p, _ in frames if p.startswith(b"chunk ")]
        assert any(p.endswith(b" 0 job:0:my job") for p in chunks), chunks
        for _, fds in frames:
            for fd in fds:
                os.close(fd)
        kw.send(s, b"refuse only looking")
        s.close()
    finally:
        d.stop()


def test_a_take_over_is_refused_under_systemd(rt, tmp_path):
    d = Daemon(rt, "64MiB", "16MiB", ["--log-level=info"]).start()
    try:
        out = subprocess.run([str(bin_dir() / "memoffloadd"), f"--runtime-dir={rt}", "--take-over",
                              "--arena-size=64MiB", "--chunk-size=16MiB",
                              "--metrics-address=none"],
                             env=dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "nobody-listens")),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "restart the unit instead" in out.stderr, out.stderr
        assert d.proc.poll() is None and "draining" not in d.log.read_text()
    finally:
        d.stop()


class FakeServingDaemon:
    """A process of the daemon's uid listening on takeover.sock, answering
    a take-over with what the test gives it (a forged state)."""

    def __init__(self, rt: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(rt / "takeover.sock"))
        os.chmod(rt / "takeover.sock", 0o600)
        self.sock.listen(1)
        self.sock.settimeout(30)

    def answer(self, frames) -> bytes:
        conn, _ = self.sock.accept()
        conn.settimeout(30)
        request, _ = kw.recv(conn)
        assert request == b"takeover 2", request
        try:
            for payload, fds in frames:
                kw.send(conn, payload, fds)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it refused before the last chunk: its answer is already there
        reply, _ = kw.recv(conn)
        conn.close()
        return reply


def _take_over(rt: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir() / "memoffloadd"), f"--runtime-dir={rt}", "--take-over",
                           "--arena-size=64MiB", "--chunk-size=16MiB", "--metrics-address=none"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("forgery", ["newer_snapshot", "damaged_snapshot", "chunk_not_a_memfd",
                                     "chunk_of_another_size"])
def test_a_new_daemon_refuses_a_forged_state(rt, forgery):
    import threading

    fake = FakeServingDaemon(rt)
    snapshot = Path(__file__).parents[1] / "daemon/core/data/state_v1.snapshot"
    body = snapshot.read_bytes()
    if forgery == "newer_snapshot":
        body = body[:8] + struct.pack("<I", 3) + body[12:]
    elif forgery == "damaged_snapshot":
        body = body[:40] + bytes([body[40] ^ 1]) + body[41:]
    snap_fd = kw.sealed_memfd(body)
    chunk_fds = []
    for i in range(4):
        if forgery == "chunk_not_a_memfd" and i == 1:
            path = rt.parent / "not-a-memfd"
            path.write_bytes(b"\0" * (16 << 20))
            chunk_fds.append(os.open(path, os.O_RDWR))
            continue
        fd = os.memfd_create(f"chunk-{i}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        size = (8 << 20) if forgery == "chunk_of_another_size" and i == 2 else (16 << 20)
        os.ftruncate(fd, size)
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        chunk_fds.append(fd)
    frames = [(b"state 5eed5eed5eed5eed 4", [snap_fd])]
    frames += [(f"chunk {i} 1000 uid:1000".encode(), [fd]) for i, fd in enumerate(chunk_fds)]
    frames.append((b"end", []))
    replies = []
    t = threading.Thread(target=lambda: replies.append(fake.answer(frames)))
    t.start()
    out = _take_over(rt)
    t.join(timeout=60)
    assert out.returncode != 0, out.stdout
    expected = {"newer_snapshot": "format v3 was written by a newer memoffloadd",
                "damaged_snapshot": "fails its CRC32C",
                "chunk_not_a_memfd": "chunk 1: not a memfd",
                "chunk_of_another_size": "chunk 2: holds 8388608 bytes"}[forgery]
    assert expected in out.stderr, out.stderr
    assert replies and replies[0].startswith(b"refuse "), replies
    assert not (rt / "broker.sock").exists()  # it never served


def test_a_take_over_renews_only_the_chunks_a_process_was_handed(rt, daemons):
    """A take-over gives new memory to a chunk that old processes may still
    map (a tenant's, whose sessions will not resume) and to no other: the
    chunks never handed to anyone keep theirs, so an idle arena is not
    made twice while the old daemon and its keeper still hold it."""
    old = Daemon(rt, "256MiB", "16MiB", ["--log-level=info"]).start()
    daemons.append(old)
    holder = subprocess.Popen([str(bin_dir() / "offload_worker"), "hold", str(rt), "2",
                               str(1 << 20)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("HELD")
    finally:
        holder.kill()
        holder.wait()
    # Configured for another size: the arena is taken as it is, and it says so.
    new = Daemon(rt, "128MiB", "16MiB", ["--log-level=info", "--take-over"]).spawn()
    daemons.append(new)
    wait_for_log(new, f"memoffloadd[{new.proc.pid}] INFO took over the node", 30)
    lines = "\n".join(line for line in new.log.read_text().splitlines()
                      if f"memoffloadd[{new.proc.pid}]" in line)
    # The holder's one chunk (16 MiB held 2 MiB), not the 15 nobody had.
    assert "kept state: 1 kept chunk with no region left got new memfds" in lines, lines
    assert "the handed-on arena is 256.00 MiB in 16.00 MiB chunks; the configuration asks " \
        "for 128.00 MiB" in lines, lines
    assert "building arena: 256.00 MiB in 16.00 MiB chunks" in lines, lines
    assert new.status()["capacity_bytes"] == 256 << 20
