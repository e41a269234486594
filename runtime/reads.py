"""The operand layouts a stage's equations are given as they read them.

``Stage.read_constraints`` names (first result of the reader, operand
position, layout): the operands the plan reshards before an operator reads
them.  The runtime constrains each such operand to that layout.  Where the
cost model prices the move as XLA's fallback, gathering the tensor whole and
slicing it (:func:`meshplan.layout_moves.gathers_whole`: an axis
leaving a dimension that loses another one, several dimensions merging into
one, an axis dropped before another is sliced in), the operand is first
constrained replicated.  XLA's partitioner then
runs the same all-gathers and slice as priced, as asked, instead of reaching
them through its "involuntary full rematerialization" fallback and warning.
"""
from __future__ import annotations

from typing import Any, Mapping

from meshplan.cost_model.sharding import reshard_moves
from meshplan.layout_moves import ISpec, gathers_whole, spec_from_names
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
        if src is not None and _through_replicated(mesh.shape, spec_from_names(src, mesh.axes),
                                                   spec_from_names(spec, mesh.axes)):
            steps.append((pos, (None,) * len(spec)))
        steps.append((pos, spec))
    return out


def _through_replicated(shape: tuple[int, ...], src: ISpec, dst: ISpec) -> bool:
    """Whether the cost model prices ``src`` -> ``dst`` through the whole
    tensor: XLA's fallback, or an axis dropped before another is sliced in
    (split over x along the channels -> over y along the batch: gathered
    over x, then sliced; without the replicated step between, XLA reaches
    it by its fallback and warns)."""
    if gathers_whole(shape, src, dst):
        return True
    moves, _ = reshard_moves(shape, src, dst)
    return any(dst) and any(not any(after) for *_, after in moves)
