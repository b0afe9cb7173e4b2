"""The qualified name of a module inside the model that holds it
(``"model.layers.3"``, as ``named_modules()`` of the outermost parent names
it), for messages about a layer: the caller passes layers, not the model, so
the parents are found among the objects the garbage collector tracks. Meant
for error paths only: one pass over those objects costs far more than a
forward."""

from __future__ import annotations

import gc
from typing import Dict, FrozenSet, List, Optional, Tuple

from torch import nn


def _parents() -> Dict[int, List[Tuple[nn.Module, str]]]:
    """{id(child): [(a module holding it, its name there)]} over every live module."""
    parents: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module):  # not isinstance: no __class__ lookup (lazy proxies)
            for name, child in obj.__dict__.get("_modules", {}).items():
                if child is not None:
                    parents.setdefault(id(child), []).append((obj, name))
    return parents


def _longest_path(module: nn.Module, parents: Dict[int, List[Tuple[nn.Module, str]]],
                  seen: FrozenSet[int]) -> List[str]:
    best: List[str] = []
    for parent, name in parents.get(id(module), []):
        if id(parent) not in seen:  # a cycle of modules ends there
            path = _longest_path(parent, parents, seen | {id(parent)}) + [name]
            if len(path) > len(best):
                best = path
    return best


def qualified_name(module: nn.Module) -> Optional[str]:
    """``module``'s dotted path from its outermost parent, or None when no
    module holds it. A module held by several (the model's ModuleList and a
    slice of it, ``layers[2:]``, which holds it as ``"0"``) is named by the
    longest path: the model's."""
    names = _longest_path(module, _parents(), frozenset({id(module)}))
    return ".".join(names) if names else None


def describe(module: nn.Module, index: int) -> str:
    """``"layer model.layers.3 (Block)"``, or ``"layer 3 of the layers passed
    (Block)"`` for a module no other module holds."""
    name = qualified_name(module)
    where = f"layer {name}" if name else f"layer {index} of the layers passed"
    return f"{where} ({type(module).__name__})"
