"""Sharding specs as the cost model sees them, and resharding costs.

An ``ISpec`` gives, per tensor dimension, the tuple of mesh-axis *indices*
that split it (in mesh order); ``()`` means not split.  A mesh axis appears at
most once in a spec; mesh axes not used replicate the tensor.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from .collectives import Cost, ZERO, all_gather, all_to_all, collective_permute
from .mesh import MeshModel
# the geometry of a move: plain Python the runtime reads too
from ..layout_moves import (AxisMoves as _Moves, ISpec, contained as _contained, num_shards,
                            ways as _ways)



def replicated(rank: int) -> ISpec:
    return ((),) * rank


def local_shape(shape: Sequence[int], spec: ISpec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s // math.prod(mesh_shape[a] for a in d) if d else s
                 for s, d in zip(shape, spec))


def divides(shape: Sequence[int], spec: ISpec, mesh_shape: Sequence[int]) -> bool:
    return all(s % math.prod(mesh_shape[a] for a in d) == 0 for s, d in zip(shape, spec))


def enumerate_specs(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                    blocked: frozenset[int] = frozenset()) -> tuple[ISpec, ...]:
    """Every spec of a tensor: each mesh axis of size > 1 splits one dimension
    (not in ``blocked``) or none; split sizes must divide evenly."""
    rank = len(shape)
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    choices = [None] + [d for d in range(rank) if d not in blocked and shape[d] > 1]
    out = []
    for assign in itertools.product(choices, repeat=len(axes)):
        dims: list[list[int]] = [[] for _ in range(rank)]
        for a, d in zip(axes, assign):
            if d is not None:
                dims[d].append(a)
        spec = tuple(tuple(x) for x in dims)
        if divides(shape, spec, mesh_shape):
            out.append(spec)
    return tuple(out)


def reshard_cost(mm: MeshModel, shape: Sequence[int], nbytes: int, src: ISpec,
                 dst: ISpec) -> Cost:
    """Time and result bytes of turning a tensor laid out as ``src`` into ``dst``
    (the sum of :func:`reshard_steps`)."""
    steps = reshard_steps(mm, shape, nbytes, src, dst)
    return (sum(s[1] for s in steps), sum(s[2] for s in steps)) if steps else ZERO


def reshard_steps(mm: MeshModel, shape: Sequence[int], nbytes: int, src: ISpec,
                  dst: ISpec) -> tuple[tuple[str, float, float, ISpec], ...]:
    """The collectives XLA's SPMD partitioner emits to turn ``src`` into ``dst``:
    ``(kind, seconds, result bytes per device, layout after the step)``.

    Modelled on what XLA was measured to do (``benchmarks/reshard_calibration.py``):

    * every block a device needs lies inside one block of the source layout
      (each dimension's split count divides the new one): a local slice when
      that block is the device's own (the source axes of every dimension are
      a prefix of the new ones), else one collective-permute of the new block;
    * axes moving from several dimensions into one, or an axis
      leaving a dimension where it is not the minor-most split while the
      splits under it go elsewhere: XLA gathers the tensor whole (one
      all-gather per dimension, from the last) and slices;
    * otherwise, in order: slice the new axes (those of dimensions that lose
      axes, or that a moving axis leaves, come last); one all-to-all per batch
      of axes moving into dimensions that lose none; all-gather the dropped
      axes, one all-gather per dimension from the last (a collective-permute
      first when a dropped axis is not the minor-most of its dimension, or
      when new axes split the dimension more coarsely: then the gather stays
      within the new blocks); the remaining all-to-alls; a collective-permute
      when a dimension's axes end up in another order than wanted, or when a
      major split left a dimension whose minor split stays.

    Two reshardings of one tensor from one layout that share a step emit the
    same collective, which XLA computes once (see ``ilp.decode.explain``).
    """
    if src == dst:
        return ()
    return price_moves(mm, nbytes, reshard_moves(mm.shape, src, dst))


# A step of a resharding before the tensor's size is known: the collective
# ``kind`` over mesh ``axes`` on (the tensor's bytes / ``divisor``) bytes per
# device, and the layout after it.
Move = tuple[str, tuple[int, ...], int, ISpec]
# the moves, and whether the steps that move nothing are left out once priced
Moves = tuple[tuple[Move, ...], bool]


def reshard_moves(mesh_shape: tuple[int, ...], src: ISpec, dst: ISpec) -> Moves:
    """The steps of :func:`reshard_steps` from ``src`` to ``dst`` with their
    sizes as fractions of the tensor's: the same for every tensor of that
    rank on that mesh shape (:func:`price_moves` prices them)."""
    if src == dst:
        return (), False
    every = tuple(sorted({a for d in src for a in d} | {a for d in dst for a in d}))
    # 1. containment: no data has to be merged, at most moved between devices
    contained = _contained(mesh_shape, src, dst, every)
    if contained is not None:
        return contained, False
    mv = _Moves.of(src, dst)
    # 2. the cases XLA handles by gathering the whole tensor
    if mv.gathers_whole():
        return _replicate(mesh_shape, src), True
    return _step_by_step(mesh_shape, src, dst, mv, every), True


def _priced(mm: MeshModel, kind: str, axes: tuple[int, ...], nbytes: float) -> Cost:
    if kind == "all-gather":
        return all_gather(mm, axes, nbytes)
    if kind == "all-to-all":
        return all_to_all(mm, axes, nbytes)
    return collective_permute(mm, axes, nbytes)


def price_moves(mm: MeshModel, nbytes: float, moves: Moves, memo: dict | None = None
                ) -> tuple[tuple[str, float, float, ISpec], ...]:
    """The steps :func:`reshard_steps` gives for a tensor of ``nbytes`` from
    its :func:`reshard_moves` on ``mm``'s shape.  ``memo``: the collectives
    priced so far on ``mm``, ``(kind, axes, bytes) -> (seconds, bytes)``,
    filled in (None: none kept)."""
    found, drop_empty = moves
    steps = []
    for kind, axes, divisor, after in found:
        key = (kind, axes, nbytes / divisor)
        cost = memo.get(key) if memo is not None else None
        if cost is None:
            cost = _priced(mm, *key)
            if memo is not None:
                memo[key] = cost
        steps.append((kind,) + cost + (after,))
    return tuple(s for s in steps if s[2] > 0 or s[1] > 0) if drop_empty else tuple(steps)


@dataclass
class _Layout:
    """The layout as the steps change it: axes per dimension."""
    shp: tuple[int, ...]
    cur: list[list[int]]

    def spec(self) -> ISpec:
        return tuple(tuple(d) for d in self.cur)

    def shards(self) -> int:
        return math.prod(self.shp[a] for d in self.cur for a in d)


def _late_axes(mv: _Moves, cur: list[list[int]]) -> tuple[list[int], bool]:
    """Step 3: with a gather, new axes are sliced last (XLA gathers the value
    as it comes and slices the result); otherwise they are sliced first (the
    all-to-alls move less), except on a dimension past every moving axis or
    one a moving axis leaves (a permute follows when that dimension ends up
    split by several axes).  Slices the early ones into ``cur``; returns the
    late ones and whether the blocks must be permuted at the end."""
    src_dim, dst_dim, dst = mv.src_dim, mv.dst_dim, mv.dst
    vacated = {src_dim[a] for a in mv.moved}
    late, reorder = [], False
    last_moving = max((max(src_dim[a], dst_dim[a]) for a in mv.moved), default=-1)
    for a in mv.new:
        if mv.dropped or (len(dst[dst_dim[a]]) == 1 and dst_dim[a] > last_moving):
            late.append(a)
        elif dst_dim[a] in vacated:
            late.append(a)
            reorder = len(dst[dst_dim[a]]) > 1 or reorder
        else:
            cur[dst_dim[a]].append(a)
    # a major split leaving a dimension whose minor split stays moves blocks
    reorder = reorder or any(mv.src[src_dim[a]][-1] != a and not mv.whole_move(a)
                             for a in mv.moved)
    return late, reorder


def _gather_dropped(mv: _Moves, lay: _Layout, late: list[int], every: tuple[int, ...],
                    steps: list) -> None:
    """Step 5: all-gather the dropped axes, one dimension at a time from the last."""
    cur, shp = lay.cur, lay.shp
    for d in reversed(range(len(mv.src))):
        drop = [a for a in cur[d] if a in mv.dropped]
        if not drop:
            continue
        keep = [a for a in cur[d] if a not in mv.dropped]
        coarser = [a for a in late if mv.dst_dim[a] == d]
        if not keep and coarser and _ways(shp, drop) % _ways(shp, coarser) == 0:
            # a coarser split by other axes: permute the blocks, then gather
            # only within the new blocks
            steps.append(("collective-permute", every, lay.shards(), lay.spec()))
            cur[d] = list(coarser)
            for a in coarser:
                late.remove(a)
            steps.append(("all-gather", tuple(sorted(drop)), lay.shards(), lay.spec()))
            continue
        if cur[d][len(cur[d]) - len(drop):] != drop:
            # the kept axes are not the major part: reorder the blocks first
            steps.append(("collective-permute", every, lay.shards(), lay.spec()))
            cur[d] = keep + drop
        for a in drop:
            cur[d].remove(a)
        steps.append(("all-gather", tuple(sorted(drop)), lay.shards(), lay.spec()))


def _step_by_step(shp: tuple[int, ...], src: ISpec, dst: ISpec, mv: _Moves,
                  every: tuple[int, ...]) -> tuple[Move, ...]:
    """Steps 3 to 8 of :func:`reshard_steps`: slices, all-to-alls, gathers, permutes."""
    steps: list[Move] = []
    lay = _Layout(shp, [list(d) for d in src])
    cur = lay.cur
    late, reorder = _late_axes(mv, cur)
    # 4. axes moving into a dimension that loses none: all-to-all first, on
    #    the still finely split tensor (the shard count stays)
    early = [] if mv.dropped else list(mv.moved)
    _all_to_alls(early, mv.src_dim, mv.dst_dim, cur, steps, lay.spec, lay.shards)
    _gather_dropped(mv, lay, late, every, steps)
    # 6. the other moved axes, after the gathers that make room for them
    _all_to_alls([a for a in mv.moved if a not in early], mv.src_dim, mv.dst_dim, cur,
                 steps, lay.spec, lay.shards)
    # 7. the remaining new axes are local slices
    for a in late:
        cur[mv.dst_dim[a]].append(a)
    # 8. axes of a dimension in another order than wanted: permute the blocks
    if lay.spec() != tuple(dst) or reorder:
        divisor = num_shards(dst, shp)
        lay.cur = [list(d) for d in dst]
        steps.append(("collective-permute", every, divisor, lay.spec()))
    return tuple(steps)


def _replicate(shp: tuple[int, ...], src: ISpec) -> tuple[Move, ...]:
    """XLA's fallback: gather the tensor whole, one dimension at a time from
    the last (the slicing that follows is local)."""
    cur = [list(d) for d in src]
    steps = []
    for d in reversed(range(len(src))):
        if not cur[d]:
            continue
        axes = tuple(sorted(cur[d]))
        cur[d] = []
        left = math.prod(shp[a] for x in cur for a in x)
        after = tuple(tuple(x) for x in cur)
        steps.append(("all-gather", axes, left, after))
    return tuple(steps)


def _all_to_alls(axes, src_dim, dst_dim, cur, steps, spec, shards) -> None:
    """Move ``axes`` to their new dimensions: one all-to-all for a batch of
    axes none of which moves into a dimension another one leaves (XLA moves
    those together), a new batch otherwise.  The shard count stays."""
    pending = list(axes)
    while pending:
        batch = []
        for a in pending:
            if all(dst_dim[a] != src_dim[b] and dst_dim[b] != src_dim[a] for b in batch):
                batch.append(a)
        for a in batch:
            pending.remove(a)
            # a split moving as a whole keeps its order
            cur[src_dim[a]].remove(a)
            cur[dst_dim[a]].append(a)
        steps.append(("all-to-all", tuple(sorted(batch)), shards(), spec()))


def spec_names(spec: ISpec, axis_names: Sequence[str]):
    """ISpec -> the plan's Spec (None / name / tuple of names per dimension)."""
    out = []
    for d in spec:
        if not d:
            out.append(None)
        elif len(d) == 1:
            out.append(axis_names[d[0]])
        else:
            out.append(tuple(axis_names[a] for a in d))
    return tuple(out)
