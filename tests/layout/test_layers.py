"""The folders are layers (scripts/check_layers.py): every #include of the
production code points down, and so does every import of the Python
package's parts. The repository passes, and a wrong arrow, planted in a
copy, fails with the file, the line and the arrow named."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "check_layers.py"
LAYERS = ["common", "shared_mem", "daemon", "client/cpp", "client/torch", "tools"]


def run(root):
    return subprocess.run([sys.executable, str(CHECK), "--root", str(root), "--print-graph"],
                          capture_output=True, text=True)


def copy_sources(tmp_path):
    for part in LAYERS:
        shutil.copytree(REPO / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("*.py", "*.pyc", "__pycache__", "python"))
    return tmp_path


def test_the_repository_keeps_its_layers():
    result = run(REPO)
    assert result.returncode == 0, result.stderr
    graph = dict(line.split(" -> ") for line in result.stdout.splitlines())
    # The arrows that exist are the ones the layers were made for.
    assert "daemon/core" in graph["daemon/edge"], graph
    assert "daemon/memory" in graph["daemon/core"], graph
    assert graph["common"] == "-", graph


def test_a_lower_layer_including_a_higher_one_is_named(tmp_path):
    root = copy_sources(tmp_path)
    arena = root / "daemon" / "memory" / "arena.cc"
    arena.write_text('#include "edge/broker.h"\n' + arena.read_text())
    result = run(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "daemon/memory/arena.cc:1: daemon/memory -> daemon/edge (edge/broker.h)" in result.stderr


def test_the_client_including_the_daemon_is_named(tmp_path):
    root = copy_sources(tmp_path)
    client = root / "client" / "cpp" / "src" / "client.cc"
    client.write_text(client.read_text() + '\n#include "memoffload/torch/group_offloader.h"\n')
    result = run(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "client/cpp -> client/torch" in result.stderr


def test_common_including_anything_of_ours_is_named(tmp_path):
    root = copy_sources(tmp_path)
    status = root / "common" / "src" / "status.cc"
    status.write_text('#include "memoffload/shared_mem/chunk.h"\n' + status.read_text())
    result = run(root)
    assert result.returncode == 1
    assert "common -> shared_mem" in result.stderr


# The Python package (issue 39): its parts are layers too.


def copy_python(tmp_path):
    shutil.copytree(REPO / "client" / "python" / "memoffload", tmp_path / "client" / "python" / "memoffload",
                    ignore=shutil.ignore_patterns("*.pyc", "__pycache__", "*.so"))
    return tmp_path


def test_the_python_package_keeps_its_parts():
    result = run(REPO)
    assert result.returncode == 0, result.stderr
    graph = dict(line.split(" -> ") for line in result.stdout.splitlines())
    assert graph["memoffload"] == "-", graph  # the torch-free top imports nothing of torch
    base = {"memoffload", "memoffload/torch/_native", "memoffload/torch/_settings"}
    for part in ("memoffload/torch/activations", "memoffload/torch/state"):
        assert set(graph[part].split(", ")) <= base, graph
    assert "memoffload/torch/checkpoint/nodes" in graph["memoffload/torch/checkpoint"], graph
    assert "memoffload/torch/checkpoint/store" in graph["memoffload/torch/checkpoint/nodes"], graph


def test_state_importing_activations_is_named(tmp_path):
    root = copy_python(tmp_path)
    placement = root / "client" / "python" / "memoffload" / "torch" / "state" / "placement.py"
    placement.write_text("from ..activations import hooks\n" + placement.read_text())
    result = run(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("client/python/memoffload/torch/state/placement.py:1: memoffload/torch/state -> "
            "memoffload/torch/activations (memoffload.torch.activations.hooks)") in result.stderr


def test_the_checkpoint_core_importing_the_nodes_part_is_named(tmp_path):
    """Inside a function, and by an absolute name: still an arrow."""
    root = copy_python(tmp_path)
    store = root / "client" / "python" / "memoffload" / "torch" / "checkpoint" / "store.py"
    store.write_text(store.read_text() + "\n\ndef _late():\n"
                     "    from memoffload.torch.checkpoint.nodes.link import Link\n    return Link\n")
    result = run(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("memoffload/torch/checkpoint/store -> memoffload/torch/checkpoint/nodes "
            "(memoffload.torch.checkpoint.nodes.link)") in result.stderr


def test_the_torch_free_top_importing_torch_is_named(tmp_path):
    root = copy_python(tmp_path)
    logs = root / "client" / "python" / "memoffload" / "logs.py"
    logs.write_text(logs.read_text() + "\nfrom . import torch as _torch  # noqa\n")
    result = run(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "memoffload -> memoffload/torch (memoffload.torch)" in result.stderr
