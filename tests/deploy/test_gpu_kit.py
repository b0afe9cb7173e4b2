"""The GPU kit (scripts/gpu-kit.sh) on a stand-in for the bare GPU machine:
a minimal Debian 12 image with Python, its headers, a C++ compiler, ninja and
a CPU torch installed from wheel files, and none of memoffload's build
dependencies, run with --network=none. The kit must build memoffload._C
there, serve from its own memoffloadd, run bench/gpu_bench.py --cpu-smoke
and report the gpu tests as skipped; without one of its libraries it must
fail, naming the step. What the kit lacks fails here, not on the GPU.

Marker `gpukit`, CTest label `gpukit` (about 8 minutes on 2 cores, plus a
base image made with debootstrap on a machine that has none cached)."""

import hashlib
import os
import importlib.metadata as metadata
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import container_common as cc
import deploy_common as dc

pytestmark = pytest.mark.gpukit

HOST_CONTAINERFILE = Path(__file__).resolve().parent / "gpukit-host.Containerfile"
GPU_KIT = dc.REPO / "scripts" / "gpu-kit.sh"
# What the GPU machine's Python brings: torch (and what importing it and its
# extension builder need) and pytest.
HOST_PACKAGES = ["torch", "setuptools", "pytest"]
BENCH_ROWS = {"gpu_info", "gpu_copies", "gpu_overlap", "gpu_step", "gpu_register", "startup",
              "attach"}


def _closure(names: list[str]) -> dict[str, str]:
    """name -> version of `names` and everything they require (this
    environment's versions, markers evaluated here)."""
    found: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in found:
            continue
        dist = metadata.distribution(name)
        found[key] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


@pytest.fixture(scope="module")
def wheels(tmp_path_factory, timings) -> Path:
    """Wheel files of the host packages, downloaded once into the cache."""
    pins = _closure(HOST_PACKAGES)
    key = "-".join(f"{n}{v}" for n, v in sorted(pins.items()))
    cache = cc.CACHE_DIR / f"gpukit-wheels-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    listing = cache / "pins.txt"
    if not (listing.is_file() and listing.read_text() == key):
        start = time.monotonic()
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        # torch is the CPU build on this machine's disk (pip's find-links).
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
             "--only-binary=:all:", "-d", str(cache), *(f"{n}=={v}" for n, v in pins.items())],
            capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            pytest.fail(f"pip download of the host's wheels failed:\n{result.stderr[-3000:]}")
        listing.write_text(key)
        timings.record("pip download (host wheels)", time.monotonic() - start)
    return cache


@pytest.fixture(scope="module")
def host_image(podman, timings, wheels, tmp_path_factory):
    """The bare GPU machine's stand-in, removed at the end."""
    base = cc.import_base_image(podman, timings)
    context = tmp_path_factory.mktemp("gpukit-host")
    shutil.copy(HOST_CONTAINERFILE, context / "Containerfile")
    (context / "wheels").mkdir()
    for wheel in wheels.glob("*.whl"):
        (context / "wheels" / wheel.name).hardlink_to(wheel)
    name = f"localhost/{cc.RUN_PREFIX}-gpukit-host:test"
    start = time.monotonic()
    try:
        podman.build(context / "build.log", "-f", str(context / "Containerfile"),
                     "--build-arg", f"BASE_IMAGE={base}", "-t", name, str(context),
                     timeout_s=1800)
        timings.record("gpu kit host image build", time.monotonic() - start)
        yield name
    finally:
        podman.remove_image(name)
        podman.remove_image(base)


@pytest.fixture(scope="module")
def kit(tmp_path_factory, timings) -> Path:
    """The kit, made by scripts/gpu-kit.sh into a directory of this run."""
    out = tmp_path_factory.mktemp("kit") / "gpu-kit"
    start = time.monotonic()
    result = subprocess.run([str(GPU_KIT), str(out)], capture_output=True, text=True,
                            timeout=2400, cwd=dc.REPO)
    if result.returncode != 0:
        pytest.fail(f"scripts/gpu-kit.sh exited {result.returncode}:\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    timings.record("scripts/gpu-kit.sh", time.monotonic() - start)
    timings.notes["gpu kit"] = result.stdout.strip().splitlines()[0]
    size_mib = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    assert size_mib <= 60, f"the kit is {size_mib:.1f} MiB, over 60"
    return out


def _run_kit(podman, image: str, kit: Path, out: Path, timeout_s: float = 600,
             stage: str | None = None):
    """KIT/run.sh OUT (--only STAGE) in the stand-in, with no network."""
    out.mkdir()
    only = ["--only", stage] if stage else []
    return podman.run("run", "--rm", "--network=none", "-v", f"{kit}:/kit", "-v", f"{out}:/out",
                      image, "/kit/run.sh", "/out", *only, timeout_s=timeout_s, check=False)


def _results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()
            if line.strip()]


def _steps(rows: list[dict]) -> dict[str, dict]:
    return {r["step"]: r for r in rows if isinstance(r.get("status"), str)}


def test_the_host_image_has_none_of_our_build_dependencies(podman, host_image):
    listing = podman.run("run", "--rm", "--network=none", host_image, "sh", "-c",
                         "ldconfig -p; dpkg-query -W -f='${Package}\\n'").stdout
    # (libsystemd0 is part of every Debian, as apt needs it: the kit carries it anyway.)
    for lib in ("libgrpc", "libprotobuf", "libabsl", "libprometheus", "libboost",
                "libtomlplusplus", "libcares", "libre2", "libbenchmark"):
        assert lib not in listing, f"{lib} is in the host image: the kit test proves nothing"
    assert "g++" in listing and "python3-dev" in listing


def test_the_kit_builds_serves_and_benches_without_network(podman, host_image, kit, tmp_path,
                                                          timings):
    work = tmp_path / "kit"
    shutil.copytree(kit, work, symlinks=True)
    out = tmp_path / "out"
    start = time.monotonic()
    result = _run_kit(podman, host_image, work, out, timeout_s=1800)
    timings.record("gpu kit run.sh in the host image", time.monotonic() - start)
    log = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, log
    # What comes back from a GPU machine: three files.
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "results.jsonl",
                                                     "summary.txt"], log
    summary = (out / "summary.txt").read_text().strip()
    assert len(summary.splitlines()) == 1 and summary.endswith("ok"), summary
    timings.notes["gpu kit summary"] = summary
    with tarfile.open(out / "logs.tar.gz") as logs:
        names = logs.getnames()
    assert "logs/build.log" in names and "logs/memoffloadd-bench.log" in names, names

    rows = _results(out)
    steps = _steps(rows)
    # 1. memoffload._C was built here, with --network=none, and loads.
    assert steps["build"]["status"] == "ok", steps
    assert (work / "work" / "python" / "memoffload" / "_C.so").is_file()
    built = next(r for r in rows if r.get("step") == "build_info")
    assert built["sources"] >= 10 and built["torch"].startswith("2.")
    # 2. The kit's daemon served.
    assert steps["daemon"]["status"] == "ok"
    status = next(r for r in rows if r.get("step") == "daemon_status")["status"]
    assert int(status["capacity_bytes"]) == 256 * 2**20, status
    # 3. The --cpu-smoke run of bench/gpu_bench.py and the attach bench.
    assert steps["bench"]["status"] == "ok"
    benches = {}
    for r in rows:
        benches.setdefault(r.get("bench"), []).append(r)
    assert BENCH_ROWS <= set(benches), sorted(k for k in benches if k)
    assert benches["gpu_info"][0]["device"].startswith("cpu")
    assert benches["gpu_copies"][0]["d2h_arena_vs_pinned"] > 0
    assert benches["gpu_step"][0]["offloaded_bytes"] > 0
    assert benches["gpu_register"][0]["register_s_per_gib"] >= 0
    assert [a["hugepages"] for a in benches["attach"]] == [False, True]
    assert len(benches["startup"]) == 2 and benches["startup"][0]["build_gbps"] > 0
    # 4. The gpu tests: collected, and skipped for want of a device.
    assert steps["tests"]["status"] == "skipped", steps["tests"]
    assert "no CUDA device" in steps["tests"]["detail"], steps["tests"]
    assert re.search(r"\d+ gpu test\(s\) not run", steps["tests"]["detail"]), steps["tests"]

    # A second call in stages (as on the GPU machine, whose calls are short):
    # the bench alone reuses the _C the first call built.
    again = tmp_path / "out-bench"
    result = _run_kit(podman, host_image, work, again, stage="bench")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert list(_steps(_results(again))) == ["check", "daemon", "bench"]


def test_a_kit_without_one_library_fails_naming_the_step(podman, host_image, kit, tmp_path):
    work = tmp_path / "kit"
    shutil.copytree(kit, work, symlinks=True)
    doomed = sorted(work.glob("lib/libgrpc++.so.*"))
    assert doomed, sorted(p.name for p in (work / "lib").iterdir())
    doomed[0].unlink()
    out = tmp_path / "out"
    result = _run_kit(podman, host_image, work, out, timeout_s=300)
    assert result.returncode != 0, result.stdout[-3000:]
    steps = _steps(_results(out))
    assert steps["check"]["status"] == "failed", steps
    assert doomed[0].name in steps["check"]["detail"], steps["check"]
    assert "FAILED: check" in (out / "summary.txt").read_text()
    assert "build" not in steps, "the build ran after a failed check"


def test_a_stage_before_the_build_says_to_build_first(podman, host_image, kit, tmp_path):
    work = tmp_path / "kit"
    shutil.copytree(kit, work, symlinks=True)
    out = tmp_path / "out"
    result = _run_kit(podman, host_image, work, out, stage="tests")
    assert result.returncode != 0
    assert "--only build' first" in result.stderr + result.stdout
    assert "FAILED: build" in (out / "summary.txt").read_text()


def test_a_gpu_that_torch_cannot_use_fails_the_check(kit, tmp_path):
    """On a machine whose nvidia-smi sees a GPU but whose torch cannot use it,
    the gpu tests would only be skipped and the bench a CPU smoke run: the
    check must fail instead. nvidia-smi is a stand-in script here (the host,
    not the image: this CPU torch sees no GPU)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04'\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", MEMOFFLOAD_KIT_PYTHON=sys.executable,
               MEMOFFLOAD_KIT_WORK=str(tmp_path / "work"))
    result = subprocess.run([str(kit / "run.sh"), str(out), "--only", "build"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result.stdout + result.stderr
    check = _steps(_results(out))["check"]
    assert check["status"] == "failed" and "cannot use it" in check["detail"], check
    assert "build" not in _steps(_results(out))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid and set vm.nr_hugepages")
def test_the_kit_stops_only_its_own_processes_and_puts_nr_hugepages_back(kit, tmp_path):
    """Issue 38: at exit run.sh stopped `pgrep -f "^$KIT/bin/"`: a pattern over
    command lines, which as root matched every uid's processes, and it put
    vm.nr_hugepages back only when its bench step ran to the end. Now it
    stops this uid's processes whose executable is in $KIT/bin, and a raised
    nr_hugepages left behind (the file its bench writes first) is restored by
    the next run. The run here stops at its check (a GPU torch cannot use)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04'\n")
    (fake / "nvidia-smi").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    # Another uid's process that only names itself after the kit's daemon.
    theirs = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               "bash", "-c", f'exec -a "{kit}/bin/memoffloadd" sleep 300'])
    # A daemon of the kit this uid left running.
    ours = subprocess.Popen([str(kit / "bin" / "memoffloadd"), f"--runtime-dir={rt}",
                             "--arena-size=16MiB", "--chunk-size=8MiB", "--metrics-address=none",
                             "--prefault-threads=1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    hugepages = Path("/proc/sys/vm/nr_hugepages")
    before = hugepages.read_text().strip()
    try:
        deadline = time.monotonic() + 30
        while not (rt / "memoffload.sock").exists():
            assert ours.poll() is None and time.monotonic() < deadline, "the kit's daemon did not start"
            time.sleep(0.05)
        # What a bench step killed by its time limit leaves behind.
        (work / "nr_hugepages.before").write_text(before + "\n")
        hugepages.write_text(str(int(before) + 1))
        out = tmp_path / "out"
        env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}",
                   MEMOFFLOAD_KIT_PYTHON=sys.executable, MEMOFFLOAD_KIT_WORK=str(work))
        result = subprocess.run([str(kit / "run.sh"), str(out), "--only", "build"], env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode != 0, result.stdout + result.stderr
        assert hugepages.read_text().strip() == before
        assert not (work / "nr_hugepages.before").exists()
        assert f"vm.nr_hugepages restored to {before}" in result.stderr, result.stderr[-2000:]
        assert ours.wait(timeout=30) is not None, "the kit's own daemon was left running"
        assert theirs.poll() is None, "another uid's process was killed"
    finally:
        hugepages.write_text(before)
        for proc in (theirs, ours):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
