"""Logical mesh axes laid over the ICI torus of TPU slices and over DCN.

A stage of a TPU cluster runs on ``slices`` whole slices or on the first
``chips`` chips of one slice, a block of the torus (``TpuSlice.sub_shape``).
Its devices are ordered with the torus dimensions in ``LogicalMesh.torus``
order, fastest first (default: the numbering order, first dimension
fastest), then slice by slice.  A logical mesh takes them row-major, so its
last axis takes the fastest dimensions: each axis spans whole dimensions,
a part of one, and/or slices.

An axis's collectives run as successive ring phases, one per dimension it
spans (the bucket algorithm of multi-dimensional tori):

- a whole dimension with wraparound is a bidirectional ring, twice a
  link's bandwidth; a line (no wraparound, or part of a dimension) embeds a
  bidirectional ring that uses every link both ways, one link's bandwidth;
- the outer part of a split dimension (members ``inner`` chips apart)
  shares its links with ``inner`` other groups and takes ``inner`` hops a step;
- the slices of an axis are a ring over DCN, where each chip gets its share
  of its slice's network bandwidth.
"""
from __future__ import annotations

import itertools
import math

from ..cluster import ClusterSpec
from ..plan import LogicalMesh

# (devices of the ring, bytes/s per device per direction, seconds per step)
Phase = tuple[int, float, float]


def block(cluster: ClusterSpec, chips: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Sizes and wraparound of the torus block the first ``chips`` chips of a
    slice fill; chips that fill no block count as a line."""
    tpu = cluster.tpu
    assert tpu is not None
    shape = tpu.sub_shape(chips)
    if shape is None:
        return (chips,), (False,)
    return shape, tuple(w and b == t and b > 2
                        for w, b, t in zip(tpu.wraparound, shape, tpu.topology))


def torus_orders(cluster: ClusterSpec, submesh: tuple[int, int] | None) -> list[tuple[int, ...]]:
    """The orders of the torus dimensions worth trying on ``submesh``, ``()``
    (numbering order) first; orders that differ only by swapping dimensions
    of equal size and wraparound plan the same and are dropped.  A GPU
    cluster has the one order ``()``."""
    if cluster.tpu is None:
        return [()]
    chips = submesh[1] if submesh else cluster.devices_per_host
    shape, wraps = block(cluster, chips)
    dims = [i for i, s in enumerate(shape) if s > 1]
    out, seen = [], set()
    for perm in itertools.permutations(dims):
        key = tuple((shape[i], wraps[i]) for i in perm)
        if key not in seen:
            seen.add(key)
            out.append(() if list(perm) == dims else perm)
    return out


def axis_phases(cluster: ClusterSpec, mesh: LogicalMesh, submesh: tuple[int, int]
                ) -> list[tuple[tuple[Phase, ...], int]]:
    """The ring phases of each axis of ``mesh`` on ``submesh`` (slices,
    chips), with the number of slices the axis spans."""
    tpu = cluster.tpu
    assert tpu is not None
    slices, chips = submesh
    shape, wraps = block(cluster, chips)
    dims = [i for i, s in enumerate(shape) if s > 1]
    order = list(mesh.torus) if sorted(mesh.torus) == dims else dims
    ici_bw, ici_lat = tpu.ici.achieved_bandwidth, tpu.ici.latency_s
    dcn_bw = min(tpu.dcn.achieved_bandwidth * tpu.hosts / tpu.chips, ici_bw)
    # the dimensions, fastest first: (size, ring bandwidth of the whole, step latency, over DCN)
    stream = [(shape[i], ici_bw * (2 if wraps[i] else 1), ici_lat, False) for i in order]
    if slices > 1:
        stream.append((slices, dcn_bw, tpu.dcn.latency_s, True))
    out: list[tuple[tuple[Phase, ...], int]] = []
    pos, inner = 0, 1
    for size in reversed(mesh.shape):
        need, phases, spans = size, [], 1
        while need > 1 and pos < len(stream):
            dim, bw, lat, dcn = stream[pos]
            left = dim // inner
            take = left if need % left == 0 else math.gcd(need, left)
            if take == 1:
                break
            if dcn:
                phases.append((take, bw, lat))
                spans *= take
            elif take * inner == dim:       # the rest of the dimension: its ring or line
                phases.append((take, bw / inner, lat * inner))
            else:                            # part of it: a line, strided when inner > 1
                phases.append((take, ici_bw / inner, lat * inner))
            inner *= take
            need //= take
            if inner == dim:
                pos, inner = pos + 1, 1
        if need > 1:
            # (no block of the torus fits this axis: cost what is left at the
            # slowest link still to come, a pessimistic guess)
            slow = min((s[1] for s in stream[pos:]), default=ici_bw)
            phases.append((need, slow, max(s[2] for s in stream)))
            spans *= slices if pos < len(stream) and stream[-1][3] else 1
        out.append((tuple(phases), spans))
    return out[::-1]


def device_order(cluster: ClusterSpec, devices: tuple[int, ...], mesh: LogicalMesh
                 ) -> tuple[int, ...]:
    """``devices`` (a stage's chips in id order: slice-major, first dimension
    fastest) reordered so that ``mesh.torus``'s dimensions run fastest, as
    :func:`axis_phases` costed them; unchanged for the numbering order."""
    if cluster.tpu is None or not mesh.torus:
        return devices
    chips = min(len(devices), cluster.devices_per_host)
    shape, _ = block(cluster, chips)
    dims = [i for i, s in enumerate(shape) if s > 1]
    if sorted(mesh.torus) != dims or len(devices) % chips:
        return devices
    perm = list(mesh.torus) + [i for i in range(len(shape)) if i not in mesh.torus]
    out = []
    for s in range(len(devices) // chips):
        part = devices[s * chips:(s + 1) * chips]
        # position of each chip in the block; sort by the new order's significance
        coords = []
        for j in range(chips):
            c, rest = [], j
            for size in shape:
                c.append(rest % size)
                rest //= size
            coords.append(c)
        ranked = sorted(range(chips), key=lambda j: [coords[j][d] for d in reversed(perm)])
        out.extend(part[j] for j in ranked)
    return tuple(out)
