"""The image of deploy/docker/Dockerfile, built here on a base image the test
makes itself (no registry is reachable), run as a node's daemon: a trainer
on the host attaches through the runtime dir volume and offloads and
prefetches bit-exact, Prometheus' scrape works on the configured port, the
runtime image holds no compiler, and `podman stop` drains and exits 0.

With --network=host (the only network podman has here), "published" means
reachable on the daemon's configured loopback address."""

import os
import re
import signal
import subprocess
import urllib.request

import pytest

import container_common as cc
import deploy_common as dc

pytestmark = pytest.mark.container

ARENA_BYTES = 64 * 1024 * 1024
# The image's user (deploy/docker/Dockerfile: USER 10001:10001).
IMAGE_UID = 10001
# A host trainer trusts a daemon of another uid in a runtime dir other than
# /run/memoffload only when it is named (docs/security.md).
TRAINER_ENV = dict(os.environ, MEMOFFLOAD_DAEMON_UID=str(IMAGE_UID))


def _tool(name: str) -> str:
    path = dc.bin_dir() / name
    if not path.is_file():
        pytest.fail(f"{path} not built: scripts/build.sh builds {name}")
    return str(path)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        return reply.read().decode()


def _sample(text: str, name: str) -> float:
    """The value of an unlabelled sample `name` in Prometheus text format."""
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} not in the scrape:\n{text[:2000]}"
    return float(match.group(1))


class DaemonContainer:
    """memoffloadd in the image, its runtime dir a host directory (the volume
    trainers share) and its metrics on a free loopback port.

    The volume is mounted at the same path inside as outside (a trainer uses
    the sockets of the dir it verified, so another path would work too). The
    daemon runs as the image's user: host trainers name it in
    MEMOFFLOAD_DAEMON_UID (TRAINER_ENV), as docs/deploy.md says."""

    def __init__(self, podman: cc.Podman, image: str, runtime_dir, name: str = "daemon"):
        self.podman = podman
        self.name = f"{cc.RUN_PREFIX}-{name}"
        self.runtime_dir = runtime_dir
        self.metrics_port = cc.free_tcp_port()
        # As docs/deploy.md says: the directory belongs to the image's user.
        if not runtime_dir.exists():
            runtime_dir.mkdir(mode=0o750)
            os.chown(runtime_dir, IMAGE_UID, IMAGE_UID)
        podman.run("run", "-d", "--name", self.name, "--network=host",
                   "-v", f"{runtime_dir}:{runtime_dir}", image,
                   f"--runtime-dir={runtime_dir}",
                   f"--metrics-address=127.0.0.1:{self.metrics_port}",
                   f"--arena-size={ARENA_BYTES // (1024 * 1024)}MiB")

    def logs(self) -> str:
        result = self.podman.run("logs", self.name, check=False)
        return result.stdout + result.stderr

    def remove(self) -> None:
        self.podman.remove_container(self.name)


@pytest.fixture(scope="module")
def daemon(podman, images, tmp_path_factory):
    container = DaemonContainer(podman, images["app"], tmp_path_factory.mktemp("rt") / "rt")
    try:
        broker, _ = dc.socket_names()
        cc.wait_for("the daemon's broker socket on the volume",
                    lambda: (container.runtime_dir / broker).exists()
                    and "arena ready" in container.logs(), timeout_s=120)
        yield container
    finally:
        print(container.logs()[-3000:])
        container.remove()


def test_runtime_image_holds_no_compiler(podman, images, timings):
    result = podman.run(
        "run", "--rm", "--network=host", "--entrypoint", "/bin/sh", images["app"], "-c",
        "for t in gcc g++ cc c++ cpp clang ld as make cmake; do command -v $t; done; "
        # gcc-12-base (copyright files that libgcc-s1 depends on) is no compiler.
        "dpkg-query -W -f '${Package}\\n' | grep -E '^((gcc|g\\+\\+|cpp)(-[0-9]+)?|binutils.*)$'"
        " || true")
    assert result.stdout.strip() == "", f"compiler parts in the runtime image:\n{result.stdout}"
    size = podman.image_size_bytes(images["app"])
    print(f"runtime image {images['app']}: {size / 1e6:.0f} MB")
    # The Debian minbase alone is about 200 MB; the libraries add about 120.
    assert size < 450e6, f"runtime image is {size / 1e6:.0f} MB"


def test_daemon_runs_as_the_image_user_with_sockets_on_the_volume(podman, daemon):
    user = podman.exec(daemon.name, "id", "-u").stdout.strip()
    assert user == str(IMAGE_UID)
    for name in dc.socket_names():
        path = daemon.runtime_dir / name
        assert path.exists(), f"{path} missing on the host side of the volume"
        assert path.stat().st_uid == IMAGE_UID


def test_host_trainer_offloads_and_prefetches_bit_exact(daemon):
    """offload_worker verify (tests/integration): random groups offloaded,
    prefetched and compared byte for byte, two in flight."""
    result = subprocess.run(
        [_tool("offload_worker"), "verify", str(daemon.runtime_dir), "7", "40", "4096",
         str(4 * 1024 * 1024)], capture_output=True, text=True, timeout=120, env=TRAINER_ENV)
    assert result.returncode == 0, result.stdout + result.stderr + daemon.logs()[-2000:]
    assert re.search(r"verified 40 groups, \d+ bytes", result.stdout), result.stdout
    print(result.stdout)
    status = subprocess.run(
        [_tool("memoffloadctl"), "--runtime-dir", str(daemon.runtime_dir), "status"],
        capture_output=True, text=True, timeout=30, env=TRAINER_ENV)
    assert status.returncode == 0, status.stderr
    print(status.stdout)


def test_metrics_are_scraped_on_the_configured_port(daemon):
    # After the trainer above: what it offloaded and prefetched is counted.
    text = _metrics(daemon.metrics_port)
    assert _sample(text, "memoffload_arena_capacity_bytes") == ARENA_BYTES
    assert _sample(text, "memoffload_offload_bytes_total") > 0
    assert _sample(text, "memoffload_prefetch_bytes_total") > 0
    assert _sample(text, "memoffload_draining") == 0
    print("\n".join(line for line in text.splitlines()
                    if re.match(r"memoffload_(arena_capacity|offload|prefetch|draining)", line)))


def test_podman_stop_drains_and_exits_zero(podman, daemon):
    """A trainer holds groups while `podman stop` sends SIGTERM: the daemon
    drains (waits for it), and exits 0 once the trainer is gone."""
    # The client's notes ("memoffload: session N on ...") go to stderr.
    holder = subprocess.Popen(
        [_tool("offload_worker"), "hold", str(daemon.runtime_dir), "2", str(1024 * 1024)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=TRAINER_ENV)
    stopper = None
    try:
        assert holder.stdout.readline().startswith("HELD"), daemon.logs()[-2000:]
        stopper = subprocess.Popen(
            [podman.executable, "--runtime", "runc", "stop", "-t", "45", daemon.name],
            env=podman.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        cc.wait_for("the daemon to log its drain",
                    lambda: "draining (1 sessions" in daemon.logs(), timeout_s=30)
        assert _sample(_metrics(daemon.metrics_port), "memoffload_draining") == 1
        # podman calls a container that got its stop signal "stopping".
        assert podman.state(daemon.name)["Status"] == "stopping", \
            "the daemon left before its session did"
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        out, _ = stopper.communicate(timeout=60)
        assert stopper.returncode == 0, out
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if stopper is not None and stopper.poll() is None:
            stopper.kill()
            stopper.wait()
    state = podman.state(daemon.name)
    assert not state["Running"]
    assert state["ExitCode"] == 0, state
    logs = daemon.logs()
    assert "drained: no groups held" in logs, logs[-2000:]
    assert "stopped cleanly" in logs, logs[-2000:]
    print(f"podman stop: {out.strip()}; exit code {state['ExitCode']}\n{logs[-1200:]}")


def _region_loop(runtime_dir, *args: str, **kwargs):
    return subprocess.run([_tool("region_loop"), *args[:1], str(runtime_dir), *args[1:]],
                          env=TRAINER_ENV, capture_output=True, text=True, timeout=120, **kwargs)


def _answered_commits(log) -> tuple:
    """region_loop's output once it stopped: the regions whose commit was
    answered, and those it may have deleted since."""
    lines = log.read_text().splitlines()
    assert lines[-1].startswith("stopped"), lines[-3:]
    return ({n for n in lines if n.startswith("w")},
            {n.split()[1] for n in lines if n.startswith("deleting ")})


def _check_kept(runtime_dir, answered: tuple) -> None:
    """Every answered commit not deleted since is there, bit for bit; at most
    one more (a commit the daemon did but could not answer)."""
    committed, maybe_gone = answered
    check = _region_loop(runtime_dir, "check", "job")
    assert check.returncode == 0, check.stdout + check.stderr
    kept = set(check.stdout.split()[:-2])
    assert committed - maybe_gone <= kept, sorted(committed - maybe_gone - kept)[:5]
    assert len(kept - committed) <= 1


def test_a_daemon_crash_beside_the_keeper_keeps_the_regions(podman, images, tmp_path_factory):
    """The keeper (a second container sharing the runtime dir, as the
    DaemonSet's sidecar) holds the arena while the daemon's container is
    killed and started again: every region a host rank committed comes back."""
    rt = tmp_path_factory.mktemp("rt-keeper") / "rt"
    rt.mkdir(mode=0o750)
    os.chown(rt, IMAGE_UID, IMAGE_UID)
    keeper = f"{cc.RUN_PREFIX}-keeper"
    podman.run("run", "-d", "--name", keeper, "--network=host", "-v", f"{rt}:{rt}",
               images["app"], "keeper", f"--runtime-dir={rt}")
    daemon = None
    try:
        cc.wait_for("the keeper's socket", lambda: (rt / "keeper.sock").exists(), timeout_s=60)
        daemon = DaemonContainer(podman, images["app"], rt, name="kept-daemon")
        broker, _ = dc.socket_names()
        cc.wait_for("the daemon", lambda: (rt / broker).exists() and
                    "arena ready" in daemon.logs(), timeout_s=120)
        assert "state store: the keeper at" in daemon.logs()
        log = rt.parent / "w.log"
        # stdout only: the client's own log lines (an abort after the kill) go to w.err.
        with open(log, "w") as out, open(rt.parent / "w.err", "w") as err:
            rank = subprocess.Popen([_tool("region_loop"), "loop", str(rt), "job", "w"],
                                    env=TRAINER_ENV, stdout=out, stderr=err)
        cc.wait_for("40 commits", lambda: log.read_text().count("\n") >= 40, timeout_s=60)
        podman.run("kill", "-s", "KILL", daemon.name)
        assert rank.wait(timeout=60) == 0
        answered = _answered_commits(log)
        # The container is started again, as kubelet restarts a crashed one.
        podman.run("start", daemon.name)
        cc.wait_for("the restarted daemon", lambda: "recovered the node" in daemon.logs(),
                    timeout_s=120)
        _check_kept(rt, answered)
        print(daemon.logs()[-2000:])
    finally:
        if daemon is not None:
            print(daemon.logs()[-3000:])
            daemon.remove()
        podman.remove_container(keeper)


def _pod(podman: cc.Podman, image: str, rt, name: str) -> tuple:
    """A DaemonSet pod as two containers: a keeper on a socket of its own in
    the shared runtime dir, and a daemon with the ConfigMap's lifecycle
    settings. --pid=host stands for hostPID: the host rank's session is
    handed on. Returns the containers' names and the keeper's socket."""
    sock = rt / f"keeper-{name}.sock"
    env = ["-e", f"MEMOFFLOAD_KEEPER_SOCKET={sock}"]
    keeper, daemon = f"{cc.RUN_PREFIX}-keeper-{name}", f"{cc.RUN_PREFIX}-daemon-{name}"
    podman.run("run", "-d", "--name", keeper, "--network=host", "-v", f"{rt}:{rt}", *env,
               image, "keeper", f"--runtime-dir={rt}")
    cc.wait_for(f"{name}'s keeper", sock.exists, timeout_s=60)
    podman.run("run", "-d", "--name", daemon, "--network=host", "--pid=host", "-v", f"{rt}:{rt}",
               *env, image, f"--runtime-dir={rt}", "--metrics-address=none",
               f"--arena-size={ARENA_BYTES // (1024 * 1024)}MiB", "--state-store=keeper",
               "--keep-sessions=never", "--take-over=auto", "--after-handover=wait")
    return keeper, daemon, sock


def test_a_rolling_update_hands_the_node_to_the_new_pod(podman, images, tmp_path_factory):
    """maxSurge with podman: the new pod's daemon takes the node from the
    old one while a host rank commits regions (its session resumes), the
    old daemon waits until its pod is deleted and then exits 0 (started
    again meanwhile, it stands by rather than take the node back), and the new
    pod's keeper alone then keeps every answered region across a SIGKILL of
    the new daemon's container (docs/restarts.md, "Take-over across pods")."""
    rt = tmp_path_factory.mktemp("rt-surge") / "rt"
    rt.mkdir(mode=0o750)
    os.chown(rt, IMAGE_UID, IMAGE_UID)
    def logs(name: str) -> str:
        result = podman.run("logs", name, check=False)
        return result.stdout + result.stderr

    made = []
    rank = None
    try:
        old_keeper, old_daemon, old_sock = _pod(podman, images["app"], rt, "old")
        made += [old_keeper, old_daemon]
        broker, _ = dc.socket_names()
        cc.wait_for("the old pod's daemon", lambda: (rt / broker).exists() and
                    "arena ready" in logs(old_daemon), timeout_s=120)
        assert "no daemon serves" in logs(old_daemon)
        log = rt.parent / "w.log"
        with open(log, "w") as out, open(rt.parent / "w.err", "w") as err:
            rank = subprocess.Popen([_tool("region_loop"), "loop", str(rt), "job", "w"],
                                    env=TRAINER_ENV, stdout=out, stderr=err)

        def count() -> int:
            return log.read_text().count("\n")

        cc.wait_for("20 commits", lambda: count() >= 20, timeout_s=60)
        new_keeper, new_daemon, new_sock = _pod(podman, images["app"], rt, "new")
        made += [new_keeper, new_daemon]
        cc.wait_for("the take-over", lambda: "took over the node" in logs(new_daemon),
                    timeout_s=120)
        cc.wait_for("the old daemon to wait", lambda: "handed over: waiting" in logs(old_daemon),
                    timeout_s=30)
        at_take_over = count()
        cc.wait_for("20 commits on the new daemon", lambda: count() >= at_take_over + 20,
                    timeout_s=60)
        assert rank.poll() is None, log.read_text()[-500:]
        assert "resumed after" in logs(new_daemon), logs(new_daemon)[-2000:]
        # The old daemon's container dies and starts again: it stands by.
        podman.run("kill", "-s", "KILL", old_daemon)
        podman.run("start", old_daemon)
        cc.wait_for("the old daemon to stand by", lambda: "standing by" in logs(old_daemon),
                    timeout_s=60)
        at_restart = count()
        cc.wait_for("10 more commits", lambda: count() >= at_restart + 10, timeout_s=60)
        # The update deletes the old pod.
        podman.run("stop", "-t", "20", old_daemon)
        podman.run("stop", "-t", "20", old_keeper)
        state = podman.state(old_daemon)
        assert state["ExitCode"] == 0 and "draining" not in logs(old_daemon), logs(old_daemon)
        assert not old_sock.exists() and new_sock.exists()
        podman.run("kill", "-s", "KILL", new_daemon)
        assert rank.wait(timeout=60) == 0
        answered = _answered_commits(log)
        podman.run("start", new_daemon)
        cc.wait_for("the new pod's daemon again",
                    lambda: f"recovered the node from the keeper at {new_sock}" in logs(new_daemon),
                    timeout_s=120)
        _check_kept(rt, answered)
        print(logs(new_daemon)[-2500:])
    finally:
        if rank is not None and rank.poll() is None:
            rank.kill()
            rank.wait()
        for name in made:
            print(f"--- {name}\n{logs(name)[-2000:]}")
            podman.remove_container(name)
