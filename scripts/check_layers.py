#!/usr/bin/env python3
"""Checks that every #include in production code points down the layers.

Each folder of production code is a layer; LAYERS says which layers it may
include. An include that resolves into a layer not on that list is a wrong
arrow: the script names the file, the line and the arrow, and exits 1.
CMake's target links follow the same direction (a library links only the
layers below it), so a wrong include is also what would need a wrong link.

usage: tools/check_layers.py [--root DIR] [--print-graph]
"""
import argparse
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent, type=pathlib.Path)
    ap.add_argument("--print-graph", action="store_true")
    args = ap.parse_args()
    wrong, graph = check(args.root)
    if args.print_graph:
        for layer in LAYERS:
            print(f"{layer} -> {', '.join(sorted(graph.get(layer, ()))) or '-'}")
    for w in wrong:
        print(w, file=sys.stderr)
    if wrong:
        print(f"check_layers: {len(wrong)} wrong arrow(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
