"""Which of offload_layers' layers are offloaded: a predicate, indices or
modules (``select``), or the first N (``num_layers``)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence, Set, Union

from torch import nn

from ... import errors

LayerSelection = Union[Callable[[int, nn.Module], bool], Iterable[Union[int, nn.Module]]]


def _selected(
    layers: Sequence[nn.Module], num_layers: Optional[int], select: Optional[LayerSelection]
) -> Set[int]:
    """Indices of the layers to offload: ``select`` (a predicate
    ``(index, layer) -> bool`` or indices / layer modules), else the first
    ``num_layers``, else all but the last."""
    if select is not None:
        if num_layers is not None:
            raise errors.InvalidArgument("pass num_layers or select, not both")
        if callable(select):
            return {i for i, layer in enumerate(layers) if select(i, layer)}
        chosen: Set[int] = set()
        for item in select:
            if isinstance(item, nn.Module):
                found = [i for i, layer in enumerate(layers) if layer is item]
                if not found:
                    raise errors.InvalidArgument(
                        f"select names a {type(item).__name__} that is not among the layers"
                    )
                chosen.update(found)
            elif isinstance(item, int) and -len(layers) <= item < len(layers):
                chosen.add(item % len(layers))
            else:
                raise errors.InvalidArgument(
                    f"select: {item!r} is neither a layer nor an index within 0..{len(layers) - 1}"
                )
        return chosen
    if num_layers is None:
        num_layers = max(0, len(layers) - 1)
    if not 0 <= num_layers <= len(layers):
        raise errors.InvalidArgument(f"num_layers={num_layers} must be within 0..{len(layers)}")
    return set(range(num_layers))
