"""The Python package's shape (issue 31): the top package imports without
torch, no module of it imports memoffload.torch and is imported back by it
(memoffload.hf and memoffload.torch load in either order in a fresh
interpreter), and memoffload.torch offers the same public names it always
did, whichever of its modules defines them."""

from __future__ import annotations

import __future__
import ast
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Dict, List, Set

import memoffload

import memoffload.torch as mot

# A fresh interpreter in which `import torch` (or any torch.* module) fails,
# as in an environment without torch.
_BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test ({name})")
            return None

    sys.meta_path.insert(0, _NoTorch())
    """
)

# The modules of the top package that need torch: the framework callbacks
# (memoffload.hf, memoffload.lightning) and the torch part itself.
_TORCH_MODULES = {"hf", "lightning", "torch", "_C"}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_top_package_imports_without_torch() -> None:
    """Every module of the top package but the torch ones imports with torch
    blocked, and memoffload.torch says that torch is missing."""
    code = _BLOCK_TORCH + textwrap.dedent(
        f"""
        import importlib, pkgutil, memoffload
        skip = {sorted(_TORCH_MODULES)!r}
        names = [m.name for m in pkgutil.iter_modules(memoffload.__path__) if m.name not in skip]
        for name in names:
            importlib.import_module("memoffload." + name)
        assert "torch" not in sys.modules
        try:
            import memoffload.torch
        except ImportError as exc:
            assert "torch is blocked" in str(exc), exc
        else:
            raise AssertionError("memoffload.torch imported without torch")
        print(" ".join(sorted(names)))
        """
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) >= {"errors", "logs", "step_log"}


def test_hf_and_torch_import_in_either_order() -> None:
    """No import cycle between memoffload.hf and memoffload.torch: each
    order works in a fresh interpreter and ends with the same callback."""
    for first, second in (("memoffload.hf", "memoffload.torch"),
                          ("memoffload.torch", "memoffload.hf")):
        code = textwrap.dedent(
            f"""
            import importlib
            a = importlib.import_module({first!r})
            b = importlib.import_module({second!r})
            import memoffload.hf as hf, memoffload.torch as mot
            assert mot.MemoffloadCallback is hf.MemoffloadCallback
            """
        )
        out = _run(code)
        assert out.returncode == 0, f"{first} then {second}: {out.stderr}"


def test_torch_package_does_not_import_the_callback_modules() -> None:
    """memoffload.torch (and each of its modules) never imports
    memoffload.hf or memoffload.lightning back."""
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import memoffload.torch as mot
        for m in pkgutil.iter_modules(mot.__path__):
            importlib.import_module("memoffload.torch." + m.name)
        assert "memoffload.hf" not in sys.modules, "memoffload.torch imported memoffload.hf"
        assert "memoffload.lightning" not in sys.modules
        """
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr


def _imports(path: Path, module: str, package: bool, modules: Set[str]) -> Set[str]:
    """The modules among `modules` that the file of `module` imports, at its
    top or inside a function (a lazy import is an edge as well). `from P
    import n` is an edge to P.n when that is a module, else to P."""
    out: Set[str] = set()
    here = module if package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return (out & modules) - {module}


def test_package_has_no_import_cycle() -> None:
    """The import graph of the package's modules (lazy imports included) has
    no cycle: memoffload.hf used to import memoffload.torch, which imported
    memoffload.hf back on first use of MemoffloadCallback."""
    root = Path(memoffload.__file__).parent
    files: Dict[str, Path] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts)
        files[name.removesuffix(".__init__")] = path
    graph = {name: sorted(_imports(path, name, path.name == "__init__.py", set(files)))
             for name, path in files.items()}
    state: Dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: List[str]) -> None:
        state[name] = 1
        for dep in graph[name]:
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep] if dep in path else [name, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


# memoffload.torch's public names before it was split into modules (issue
# 31), besides the modules and typing helpers it happened to import.
_PUBLIC_NAMES = [
    "DEFAULT_JOB_ID",
    "DEFAULT_MIN_TENSOR_BYTES",
    "GroupStats",
    "HandleStats",
    "LayerSelection",
    "OWN_HOOK_ATTR",
    "OffloadHandle",
    "OffloadStats",
    "StatePlacement",
    "TESTED_TORCH",
    "checkpointed",
    "daemon_status",
    "errors",
    "find_layer_stack",
    "foreign_hooks_active",
    "forget_offloader",
    "get_offloader",
    "in_backward",
    "logs",
    "offload_activations",
    "offload_layers",
    "place_state",
]
_ALL = [
    "GroupStats",
    "HandleStats",
    "OffloadHandle",
    "OffloadStats",
    "StatePlacement",
    "daemon_status",
    "find_layer_stack",
    "get_offloader",
    "offload_activations",
    "offload_layers",
    "place_state",
]


def _incidental(name: str, value: object) -> bool:
    """A module other than memoffload's own, a submodule of memoffload.torch
    (an attribute once something imported it, e.g. memoffload.torch.checkpoint),
    a typing helper or a __future__ feature that a module of memoffload.torch
    imported for itself."""
    if isinstance(value, types.ModuleType):
        name = value.__name__
        return not name.startswith("memoffload.") or name.startswith("memoffload.torch.")
    return getattr(typing, name, None) is value or getattr(__future__, name, None) is value


def test_torch_public_names_are_unchanged() -> None:
    public = sorted(n for n in dir(mot) if not n.startswith("_")
                    and not _incidental(n, getattr(mot, n)))
    assert public == _PUBLIC_NAMES
    assert sorted(mot.__all__) == _ALL
    # Loaded on first use (memoffload.hf), never listed in __all__.
    assert mot.MemoffloadCallback.__name__ == "MemoffloadCallback"
    # What tests and benchmarks reach for besides the public names.
    for name in ("_C", "_Counters", "_ParamSkip", "_make_pack", "_unpack"):
        assert hasattr(mot, name), name
