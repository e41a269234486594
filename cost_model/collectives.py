"""Alpha-beta ring model of collectives over one or more mesh axes.

Each function returns ``(seconds, result_bytes)``: the time of the collective
and the bytes of its result on one device, which is what XLA's per-device HLO
shows and what ``comm_bytes_per_device`` adds up.
"""
from __future__ import annotations

from .mesh import MeshModel

Cost = tuple[float, float]
ZERO: Cost = (0.0, 0.0)


def _group(mm: MeshModel, axes: tuple[int, ...], nbytes: float
           ) -> tuple[int, float, float] | None:
    """(devices, bandwidth, latency) of the axes, or None when nothing moves."""
    if not axes or nbytes <= 0:
        return None
    n, bw, lat = mm.group_link(axes)
    return None if n == 1 else (n, bw, lat)


def all_reduce(mm: MeshModel, axes: tuple[int, ...], nbytes: float) -> Cost:
    """All-reduce of a ``nbytes`` buffer: 2(n-1)a + 2(n-1)/n * S/B."""
    if (g := _group(mm, axes, nbytes)) is None:
        return ZERO
    n, bw, lat = g
    return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw, nbytes


def all_gather(mm: MeshModel, axes: tuple[int, ...], result_bytes: float) -> Cost:
    """All-gather producing ``result_bytes`` per device: (n-1)a + (n-1)/n * S/B."""
    if (g := _group(mm, axes, result_bytes)) is None:
        return ZERO
    n, bw, lat = g
    return (n - 1) * lat + (n - 1) / n * result_bytes / bw, result_bytes


def reduce_scatter(mm: MeshModel, axes: tuple[int, ...], input_bytes: float) -> Cost:
    """Reduce-scatter of an ``input_bytes`` buffer (result is input/n).

    Where XLA has no native reduce-scatter (its CPU back end) the partitioner's
    all-reduce + slice stays as it is: the cost and bytes of a full all-reduce."""
    if not mm.native_reduce_scatter:
        return all_reduce(mm, axes, input_bytes)
    if (g := _group(mm, axes, input_bytes)) is None:
        return ZERO
    n, bw, lat = g
    return (n - 1) * lat + (n - 1) / n * input_bytes / bw, input_bytes / n


def all_to_all(mm: MeshModel, axes: tuple[int, ...], nbytes: float) -> Cost:
    """All-to-all of a ``nbytes`` buffer per device: (n-1)a + (n-1)/n * S/B."""
    if (g := _group(mm, axes, nbytes)) is None:
        return ZERO
    n, bw, lat = g
    return (n - 1) * lat + (n - 1) / n * nbytes / bw, nbytes


def collective_permute(mm: MeshModel, axes: tuple[int, ...], nbytes: float) -> Cost:
    """Each device sends one ``nbytes`` buffer to another: one step, a + S/B."""
    if (g := _group(mm, axes, nbytes)) is None:
        return ZERO
    _, bw, lat = g
    return lat + nbytes / bw, nbytes


def reduce_scatter_kind(mm: MeshModel) -> str:
    """The HLO collective a reduce-scatter becomes on ``mm``'s devices."""
    return "reduce-scatter" if mm.native_reduce_scatter else "all-reduce"
