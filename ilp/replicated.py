"""Work a plan runs identically on every device of a mesh axis.

The ILP may find that splitting a tiny step costs more in collectives than
it saves, or no operator may have a dimension the axis divides; either
way the user should hear that the devices along that axis repeat each
other's work (no silent replication).  One-stage plans and the stage
search's plans say so in the same words: :func:`unsplit_flops` of each
solved graph (a whole step, or a layer), summed per stage, then
:func:`replicated_note`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph
from .accumulation import name_axes
from .strategies import node_space

__all__ = ("REPLICATED_AXIS_SHARE", "REPLICATED_NOTE", "Unsplit", "unsplit_flops",
           "replicated_note")

# a mesh axis worth a note: this share of the operators' FLOPs runs unsplit over it
REPLICATED_AXIS_SHARE = 0.5
REPLICATED_NOTE = "replicated work: "
# a stage with less than this share of the plan's FLOPs is not noted
LEAST_STAGE_SHARE = 0.01


@dataclass(frozen=True)
class Unsplit:
    """FLOPs of the operators that choose layouts (an element-wise follower
    splits as its operand does) and, per mesh axis of several devices,
    ``(axis, size, FLOPs run unsplit over it, of those the FLOPs some
    layout could have split that many ways)``."""
    total: float = 0.0
    axes: tuple[tuple[str, int, float, float], ...] = ()

    def __add__(self, other: "Unsplit") -> "Unsplit":
        """Two graphs' figures on one mesh (the layers of a stage)."""
        if not self.axes:
            return Unsplit(self.total + other.total, other.axes)
        if not other.axes:
            return Unsplit(self.total + other.total, self.axes)
        return Unsplit(self.total + other.total,
                       tuple((a, n, f + g, c + d) for (a, n, f, c), (_, _, g, d)
                             in zip(self.axes, other.axes)))


def unsplit_flops(graph: Graph, mesh, strategies) -> Unsplit:
    """:class:`Unsplit` of ``graph`` solved on ``mesh`` with ``strategies``
    ((node id, strategy name) pairs, an IntraOpResult's)."""
    nodes = {n.id: n for n in graph.nodes}
    # (work on scalars has no layout to split: a step's bookkeeping)
    chosen = [(nodes[i], {axis for axis, _ in name_axes(name)})
              for i, name in strategies if i in nodes and nodes[i].flops
              and any(graph.tensors[t].shape for t in nodes[i].outputs)]
    # (the sizes a node's rule may split, asked once per kind of operator:
    # a layer repeats a few kinds many times)
    free: dict[tuple, tuple[int, ...]] = {}

    def splittable(n) -> tuple[int, ...]:
        key = (n.primitive, tuple(graph.tensors[t].shape for t in n.inputs + n.outputs),
               n.params)
        if key not in free:
            space = node_space(graph, n)
            free[key] = () if space is None else tuple(
                size for l, size in space.sizes.items() if l not in space.blocked)
        return free[key]
    axes = []
    for axis, size in zip(mesh.axes, mesh.shape):
        if size > 1:
            same = [n for n, used in chosen if axis not in used]
            axes.append((axis, size, sum(n.flops for n in same),
                         sum(n.flops for n in same if any(d % size == 0 for d in splittable(n)))))
    return Unsplit(sum(n.flops for n, _ in chosen), tuple(axes))


def replicated_note(per_stage: list[Unsplit]) -> str | None:
    """The note for a plan whose stages have these figures, or None where no
    stage runs ``REPLICATED_AXIS_SHARE`` of its FLOPs unsplit over an axis."""
    parts = []
    whole = sum(u.total for u in per_stage)
    for k, u in enumerate(per_stage):
        if u.total < LEAST_STAGE_SHARE * whole:
            continue        # (a stage of next to no work: its own note, if any, is idleness)
        said = []
        for axis, size, same, could in u.axes:
            share = same / u.total if u.total else 0.0
            if share < REPLICATED_AXIS_SHARE:
                continue
            if could >= REPLICATED_AXIS_SHARE * same:
                why = ("no layout that splits them was predicted faster; a larger batch, or "
                       "fewer devices, would put them to use")
            else:
                why = (f"none of their dimensions divides by {size}; sizes that do, or a mesh "
                       "axis whose size divides them, would put them to use")
            said.append(f"{share:.0%} of the operators' FLOPs run identically on each "
                        f"of the {size} devices of mesh axis {axis} ({why})")
        if said:
            parts.append((f"stage {k}: " if len(per_stage) > 1 else "") + ", and ".join(said))
    return REPLICATED_NOTE + "; ".join(parts) if parts else None
