"""Loads the native part, ``memoffload._C``, after checking that the torch
it runs under is new enough and the one it was built against. Every module
of memoffload.torch takes ``_C`` from here."""

from __future__ import annotations

import atexit
import os

import torch

from .. import logs

_MIN_TORCH = (2, 1)
_TESTED_TORCH = "2.13.0"


def _torch_release(version: str) -> tuple:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


if _torch_release(torch.__version__) < _MIN_TORCH:
    raise ImportError(
        f"memoffload needs torch >= {_MIN_TORCH[0]}.{_MIN_TORCH[1]} ({_TESTED_TORCH} is tested); "
        f"found torch {torch.__version__} at {os.path.dirname(torch.__file__)}"
    )
try:
    from .. import _C
except ImportError as exc:  # built against another torch, or not built at all
    raise ImportError(
        f"memoffload's native part (memoffload._C) does not load with torch {torch.__version__}: "
        f"{exc}. Reinstall it against this torch: "
        "pip install --no-build-isolation --force-reinstall <memoffload>/client/python"
    ) from exc

# What the native part logged after the last take reaches the logger at
# exit too (before logging's own atexit handler shuts it down).
atexit.register(logs.forward, _C)

if _C.built_torch_version != torch.__version__.split("+")[0]:
    raise ImportError(
        f"memoffload._C was built against torch {_C.built_torch_version}, but torch "
        f"{torch.__version__} is imported: reinstall it against this torch "
        "(pip install --no-build-isolation --force-reinstall <memoffload>/client/python)"
    )
