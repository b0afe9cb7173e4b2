"""Integration test of memoffloadd's sd_notify support (Notifier): the real
daemon binary runs with NOTIFY_SOCKET pointing at a datagram socket this test
owns, as systemd would start it under memoffloadd.service (Type=notify,
NotifyAccess=main, WatchdogSec=)."""

import os
import re
import select
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

import deploy_common as dc

WATCHDOG_USEC = 400_000
WATCH_SECONDS = 3.0


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(path: Path) -> bool:
    """True when a Unix socket at `path` accepts a connection of any type."""
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        with socket.socket(socket.AF_UNIX, kind) as s:
            try:
                s.connect(str(path))
                return True
            except OSError:
                continue
    return False


def _tcp_accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


class NotifyListener:
    """The service manager's end: an AF_UNIX datagram socket that records
    (time, sender pid, {KEY: VALUE}) per message, with the sender's pid from
    SCM_CREDENTIALS."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages: list[tuple[float, int, dict[str, str]]] = []

    def receive(self, timeout: float):
        """The next message, or None after `timeout` seconds."""
        ready, _, _ = select.select([self.sock], [], [], max(timeout, 0))
        if not ready:
            return None
        data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        pid = -1
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", payload[:12])[0]
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        message = (time.monotonic(), pid, fields)
        self.messages.append(message)
        return message

    def close(self):
        self.sock.close()


class NotifiedDaemon:
    """memoffloadd started through `sh -c 'WATCHDOG_PID=$$ ... exec'` so that
    WATCHDOG_PID is the daemon's own pid, as systemd sets it."""

    def __init__(self, tmp_path: Path, watchdog_pid: str = "self", notify: bool = True):
        binary = dc.daemon_binary()
        self.runtime_dir = tmp_path / "rt"
        self.runtime_dir.mkdir()
        self.metrics_port = _free_tcp_port()
        self.health_port = _free_tcp_port()
        self.listener = NotifyListener(tmp_path / "notify.sock") if notify else None
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MEMOFFLOAD_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
        if notify:
            env["NOTIFY_SOCKET"] = str(self.listener.path)
            env["WATCHDOG_USEC"] = str(WATCHDOG_USEC)
        pid_setup = {"self": "WATCHDOG_PID=$$; export WATCHDOG_PID; ",
                     "other": f"WATCHDOG_PID={os.getpid()}; export WATCHDOG_PID; ",
                     "unset": ""}[watchdog_pid]
        broker, grpc = dc.socket_names()
        self.broker_socket = self.runtime_dir / broker
        self.grpc_socket = self.runtime_dir / grpc
        self.log = open(tmp_path / "daemon.log", "w+")
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", pid_setup + 'exec "$@"', "sh", str(binary),
             "--runtime-dir", str(self.runtime_dir), "--arena-size", "64MiB",
             "--metrics-address", f"127.0.0.1:{self.metrics_port}",
             "--health-address", f"127.0.0.1:{self.health_port}"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("memoffloadd did not exit within 60 s of SIGTERM:\n" + self.log_text())

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.listener:
            self.listener.close()
        self.log.close()


@pytest.fixture
def daemon_factory(tmp_path):
    daemons = []

    def make(**kwargs):
        daemons.append(NotifiedDaemon(tmp_path, **kwargs))
        return daemons[-1]

    yield make
    for d in daemons:
        d.close()


def test_daemon_binary_calls_sd_notify():
    binary = dc.daemon_binary()
    assert b"sd_notify" in binary.read_bytes(), f"{binary} does not call sd_notify"


def _wait_ready(daemon: NotifiedDaemon, timeout: float = 60, on_ready=None):
    """Reads messages until READY=1. At that moment the daemon is stopped
    (SIGSTOP) so that it cannot bind anything late, every listener must
    already accept connections (the kernel queues them while it is stopped),
    `on_ready(daemon)` runs, and the daemon continues (SIGCONT)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = daemon.listener.receive(deadline - time.monotonic())
        if message is None:
            break
        _, _, fields = message
        if fields.get("READY") == "1":
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                assert _accepts(daemon.broker_socket), "READY=1 before broker.sock accepts"
                assert _accepts(daemon.grpc_socket), "READY=1 before memoffload.sock accepts"
                assert _tcp_accepts(daemon.metrics_port), "READY=1 before /metrics accepts"
                assert _tcp_accepts(daemon.health_port), "READY=1 before the health port accepts"
                if on_ready:
                    on_ready(daemon)
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            return message
        assert daemon.proc.poll() is None, "daemon exited:\n" + daemon.log_text()
    pytest.fail(f"no READY=1 within {timeout} s:\n" + daemon.log_text())


def test_ready_watchdog_status_and_stopping(daemon_factory):
    daemon = daemon_factory()
    ready_time, _, ready_fields = _wait_ready(daemon)

    end = ready_time + WATCH_SECONDS
    while (left := end - time.monotonic()) > 0:
        daemon.listener.receive(left)
    pings = [t for t, _, f in daemon.listener.messages if f.get("WATCHDOG") == "1"]
    interval = WATCHDOG_USEC / 2 / 1e6
    expected = WATCH_SECONDS / interval
    assert 0.6 * expected <= len(pings) <= 2 * expected + 2, (
        f"{len(pings)} WATCHDOG=1 in {WATCH_SECONDS} s, expected about {expected:.0f}")
    gaps = [b - a for a, b in zip([ready_time] + pings, pings + [end])]
    assert max(gaps) < WATCHDOG_USEC / 1e6, f"a gap of {max(gaps):.3f} s exceeds WATCHDOG_USEC"

    statuses = [f["STATUS"] for _, _, f in daemon.listener.messages if "STATUS" in f]
    assert "STATUS" in ready_fields, "READY=1 should come with a STATUS= line"
    assert any("arena" in s.lower() and "session" in s.lower() for s in statuses), statuses

    assert daemon.stop() == 0, daemon.log_text()
    while daemon.listener.receive(0.2) is not None:
        pass
    after_ready = [f for t, _, f in daemon.listener.messages if t >= ready_time]
    assert any(f.get("STOPPING") == "1" for f in after_ready), "no STOPPING=1 on SIGTERM"
    assert sum(f.get("READY") == "1" for _, _, f in daemon.listener.messages) == 1

    # NotifyAccess=main: systemd only accepts messages from the main pid.
    senders = {pid for _, pid, _ in daemon.listener.messages}
    assert senders == {daemon.proc.pid}, senders


def test_sigterm_right_after_ready_drains_and_sends_stopping(daemon_factory):
    """A SIGTERM that arrives as soon as READY=1 is sent (queued while the
    daemon is stopped) must drain: handled, STOPPING=1, exit 0."""
    daemon = daemon_factory()
    _wait_ready(daemon, on_ready=lambda d: os.kill(d.proc.pid, signal.SIGTERM))
    try:
        code = daemon.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail("memoffloadd did not exit within 60 s of SIGTERM:\n" + daemon.log_text())
    assert code == 0, f"exit {code} (a SIGTERM before the handler kills the daemon):\n" + \
        daemon.log_text()
    while daemon.listener.receive(0.2) is not None:
        pass
    assert any(f.get("STOPPING") == "1" for _, _, f in daemon.listener.messages), \
        daemon.listener.messages
    assert "received SIGTERM: draining" in daemon.log_text(), daemon.log_text()


def test_signal_handlers_are_installed_before_ready(tmp_path):
    """strace shows the order of the main thread's syscalls: the SIGTERM
    handler must be in place before the sendmsg that carries READY=1."""
    binary = dc.daemon_binary()
    strace = dc.require_tool("strace")
    listener = NotifyListener(tmp_path / "notify.sock")
    runtime = tmp_path / "rt"
    runtime.mkdir()
    trace = tmp_path / "trace"
    log_path = tmp_path / "daemon.log"
    log = open(log_path, "w")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMOFFLOAD_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
    env["NOTIFY_SOCKET"] = str(listener.path)
    proc = subprocess.Popen(
        [strace, "-f", "-qq", "-s", "64", "-e", "trace=rt_sigaction,sendmsg", "-o", str(trace),
         str(binary), "--runtime-dir", str(runtime), "--arena-size", "64MiB",
         "--metrics-address", "none"],
        env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not any(f.get("READY") == "1" for _, _, f in listener.messages):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "no READY=1 under strace in 60 s"
            listener.receive(0.5)
        # Signal the daemon (the pid of the READY=1 sender), not strace.
        daemon_pid = next(pid for _, pid, f in listener.messages if f.get("READY") == "1")
        os.kill(daemon_pid, signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()
        log.close()
    lines = trace.read_text().splitlines()
    ready = [i for i, line in enumerate(lines) if "sendmsg(" in line and "READY=1" in line]
    handler = [i for i, line in enumerate(lines)
               if re.search(r"rt_sigaction\(SIGTERM, \{sa_handler=0x", line)]
    assert ready, "no sendmsg with READY=1 in the trace:\n" + "\n".join(lines[-20:])
    assert handler, "no SIGTERM handler installed:\n" + "\n".join(lines[-20:])
    assert handler[0] < ready[0], (
        "READY=1 was sent before the SIGTERM handler was installed:\n"
        + "\n".join(lines[min(ready[0], handler[0]):max(ready[0], handler[0]) + 1][:20]))


def test_no_watchdog_pings_when_watchdog_pid_names_another_process(daemon_factory):
    daemon = daemon_factory(watchdog_pid="other")
    ready_time, _, _ = _wait_ready(daemon)
    end = ready_time + 1.5
    while (left := end - time.monotonic()) > 0:
        daemon.listener.receive(left)
    assert not [f for _, _, f in daemon.listener.messages if "WATCHDOG" in f]
    assert daemon.stop() == 0, daemon.log_text()


def test_runs_and_stops_cleanly_without_notify_socket(daemon_factory):
    daemon = daemon_factory(notify=False)
    deadline = time.monotonic() + 60
    while not (_accepts(daemon.broker_socket) and _accepts(daemon.grpc_socket)):
        assert daemon.proc.poll() is None, daemon.log_text()
        assert time.monotonic() < deadline, "sockets not up in 60 s:\n" + daemon.log_text()
        time.sleep(0.05)
    assert daemon.stop() == 0, daemon.log_text()
