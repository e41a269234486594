"""The plan's vocabulary for how a tensor is split: one entry per dimension,
``None`` (not split), a mesh-axis name, or a tuple of names.

Plain Python (no jax): the plan data and the jax binding
(:mod:`meshplan.shardings`) both read it.
"""
from __future__ import annotations

from typing import Any, Sequence

# One element per tensor dimension: None, an axis name, or a tuple of axis names.
DimSpec = None | str | tuple[str, ...]
Spec = tuple[DimSpec, ...]


def spec_to_json(spec: Spec) -> list[Any]:
    return [list(d) if isinstance(d, tuple) else d for d in spec]


def spec_from_json(data: Sequence[Any]) -> Spec:
    """A spec from its JSON list (ValueError for anything else)."""
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"a spec is a list with one entry per dimension, not {data!r}")
    for d in data:
        names = d if isinstance(d, (list, tuple)) else (d,) if d is not None else ()
        if not all(isinstance(n, str) for n in names):
            raise ValueError(f"a spec's entry is null, a mesh axis name or a list of them, "
                             f"not {d!r}")
    return tuple(tuple(d) if isinstance(d, (list, tuple)) else d for d in data)


def spec_str(spec: Spec) -> str:
    def one(d: DimSpec) -> str:
        if d is None:
            return "None"
        if isinstance(d, tuple):
            return "(" + ", ".join(repr(x) for x in d) + ")"
        return repr(d)
    return "P(" + ", ".join(one(d) for d in spec) + ")"


def spec_axes(spec: Spec) -> tuple[str, ...]:
    out: list[str] = []
    for d in spec:
        if isinstance(d, tuple):
            out.extend(d)
        elif d is not None:
            out.append(d)
    return tuple(out)
