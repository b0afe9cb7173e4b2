"""Paths, tools and the daemon's defaults, read from the sources the daemon
is built from, for the deploy tests."""

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "memoffloadd.service"
SYSUSERS = DEPLOY / "systemd" / "memoffload.sysusers.conf"
EXAMPLE_CONFIG = DEPLOY / "systemd" / "memoffloadd.toml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
SETUP_DEPS = REPO / "scripts" / "setup-deps.sh"
DEPLOY_DOC = REPO / "docs" / "deploy.md"


def bin_dir() -> Path:
    """Where memoffloadd and memoffloadctl were built (MEMOFFLOAD_BIN_DIR)."""
    return Path(os.environ.get("MEMOFFLOAD_BIN_DIR", REPO / "build" / "bin"))


def daemon_binary(required: bool = True) -> Path | None:
    path = bin_dir() / "memoffloadd"
    if not path.is_file():
        if required:
            pytest.fail(f"{path} not built (build first, or set MEMOFFLOAD_BIN_DIR)")
        return None
    return path


def require_tool(name: str) -> str:
    """The tool's path; fails (not skips) when missing: setup-deps installs it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: run scripts/setup-deps.sh (DEPS_TEST)")
    return path


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def default_metrics_address() -> str:
    text = _read(REPO / "daemon/config/config.h")
    m = re.search(r'kDefaultMetricsAddress\[\]\s*=\s*"([^"]+)"', text)
    assert m, "kDefaultMetricsAddress not found in config.h"
    return m.group(1)


def default_metrics_port() -> int:
    return int(default_metrics_address().rsplit(":", 1)[1])


def default_runtime_dir() -> str:
    """The root default of DefaultRuntimeDir() in common/src/runtime_dir.cc
    (kSystemRuntimeDir of runtime_dir.h, or a literal)."""
    text = _read(REPO / "common/src/runtime_dir.cc")
    m = re.search(r'uid\s*==\s*0\)\s*return\s*(?:"([^"]+)"|(\w+));', text)
    assert m, "root default runtime dir not found in runtime_dir.cc"
    if m.group(1):
        return m.group(1)
    header = _read(REPO / "common/include/memoffload/common/runtime_dir.h")
    c = re.search(rf'{m.group(2)}\[\]\s*=\s*"([^"]+)"', header)
    assert c, f"{m.group(2)} not found in runtime_dir.h"
    return c.group(1)


def runtime_dir_env() -> str:
    text = _read(REPO / "common/include/memoffload/common/runtime_dir.h")
    m = re.search(r'kRuntimeDirEnv\[\]\s*=\s*"([^"]+)"', text)
    assert m, "kRuntimeDirEnv not found in runtime_dir.h"
    return m.group(1)


def socket_names() -> tuple[str, str]:
    """(broker socket, gRPC socket) file names."""
    text = _read(REPO / "common/include/memoffload/common/runtime_dir.h")
    broker = re.search(r'kBrokerSocketName\[\]\s*=\s*"([^"]+)"', text)
    grpc = re.search(r'kGrpcSocketName\[\]\s*=\s*"([^"]+)"', text)
    assert broker and grpc, "socket names not found in runtime_dir.h"
    return broker.group(1), grpc.group(1)


def default_drain_timeout_s() -> float | None:
    """drain_timeout_ms's default in config.h, or None if the daemon has none."""
    text = _read(REPO / "daemon/config/config.h")
    m = re.search(r"drain_timeout_ms\s*=\s*(\d+)", text)
    return int(m.group(1)) / 1000 if m else None


def deps_array(name: str) -> list[str]:
    """An array of scripts/setup-deps.sh as bash itself expands it."""
    text = _read(SETUP_DEPS)
    m = re.search(rf"^{name}=\((.*?)\)", text, re.S | re.M)
    assert m, f"{name}=( ... ) not found in setup-deps.sh"
    out = subprocess.run(
        ["bash", "-c", f'{name}=({m.group(1)})\nprintf "%s\\n" "${{{name}[@]}}"'],
        check=True, capture_output=True, text=True)
    return out.stdout.split()


def parse_duration_s(value: str) -> float:
    """'30s', '1min', '500ms', '2min 30s', '15min', or a bare number of seconds."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value.strip()):
        total += float(number) * units[unit or "s"]
    return total


def parse_size_bytes(value: str) -> int:
    """Kubernetes quantities (1280Mi, 2Gi) and the daemon's sizes (1GiB, 512MiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", value)
    assert m, f"cannot parse size {value!r}"
    power = "KMGT".find(m.group(2)) + 1 if m.group(2) else 0
    base = 1024 if m.group(3) or value.strip().endswith("B") else 1000
    return int(float(m.group(1)) * base**power)


def unit_settings(path: Path = UNIT) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (keys may repeat) of a systemd unit file."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in _read(path).splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def k8s_documents() -> dict[str, list[dict]]:
    """kind -> documents of every YAML under deploy/k8s (examples included)."""
    docs: dict[str, list[dict]] = {}
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(_read(path)):
            if doc:
                doc["__file__"] = path.relative_to(K8S).as_posix()
                docs.setdefault(doc["kind"], []).append(doc)
    return docs


def one(docs: dict[str, list[dict]], kind: str) -> dict:
    assert len(docs.get(kind, [])) == 1, f"expected one {kind}, found {docs.get(kind)}"
    return docs[kind][0]


def configmap_toml(docs: dict[str, list[dict]]) -> dict:
    cm = one(docs, "ConfigMap")
    assert list(cm["data"]) == ["memoffloadd.toml"], cm["data"].keys()
    return tomllib.loads(cm["data"]["memoffloadd.toml"])


def example_toml() -> dict:
    return tomllib.loads(_read(EXAMPLE_CONFIG))


def recorded_exposure() -> float:
    """The systemd-analyze exposure score recorded in docs/deploy.md."""
    m = re.search(r"Recorded exposure score:\s*\*\*(\d+\.\d+)\*\*", _read(DEPLOY_DOC))
    assert m, "docs/deploy.md must contain 'Recorded exposure score: **N.N**'"
    return float(m.group(1))


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions, in order."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            current = rest.split()[-1]
            stages[current] = []
        elif current is not None:
            stages[current].append((word, rest))
    return stages


def apt_packages(stage: list[tuple[str, str]]) -> list[str]:
    """Packages named by the stage's `apt-get install` commands."""
    packages = []
    for word, rest in stage:
        if word != "RUN" or "apt-get install" not in rest:
            continue
        for command in rest.split("&&"):
            tokens = shlex.split(command)
            if "install" in tokens and "apt-get" in tokens:
                args = tokens[tokens.index("install") + 1:]
                packages += [a for a in args if not a.startswith("-")]
    return packages
