"""The operand layouts a stage's equations are given as they read them.

``Stage.read_constraints`` names (first result of the reader, operand
position, layout): the operands the plan reshards before an operator reads
them.  The runtime constrains each such operand to that layout.  Where the
cost model prices the move through the whole tensor, gathering it and
slicing it (:func:`meshplan.layout_moves.through_whole`: an axis
leaving a dimension that loses another one, several dimensions merging into
one, an axis dropped before another is sliced in), the operand is first
constrained replicated.  XLA's partitioner then
runs the same all-gathers and slice as priced, as asked, instead of reaching
them through its "involuntary full rematerialization" fallback and warning.
"""
from __future__ import annotations

from typing import Any, Mapping

from meshplan.layout_moves import spec_from_names, through_whole
from meshplan.specs import Spec
from meshplan.traced import FlatJaxpr

__all__ = ("read_layouts",)


def read_layouts(stage: Any, flat: FlatJaxpr) -> dict[int, list[tuple[int, Spec]]]:
    """First result id of a reader -> ``(operand position, layout)`` in the
    order they are applied (a replicated step before a gathered-whole move)."""
    mesh = stage.logical_mesh
    pinned: Mapping[int, Spec] = dict(stage.constraints)
    operands = {fe.outvars[0]: fe.invars for fe in flat.eqns if fe.outvars}
    out: dict[int, list[tuple[int, Spec]]] = {}
    for tid, pos, spec in getattr(stage, "read_constraints", ()):
        if tid not in flat.avals:
            continue
        steps = out.setdefault(tid, [])
        invars = operands.get(tid, ())
        src = pinned.get(invars[pos]) if pos < len(invars) and isinstance(invars[pos], int) \
            else None
        if src is not None and through_whole(mesh.shape, spec_from_names(src, mesh.axes),
                                             spec_from_names(spec, mesh.axes)):
            steps.append((pos, (None,) * len(spec)))
        steps.append((pos, spec))
    return out

