"""Fixtures of the container tests (marker `container`, CTest label
`container`): one podman setup, base image and pair of images per session,
removed at its end, and the timings of the expensive steps in the summary.
The static deploy tests (CTest `deploy_tests`) deselect them."""

import time

import pytest

import container_common as cc
import deploy_common as dc

_TIMINGS = cc.Timings()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "container: builds and runs images with podman (CTest label container)")
    config.addinivalue_line(
        "markers", "gpukit: the GPU kit in a bare stand-in image (CTest label gpukit)")


def pytest_terminal_summary(terminalreporter):
    if not _TIMINGS.steps and not _TIMINGS.notes:
        return
    terminalreporter.write_sep("-", "container timings")
    for name, seconds in _TIMINGS.steps.items():
        terminalreporter.write_line(f"{name}: {seconds} s")
    for name, note in _TIMINGS.notes.items():
        terminalreporter.write_line(f"{name}: {note}")


@pytest.fixture(scope="session")
def timings() -> cc.Timings:
    return _TIMINGS


@pytest.fixture(scope="session")
def podman(tmp_path_factory) -> cc.Podman:
    tool = cc.Podman(tmp_path_factory.mktemp("podman"))
    # Fail early, with podman's own words, if it cannot run a container here.
    tool.run("info", "--format", "{{.Store.GraphDriverName}}", timeout_s=60)
    return tool


@pytest.fixture(scope="session")
def images(podman, timings, tmp_path_factory):
    """Names of this session's images: the base, the Dockerfile's build stage
    and its runtime image. Everything the builds made is removed at the end:
    the tagged images and the untagged intermediate layers they left."""
    before = _untagged_image_ids(podman)
    names = {}
    try:
        names["base"] = cc.import_base_image(podman, timings)
        logs = tmp_path_factory.mktemp("build-logs")
        names["app"] = f"localhost/{cc.RUN_PREFIX}-memoffload:test"
        start = time.monotonic()
        podman.build(logs / "image.log", "-f", str(dc.DOCKERFILE),
                     "--build-arg", f"DEBIAN_IMAGE={names['base']}", "-t", names["app"],
                     str(dc.REPO), timeout_s=1800)
        timings.record("image build (deploy/docker/Dockerfile, both stages)",
                       time.monotonic() - start)
        size = podman.image_size_bytes(names["app"])
        timings.notes["runtime image size"] = f"{size / 1e6:.0f} MB ({size} bytes)"
        # The build stage again, tagged: every layer is in the cache by now.
        names["build"] = f"localhost/{cc.RUN_PREFIX}-build:test"
        podman.build(logs / "build-stage.log", "-f", str(dc.DOCKERFILE), "--target", "build",
                     "--build-arg", f"DEBIAN_IMAGE={names['base']}", "-t", names["build"],
                     str(dc.REPO), timeout_s=600)
        yield names
    finally:
        for name in reversed(list(names.values())):
            podman.remove_image(name)
        # Untagged layers only: an image someone else tagged meanwhile stays.
        for image_id in _untagged_image_ids(podman) - before:
            podman.run("rmi", image_id, check=False, timeout_s=120)


def _untagged_image_ids(podman: cc.Podman) -> set[str]:
    out = podman.run("images", "--all", "--no-trunc", "--format",
                     "{{.ID}} {{.Repository}}").stdout
    return {line.split()[0] for line in out.splitlines() if line.endswith(" <none>")}


@pytest.fixture(scope="session")
def systemd_image(podman, images, timings, tmp_path_factory) -> str:
    """A systemd-booting image with the build stage's `cmake --install` tree."""
    name = f"localhost/{cc.RUN_PREFIX}-systemd:test"
    start = time.monotonic()
    podman.build(tmp_path_factory.mktemp("systemd-build") / "build.log",
                 "-f", str(cc.SYSTEMD_CONTAINERFILE),
                 "--build-arg", f"BASE_IMAGE={images['base']}",
                 "--build-arg", f"BUILD_IMAGE={images['build']}",
                 "--build-arg", "RUNTIME_PACKAGES=" + " ".join(cc.dockerfile_runtime_packages()),
                 "-t", name, str(cc.SYSTEMD_CONTAINERFILE.parent), timeout_s=1200)
    timings.record("systemd image build (tests/deploy/systemd.Containerfile)",
                   time.monotonic() - start)
    yield name
    podman.remove_image(name)
    # Its intermediate layers go with the final sweep of `images`.
