"""The pip package as a user meets it (client/python/pyproject.toml).

- The installed package is self-contained: memoffload._C sits in
  site-packages, and the source tree holds no built extension.
- `import memoffload` does not import torch.
- A build against an environment without torch, or with a torch older than
  2.1, fails at configure time with a message that names what was found.
  The old torch is a stand-in package (only `__version__` and
  `utils.cmake_prefix_path`): no torch older than 2.13 can be installed here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


def test_installed_package_carries_its_extension_and_the_tree_does_not() -> None:
    out = run([sys.executable, "-c", "import sysconfig, torch, memoffload._C as c, memoffload; "
               "print(c.__file__); print(memoffload.__file__); print(sysconfig.get_paths()['platlib'])"])
    assert out.returncode == 0, out.stderr
    ext, init, site = out.stdout.split()
    assert Path(ext).parent == Path(init).parent
    assert Path(ext).parent == Path(site) / "memoffload", f"not loaded from site-packages: {ext}"
    built = list((REPO / "client" / "python" / "memoffload").glob("_C*"))
    assert built == [], f"build output in the source tree: {built}"


def test_installed_package_is_marked_typed() -> None:
    """PEP 561: py.typed sits in the installed package, so type checkers read
    its annotations (stats() is a TypedDict)."""
    out = run([sys.executable, "-c", "import importlib.resources as r, memoffload; "
               "print(r.files('memoffload').joinpath('py.typed').is_file()); print(memoffload.__file__)"])
    assert out.returncode == 0, out.stderr
    present, init = out.stdout.split()
    assert present == "True", f"no py.typed beside {init}"
    assert (REPO / "client" / "python" / "memoffload") not in Path(init).parents


def test_import_memoffload_does_not_import_torch() -> None:
    out = run([sys.executable, "-c", "import sys, memoffload; print('torch' in sys.modules)"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def make_env(path: Path) -> Path:
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(path)
    return path / "bin" / "python"


def configure(python: Path, build_dir: Path) -> subprocess.CompletedProcess:
    """The configure step pip runs for the package, against `python`."""
    return run(["cmake", "-S", str(REPO), "-B", str(build_dir),
                "-DMEMOFFLOAD_PYTHON_PACKAGE=ON", f"-DMEMOFFLOAD_PYTHON={python}"])


def test_build_without_torch_names_the_interpreter(tmp_path: Path) -> None:
    python = make_env(tmp_path / "env")
    out = configure(python, tmp_path / "build")
    assert out.returncode != 0
    assert f"{python} cannot import torch" in " ".join(out.stderr.split())
    assert "pip install torch==2.13.0" in out.stderr


def test_too_old_torch_is_refused_at_build_and_at_import(tmp_path: Path) -> None:
    python = make_env(tmp_path / "env")
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    fake = Path(site.stdout.strip()) / "torch"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '1.13.1'\nfrom . import utils\nfrom torch import nn\n")
    (fake / "nn.py").write_text("")
    (fake / "utils" / "__init__.py").write_text(f"cmake_prefix_path = {str(tmp_path)!r}\n")
    out = configure(python, tmp_path / "build")
    assert out.returncode != 0
    assert "found torch 1.13.1" in " ".join(out.stderr.split())
    # At import: memoffload.torch names the torch it found (copy the Python
    # sources only; the check runs before the extension is loaded).
    pkg = tmp_path / "pkg"
    sources = REPO / "client" / "python" / "memoffload"
    for src in sources.rglob("*.py"):  # memoffload.torch is a subpackage
        dst = pkg / "memoffload" / src.relative_to(sources)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(src.read_text())
    out = run([str(python), "-c", "import memoffload.torch"], env={**os.environ, "PYTHONPATH": str(pkg)})
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "found torch 1.13.1" in out.stderr, out.stderr
