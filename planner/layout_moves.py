"""Where mesh axes go when a tensor changes layout: the geometry of a
resharding, before any cost.

An ``ISpec`` gives, per tensor dimension, the tuple of mesh-axis *indices*
that split it (in mesh order); ``()`` means not split.  Plain Python (no jax,
no cost figures): the cost model prices these moves
(:mod:`meshplan.cost_model.sharding`) and the runtime reads the same
decisions (:mod:`meshplan.runtime.reads`), so both agree on them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

ISpec = tuple[tuple[int, ...], ...]


def num_shards(spec: ISpec, mesh_shape: Sequence[int]) -> int:
    return math.prod(mesh_shape[a] for d in spec for a in d)


def ways(mesh_shape: Sequence[int], axes) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def contained(shp: tuple[int, ...], src: ISpec, dst: ISpec, every: tuple[int, ...]):
    """The moves when every block a device needs lies inside one block of
    ``src`` (none, or one collective-permute); None when it does not."""
    if not all(ways(shp, dst[d]) % ways(shp, src[d]) == 0 for d in range(len(src))):
        return None
    if all(tuple(dst[d][:len(src[d])]) == tuple(src[d]) for d in range(len(src))):
        return ()
    return (("collective-permute", every, num_shards(dst, shp), tuple(dst)),)


@dataclass(frozen=True)
class AxisMoves:
    """Where the mesh axes of ``src`` and ``dst`` go."""
    src: ISpec
    dst: ISpec
    src_dim: dict[int, int]      # axis -> dimension it splits in src
    dst_dim: dict[int, int]
    moved: list[int]             # axes splitting another dimension in dst
    dropped: set[int]            # axes of src not in dst
    new: list[int]               # axes of dst not in src

    @classmethod
    def of(cls, src: ISpec, dst: ISpec) -> "AxisMoves":
        src_dim = {a: d for d, axes in enumerate(src) for a in axes}
        dst_dim = {a: d for d, axes in enumerate(dst) for a in axes}
        moved = [a for a in src_dim if a in dst_dim and dst_dim[a] != src_dim[a]]
        dropped = {a for a in src_dim if a not in dst_dim}
        new = [a for a in dst_dim if a not in src_dim]
        return cls(src, dst, src_dim, dst_dim, moved, dropped, new)

    def whole_move(self, a: int) -> bool:
        """``a`` moves with every axis of its dimension, in their order."""
        d = self.src[self.src_dim[a]]
        dst_dim = self.dst_dim
        return all(b in dst_dim and dst_dim[b] == dst_dim[a] for b in d) and \
            tuple(x for x in self.dst[dst_dim[a]] if x in d) == tuple(d)

    def breaks(self, a: int) -> bool:
        """``a`` leaves its dimension, not minor-most, while splits under it go elsewhere."""
        d = self.src[self.src_dim[a]]
        if d[-1] == a or self.whole_move(a):
            return False
        minor = d[d.index(a) + 1:]
        return any(b not in self.dst_dim or self.dst_dim[b] != self.src_dim[a] for b in minor)

    def gathers_whole(self) -> bool:
        """Axes moving from several dimensions into one, a split of several
        axes that loses one and sends another elsewhere, or a move that
        breaks a split: XLA gathers the tensor whole."""
        moved, dropped = self.moved, self.dropped
        merges = any(len({self.src_dim[a] for a in self.dst[d] if a in moved}) > 1
                     for d in range(len(self.src)))
        torn = any(any(a in dropped for a in d) and any(a in moved for a in d) for d in self.src)
        return merges or torn or any(self.breaks(a) for a in moved)


def gathers_whole(mesh_shape: tuple[int, ...], src: ISpec, dst: ISpec) -> bool:
    """Whether the cost model prices ``src`` -> ``dst`` as XLA's fallback
    (:func:`meshplan.cost_model.sharding.reshard_moves`): gather the tensor
    whole, then slice (the runtime then constrains the
    replicated layout in between, :mod:`meshplan.runtime.reads`)."""
    if src == dst:
        return False
    every = tuple(sorted({a for d in src for a in d} | {a for d in dst for a in d}))
    if contained(mesh_shape, src, dst, every) is not None:
        return False
    return AxisMoves.of(src, dst).gathers_whole()


def through_whole(mesh_shape: tuple[int, ...], src: ISpec, dst: ISpec) -> bool:
    """Whether the cost model's steps from ``src`` to ``dst`` hold the tensor
    whole on every device in between: XLA's fallback
    (:func:`gathers_whole`), or every axis of ``src`` dropped before new ones
    are sliced in on other dimensions (channels over x, then the batch over
    y: gathered over x, then sliced).  The runtime constrains the replicated layout
    between them, or XLA reaches it by its fallback and warns."""
    if gathers_whole(mesh_shape, src, dst):
        return True
    if src == dst or not any(dst):
        return False
    every = tuple(sorted({a for d in src for a in d} | {a for d in dst for a in d}))
    if contained(mesh_shape, src, dst, every) is not None:
        return False
    mv = AxisMoves.of(src, dst)
    held = set(mv.src_dim.values())
    return bool(mv.new) and not mv.moved and set(mv.src_dim) <= mv.dropped \
        and all(mv.dst_dim[a] not in held for a in mv.new)


def spec_from_names(spec, axis_names: Sequence[str]) -> ISpec:
    """A plan's named spec (None, a name, or a tuple of names per dimension)
    as mesh-axis indices."""
    out = []
    for d in spec:
        if d is None:
            out.append(())
        elif isinstance(d, str):
            out.append((axis_names.index(d),))
        else:
            out.append(tuple(axis_names.index(x) for x in d))
    return tuple(out)
