#!/usr/bin/env python3
"""Checks that every #include and every Python import of production code
points down the layers.

Each folder of production code is a layer; LAYERS says which layers it may
include. An include that resolves into a layer not on that list is a wrong
arrow: the script names the file, the line and the arrow, and exits 1.
CMake's target links follow the same direction (a library links only the
layers below it), so a wrong include is also what would need a wrong link.

The Python package (client/python/memoffload) is checked the same way:
PY_LAYERS names its parts (a package, or one module) and which parts each
may import; every import, relative or absolute, at any depth of a module
(inside functions too), is resolved to the part it lands in.

usage: tools/check_layers.py [--root DIR] [--print-graph]
"""
import argparse
import ast
import pathlib
import re
import sys

# layer -> the layers it may include (its own is always allowed)
LAYERS = {
    "common": [],
    "shared_mem": ["common"],
    "proto": [],
    "daemon/base": ["common"],
    "daemon/config": ["daemon/base", "shared_mem", "common"],
    "daemon/memory": ["daemon/config", "daemon/base", "shared_mem", "common"],
    "daemon/core": ["daemon/memory", "daemon/config", "daemon/base", "shared_mem", "common"],
    "daemon/observe": ["daemon/core", "daemon/memory", "daemon/config", "daemon/base",
                       "shared_mem", "common"],
    "daemon/edge": ["daemon/observe", "daemon/core", "daemon/memory", "daemon/config",
                    "daemon/base", "shared_mem", "common", "proto"],
    "daemon/app": ["daemon/edge", "daemon/observe", "daemon/core", "daemon/memory",
                   "daemon/config", "daemon/base", "shared_mem", "common", "proto"],
    "client/cpp": ["shared_mem", "common", "proto"],
    "client/torch": ["client/cpp", "shared_mem", "common"],
    "tools": ["client/cpp", "shared_mem", "common", "proto"],
}

# Where each include root lives: an include "<prefix>..." resolves under it.
INCLUDE_ROOTS = [
    ("memoffload/common/", "common/include/"),
    ("memoffload/shared_mem/", "shared_mem/include/"),
    ("memoffload/client/", "client/cpp/include/"),
    ("memoffload/torch/", "client/torch/include/"),
    ("memoffload.pb.h", "proto/"),
    ("memoffload.grpc.pb.h", "proto/"),
]
DAEMON_CONCERNS = ["base", "config", "memory", "core", "observe", "edge", "app"]


def layer_of(rel):
    for layer in sorted(LAYERS, key=len, reverse=True):
        if rel == layer or rel.startswith(layer + "/"):
            return layer
    return None


def target_layer(include, including_rel):
    for prefix, root in INCLUDE_ROOTS:
        if include.startswith(prefix):
            return layer_of(root.rstrip("/"))
    first = include.split("/", 1)[0]
    if "/" in include and first in DAEMON_CONCERNS and including_rel.startswith("daemon/"):
        return "daemon/" + first
    return None  # system, third-party, or relative to the file's own folder


def check(root):
    wrong = []
    graph = {}
    # Only the layers' own folders: not the build trees, .venv or tests.
    paths = {p for layer in LAYERS if (root / layer).is_dir() for p in (root / layer).rglob("*")}
    for path in sorted(paths):
        if path.suffix not in (".cc", ".h", ".cu") or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        layer = layer_of(rel)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if not m:
                continue
            target = target_layer(m.group(1), rel)
            if target is None or target == layer:
                continue
            graph.setdefault(layer, set()).add(target)
            if target not in LAYERS[layer]:
                wrong.append(f"{rel}:{n}: {layer} -> {target} ({m.group(1)}) is not allowed; "
                              f"{layer} may include {', '.join(LAYERS[layer]) or 'nothing of ours'}")
    return wrong, graph


# The Python package's parts (paths under client/python, without ".py"; the
# longest that matches a module is its part) -> the parts it may import.
_PY_TOP = ["memoffload"]  # errors, logs, step_log, the package itself: torch-free
_PY_BASE = ["memoffload/torch/_native", "memoffload/torch/_settings"] + _PY_TOP
_PY_CKPT_CORE = ["memoffload/torch/checkpoint/trusted_files", "memoffload/torch/checkpoint/store",
                 "memoffload/torch/checkpoint/items", "memoffload/torch/checkpoint/frames"]
PY_LAYERS = {
    "memoffload": [],
    "memoffload/hf": ["memoffload/torch/activations/hf"] + _PY_TOP,
    # The Hugging Face callback also runs a CheckpointManager (checkpoint/training).
    "memoffload/torch/activations/hf": ["memoffload/torch/activations",
                                        "memoffload/torch/checkpoint"] + _PY_BASE,
    "memoffload/lightning": ["memoffload/torch", "memoffload/torch/checkpoint"] + _PY_TOP,
    "memoffload/torch": ["memoffload/torch/activations", "memoffload/torch/activations/hf",
                         "memoffload/torch/state",
                         "memoffload/torch/checkpoint"] + _PY_BASE,
    "memoffload/torch/_native": _PY_TOP,
    "memoffload/torch/_settings": _PY_TOP,
    "memoffload/torch/activations": _PY_BASE,
    "memoffload/torch/state": _PY_BASE,
    "memoffload/torch/checkpoint/trusted_files": _PY_TOP,
    "memoffload/torch/checkpoint/store": ["memoffload/torch/checkpoint/trusted_files"] + _PY_BASE,
    "memoffload/torch/checkpoint/items": _PY_BASE,
    "memoffload/torch/checkpoint/frames": _PY_BASE,
    "memoffload/torch/checkpoint/stage": ["memoffload/torch/checkpoint/items",
                                          "memoffload/torch/checkpoint/frames"] + _PY_BASE,
    "memoffload/torch/checkpoint/nodes": _PY_CKPT_CORE + _PY_BASE,
    "memoffload/torch/checkpoint": ["memoffload/torch/checkpoint/nodes",
                                    "memoffload/torch/checkpoint/stage"] + _PY_CKPT_CORE + _PY_BASE,
}
PY_ROOT = "client/python"


def py_part_of(dotted):
    rel = dotted.replace(".", "/")
    for part in sorted(PY_LAYERS, key=len, reverse=True):
        if rel == part or rel.startswith(part + "/"):
            return part
    return None


def py_module_of(path, base):
    rel = path.relative_to(base).with_suffix("").as_posix()
    parts = rel.split("/")
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def py_targets(node, module, is_package, exists):
    """The dotted modules an import statement of `module` lands in."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    package = module if is_package else module.rpartition(".")[0]
    if node.level:
        parts = package.split(".")
        if node.level - 1 > len(parts) - 1:
            return []
        base = ".".join(parts[:len(parts) - (node.level - 1)])
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    # `from X import name`: the module X.name when there is one, else X.
    return [f"{base}.{a.name}" if exists(f"{base}.{a.name}") else base for a in node.names]


def check_python(root):
    wrong = []
    graph = {}
    base = root / PY_ROOT
    if not (base / "memoffload").is_dir():
        return wrong, graph

    def exists(dotted):
        rel = base / dotted.replace(".", "/")
        return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()

    for path in sorted((base / "memoffload").rglob("*.py")):
        module, is_package = py_module_of(path, base)
        part = py_part_of(module)
        rel = path.relative_to(root).as_posix()
        try:
            tree = ast.parse(path.read_text(), filename=rel)
        except SyntaxError as e:
            wrong.append(f"{rel}:{e.lineno}: cannot parse: {e.msg}")
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in py_targets(node, module, is_package, exists):
                if not target.startswith("memoffload"):
                    continue
                to = py_part_of(target)
                if to is None or to == part:
                    continue
                graph.setdefault(part, set()).add(to)
                if to not in PY_LAYERS[part]:
                    wrong.append(f"{rel}:{node.lineno}: {part} -> {to} ({target}) is not allowed; "
                                 f"{part} may import {', '.join(PY_LAYERS[part]) or 'nothing of ours'}")
    return wrong, graph


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent, type=pathlib.Path)
    ap.add_argument("--print-graph", action="store_true")
    args = ap.parse_args()
    wrong, graph = check(args.root)
    py_wrong, py_graph = check_python(args.root)
    wrong += py_wrong
    if args.print_graph:
        for layer in LAYERS:
            print(f"{layer} -> {', '.join(sorted(graph.get(layer, ()))) or '-'}")
        for part in PY_LAYERS:
            print(f"{part} -> {', '.join(sorted(py_graph.get(part, ()))) or '-'}")
    for w in wrong:
        print(w, file=sys.stderr)
    if wrong:
        print(f"check_layers: {len(wrong)} wrong arrow(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
