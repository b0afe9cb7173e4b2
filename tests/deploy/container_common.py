"""Podman for the container tests (test_container.py, test_systemd_boot.py).

No registry is reachable where they run, so the Debian 12 base image is made
here with debootstrap; its tarball is kept in a cache directory of its own
(MEMOFFLOAD_CONTAINER_CACHE, default /var/cache/memoffload-tests) so that a
second run on the same machine skips debootstrap. Podman runs with runc
(crun fails on this kernel's hybrid cgroups), host networking and a
containers.conf without default ulimits (runc cannot raise RLIMIT_NOFILE or
RLIMIT_NPROC here). Every image and container a run makes is named with
the run's prefix and removed at its end.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import deploy_common as dc

CACHE_DIR = Path(os.environ.get("MEMOFFLOAD_CONTAINER_CACHE", "/var/cache/memoffload-tests"))
# Named after the recipe below: change the name when the recipe changes.
BASE_TARBALL = CACHE_DIR / "debian-bookworm-minbase-slim-1.tar"
APT_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
SYSTEMD_CONTAINERFILE = Path(__file__).resolve().parent / "systemd.Containerfile"
# Names of everything one run creates start with this, so that runs of
# several engineers on one machine never meet.
RUN_PREFIX = f"memoffload-test-{os.getpid()}"


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, condition, timeout_s: float, interval_s: float = 0.2):
    """Polls `condition` until it returns a true value (returned) or fails
    the test after `timeout_s` naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class Timings:
    """Seconds spent on the expensive steps, printed in pytest's summary."""
    steps: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def record(self, name: str, seconds: float) -> None:
        self.steps[name] = round(seconds, 1)


class Podman:
    """podman with this machine's settings. Every call has a timeout and
    fails the test, with podman's output, when it exits non-zero (unless
    check=False)."""

    def __init__(self, work_dir: Path):
        executable = shutil.which("podman")
        if executable is None:
            pytest.fail("podman not found: run scripts/setup-deps.sh --with-container")
        self.executable = executable
        conf = work_dir / "containers.conf"
        conf.write_text("[containers]\ndefault_ulimits = []\n")
        self.env = dict(os.environ, CONTAINERS_CONF=str(conf))

    def run(self, *args: str, timeout_s: float = 120, check: bool = True,
            input_bytes: bytes | None = None) -> subprocess.CompletedProcess:
        command = [self.executable, "--runtime", "runc", *args]
        try:
            result = subprocess.run(command, env=self.env, capture_output=True,
                                    timeout=timeout_s, input=input_bytes)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"podman {' '.join(args)[:200]} timed out after {timeout_s} s: "
                        f"{(e.stderr or b'')[-2000:].decode(errors='replace')}")
        result.stdout = result.stdout.decode(errors="replace")
        result.stderr = result.stderr.decode(errors="replace")
        if check and result.returncode != 0:
            pytest.fail(f"podman {' '.join(args)[:300]} exited {result.returncode}:\n"
                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def build(self, log: Path, *args: str, timeout_s: float) -> None:
        """podman build with its output in `log` (it is long)."""
        result = self.run("build", "--network=host", *args, timeout_s=timeout_s, check=False)
        log.write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            pytest.fail(f"podman build {' '.join(args)} exited {result.returncode}; "
                        f"last lines:\n{(result.stdout + result.stderr)[-4000:]}")

    def exec(self, container: str, *command: str, timeout_s: float = 60,
             check: bool = True, user: str | None = None) -> subprocess.CompletedProcess:
        user_args = ["--user", user] if user else []
        return self.run("exec", *user_args, container, *command, timeout_s=timeout_s,
                        check=check)

    def image_size_bytes(self, image: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", image).stdout)

    def state(self, container: str) -> dict:
        out = self.run("inspect", "--format", "{{json .State}}", container).stdout
        return json.loads(out)

    def remove_container(self, name: str) -> None:
        self.run("rm", "-f", "-t", "5", name, check=False, timeout_s=60)

    def remove_image(self, image: str) -> None:
        self.run("rmi", "-f", image, check=False, timeout_s=120)


def ensure_base_tarball(timings: Timings) -> Path:
    """The debootstrap'ed Debian 12 minbase tree as a tarball in CACHE_DIR,
    made on the first run (about 2 minutes) and reused after."""
    if BASE_TARBALL.is_file() and BASE_TARBALL.stat().st_size > 0:
        timings.notes["debootstrap"] = f"skipped, cached {BASE_TARBALL}"
        return BASE_TARBALL
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    if not Path(debootstrap).is_file():
        pytest.fail("debootstrap not found: run scripts/setup-deps.sh --with-container")
    match = re.search(r"^URIs:\s*(\S+)", APT_SOURCES.read_text(), re.M)
    assert match, f"no URIs: line in {APT_SOURCES}"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        root = Path(tmp) / "root"
        start = time.monotonic()
        result = subprocess.run(
            ["nice", debootstrap, "--variant=minbase", "bookworm", str(root), match.group(1)],
            capture_output=True, text=True, timeout=1200)
        if result.returncode != 0:
            pytest.fail(f"debootstrap exited {result.returncode}:\n{result.stdout[-3000:]}"
                        f"\n{result.stderr[-3000:]}")
        # The image's apt uses the same mirror (and security suite) as the host.
        shutil.copy(APT_SOURCES, root / "etc/apt/sources.list.d/")
        _slim(root)
        partial = BASE_TARBALL.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(root), "-cf", str(partial), "."], check=True,
                       timeout=600)
        partial.rename(BASE_TARBALL)
        timings.record("debootstrap (base tarball)", time.monotonic() - start)
    return BASE_TARBALL


def _slim(root: Path) -> None:
    """What makes Debian's bookworm-slim slim: no apt lists or caches (every
    RUN starts with apt-get update), no manuals, docs (but the copyright
    files) or translations, and dpkg told to skip them in later installs
    too. About 190 MB become 80."""
    doomed = [*root.glob("var/lib/apt/lists/*"), *root.glob("var/cache/apt/*.bin"),
              *root.glob("var/cache/apt/archives/*.deb")]
    for part in ("man", "info", "locale"):
        doomed += root.glob(f"usr/share/{part}/*")
    doomed += [p for p in root.glob("usr/share/doc/*/*") if p.name != "copyright"]
    for path in doomed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    (root / "etc/dpkg/dpkg.cfg.d/slim").write_text(
        "".join(f"path-exclude /usr/share/{part}/*\n" for part in ("man", "info", "locale", "doc"))
        + "path-include /usr/share/doc/*/copyright\n")


def import_base_image(podman: Podman, timings: Timings) -> str:
    """Imports the cached tarball as this run's base image; returns its name."""
    tarball = ensure_base_tarball(timings)
    image = f"localhost/{RUN_PREFIX}-debian:bookworm-slim"
    start = time.monotonic()
    podman.run("import", str(tarball), image, timeout_s=600)
    timings.record("podman import of the base", time.monotonic() - start)
    return image


def dockerfile_runtime_packages() -> list[str]:
    """The packages the Dockerfile's runtime stage installs."""
    return dc.apt_packages(dc.dockerfile_stages()["runtime"])
