"""Sharding specs as the cost model sees them, and resharding costs.

An ``ISpec`` gives, per tensor dimension, the tuple of mesh-axis *indices*
that split it (in mesh order); ``()`` means not split.  A mesh axis appears at
most once in a spec; mesh axes not used replicate the tensor.
"""
from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Sequence

from .collectives import Cost, ZERO, add, all_gather, all_to_all
from .mesh import MeshModel

ISpec = tuple[tuple[int, ...], ...]


def replicated(rank: int) -> ISpec:
    return ((),) * rank


def used_axes(spec: ISpec) -> tuple[int, ...]:
    return tuple(sorted(a for d in spec for a in d))


def num_shards(spec: ISpec, mesh_shape: Sequence[int]) -> int:
    return math.prod(mesh_shape[a] for d in spec for a in d)


def local_shape(shape: Sequence[int], spec: ISpec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s // math.prod(mesh_shape[a] for a in d) if d else s
                 for s, d in zip(shape, spec))


def divides(shape: Sequence[int], spec: ISpec, mesh_shape: Sequence[int]) -> bool:
    return all(s % math.prod(mesh_shape[a] for a in d) == 0 for s, d in zip(shape, spec))


@lru_cache(maxsize=65536)
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
    """Time and result bytes of turning a tensor laid out as ``src`` into ``dst``.

    Per mesh axis: kept on the same dimension -> nothing; dropped -> all-gather;
    moved to another dimension -> all-to-all; added -> a local slice (free).
    A dimension whose axes change order is gathered and re-sliced.
    """
    if src == dst:
        return ZERO
    shp = mm.shape
    src_dim = {a: d for d, axes in enumerate(src) for a in axes}
    dst_dim = {a: d for d, axes in enumerate(dst) for a in axes}
    gather, move = [], []
    for a, d in src_dim.items():
        if a not in dst_dim:
            gather.append(a)
        elif dst_dim[a] != d:
            move.append(a)
        elif src[d] != dst[d] and _order_changed(src[d], dst[d], a):
            gather.append(a)
    if not gather and not move:
        return ZERO  # only slicing
    cur_shards = num_shards(src, shp)
    costs = []
    if move:
        costs.append(all_to_all(mm, tuple(sorted(move)), nbytes / cur_shards))
    if gather:
        remaining = cur_shards // math.prod(shp[a] for a in gather)
        costs.append(all_gather(mm, tuple(sorted(gather)), nbytes / remaining))
    return add(*costs)


def _order_changed(src_axes: tuple[int, ...], dst_axes: tuple[int, ...], a: int) -> bool:
    """Axis ``a`` splits the same dimension in both, but the major-to-minor order
    of the axes before it differs, so its shards hold different data."""
    return src_axes[:src_axes.index(a)] != dst_axes[:dst_axes.index(a)]


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


def spec_from_names(spec, axis_names: Sequence[str]) -> ISpec:
    out = []
    for d in spec:
        if d is None:
            out.append(())
        elif isinstance(d, str):
            out.append((axis_names.index(d),))
        else:
            out.append(tuple(axis_names.index(x) for x in d))
    return tuple(out)
