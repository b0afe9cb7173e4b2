"""Fixtures: a real memoffloadd in a temporary runtime dir.

The daemon binary is $MEMOFFLOAD_BIN_DIR/memoffloadd (default: build/bin of
the repository). Every test talks to it over its real sockets.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import random
import signal
import socket
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

import memoffload  # noqa: E402
import memoffload.torch as mot  # noqa: E402


def bin_dir() -> Path:
    return Path(os.environ.get("MEMOFFLOAD_BIN_DIR", REPO / "build" / "bin")).resolve()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


# Exit code of a run that selected only gpu tests on a machine without a CUDA
# device: CTest's SKIP_RETURN_CODE for python_torch_gpu_tests, so the whole
# entry shows as skipped ("Not Run") instead of passing with nothing run.
NO_GPU_EXIT_CODE = 77


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.getoption("markexpr") != "gpu" or torch.cuda.is_available():
        return
    reason = (
        f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False): "
        f"{len(session.items)} gpu test(s) not run"
    )
    print(f"\nSKIPPED: {reason}")
    pytest.exit(reason, returncode=NO_GPU_EXIT_CODE)


def free_port() -> int:
    """A TCP port free on every address, for a test's TCPStore or server.

    Picked below the kernel's ephemeral range (32768 and up by default), so
    no socket bound to port 0 (the checkpoint link's listeners, any outgoing
    connection) can take it between this check and the bind that uses it.
    """
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-32000")


def as_uid(uid: int, *argv: str) -> List[str]:
    """``argv`` run as ``uid`` (its own group, no supplementary ones): a
    second user of the node, for the tests that try what one can do."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A dir every user can write, like /tmp (root's, sticky)."""
    path = tempfile.mkdtemp(prefix="memoffload-shared-", dir="/tmp")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Daemon:
    """One memoffloadd process; stop() at the end, kill() to simulate a crash."""

    def __init__(self, runtime_dir: Path, arena: str, chunk: str, extra_args: List[str] = ()) -> None:
        self.runtime_dir = str(runtime_dir)
        self.arena = arena
        self.chunk = chunk
        self.extra_args = list(extra_args)
        self.proc: Optional[subprocess.Popen] = None
        self.log = runtime_dir.parent / f"memoffloadd-{runtime_dir.name}.log"

    def start(self) -> "Daemon":
        self.spawn()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"memoffloadd exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                mot.daemon_status(self.runtime_dir)
                return self
            except memoffload.Unavailable:
                time.sleep(0.05)
        pytest.fail("memoffloadd did not answer within 20 s")

    def spawn(self) -> "Daemon":
        """Starts the process without waiting for it to answer (a take-over:
        the daemon it takes over answers meanwhile)."""
        exe = bin_dir() / "memoffloadd"
        if not exe.exists():
            pytest.fail(f"{exe} not found: build it or set MEMOFFLOAD_BIN_DIR")
        self.proc = subprocess.Popen(
            [
                str(exe),
                f"--runtime-dir={self.runtime_dir}",
                f"--arena-size={self.arena}",
                f"--chunk-size={self.chunk}",
                "--metrics-address=none",
                "--prefault-threads=1",
                "--log-level=warn",
                *self.extra_args,
            ],
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
            # It stops by itself with the test process, even one that failed
            # before stopping it (SIGTERM when its parent dies).
            preexec_fn=_die_with_parent,
        )
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def status(self) -> dict:
        return mot.daemon_status(self.runtime_dir)

    def sessions(self) -> List[dict]:
        """`memoffloadctl --json sessions`: job_id, rank, pid, held bytes, ..."""
        out = subprocess.run(
            [str(bin_dir() / "memoffloadctl"), "--runtime-dir", self.runtime_dir, "--json",
             "sessions"],
            check=True, capture_output=True, text=True, timeout=30,
        ).stdout
        return json.loads(out).get("sessions", [])

    def jobs(self) -> List[str]:
        """The job ids of this process's sessions."""
        return sorted(s["job_id"] for s in self.sessions() if s.get("pid") == os.getpid())


def _serve(tmp: Path, arena: str, chunk: str) -> Iterator[Daemon]:
    """Runs a daemon in tmp/rt for the fixture's lifetime, then forgets the
    offloader attached to it and stops it."""
    rt = tmp / "rt"
    rt.mkdir(mode=0o700)
    d = Daemon(rt, arena, chunk).start()
    yield d
    mot.forget_offloader(d.runtime_dir)
    d.stop()


@pytest.fixture(autouse=True)
def _fresh_log_limits():
    """Each test sees the first line of each rate-limited cause (logs.log_limited)."""
    from memoffload import logs

    logs._limited.clear()
    yield


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A 256 MiB daemon shared by the tests of one module."""
    yield from _serve(tmp_path_factory.mktemp("mo"), "256MiB", "64MiB")


@pytest.fixture
def own_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon of the test's own, for tests that kill or restart it."""
    yield from _serve(tmp_path, "256MiB", "64MiB")


@pytest.fixture
def tiny_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A 4 MiB arena: too small for big groups."""
    yield from _serve(tmp_path, "4MiB", "4MiB")


# ---- helpers shared by the test modules ----


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def grads(model: torch.nn.Module) -> List[Optional[torch.Tensor]]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as raw bytes (NaN-safe, -0.0 != 0.0)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_grads(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Every parameter's gradient bit for bit."""
    pairs = list(zip(a.named_parameters(), b.parameters()))
    assert len(pairs) == len(list(b.parameters()))
    for (name, pa), pb in pairs:
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            assert bit_equal(pa.grad, pb.grad), f"gradient of {name} differs"


def step_both(
    model: torch.nn.Module,
    ref: torch.nn.Module,
    batch: torch.Tensor,
    loss_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = lambda m, b: m(b),
) -> None:
    """One step of `model` and of its reference copy `ref` on `batch` from
    cleared gradients: the losses and the gradients must be equal."""
    for m in (model, ref):
        for p in m.parameters():
            p.grad = None
    loss = loss_of(model, batch)
    loss.backward()
    loss_ref = loss_of(ref, batch)
    loss_ref.backward()
    if loss.is_cuda:
        torch.cuda.synchronize()
    assert bit_equal(loss, loss_ref)
    assert_same_grads(model, ref)


def assert_arena_empty(d: Daemon, off=None) -> None:
    (off or mot.get_offloader(d.runtime_dir)).flush()
    s = d.status()
    assert s["used_bytes"] == 0, s
    assert s["groups"] == 0, s
