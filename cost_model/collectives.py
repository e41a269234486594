"""Collectives at achieved link bandwidth, over one or more mesh axes.

Inside a host a collective is a ring: latency-bound for small messages
(``alpha`` per step), bandwidth-bound for large ones.  A collective whose
devices span hosts runs hierarchically, as NCCL runs it: a reduce-scatter
inside each host, an all-reduce of the host's shard across hosts (each device
with its share of the host's network cards), an all-gather inside the host.
Every collective is a kernel and pays the device's launch cost.  On a TPU
torus a collective runs as successive ring phases, one per dimension (or the
slices) its axes span, fastest link first on the largest data (:mod:`.torus`).

Each function returns ``(seconds, result_bytes)``: the time of the collective
and the bytes of its result on one device, which is what XLA's per-device HLO
shows and what ``comm_bytes_per_device`` adds up.
"""
from __future__ import annotations

from .mesh import Group, MeshModel

Cost = tuple[float, float]
ZERO: Cost = (0.0, 0.0)


def _group(mm: MeshModel, axes: tuple[int, ...], nbytes: float) -> Group | None:
    """The collective's devices and links, or None when nothing moves."""
    if not axes or nbytes <= 0:
        return None
    g = mm.group(axes)
    return None if g.size == 1 else g


def _ring(n: int, steps: int, nbytes: float, bw: float, lat: float) -> float:
    """``steps`` ring steps over ``n`` devices, each moving nbytes/n."""
    return 0.0 if n <= 1 else steps * lat + steps / n * nbytes / bw


def _launch(mm: MeshModel, t: float) -> float:
    return t + mm.device.achieved.kernel_launch_s


def _phased(g: Group, nbytes: float) -> float:
    """A reduce-scatter (or an all-gather) of ``nbytes`` over the torus:
    each ring phase moves (n-1)/n of what the phases before it left."""
    t = 0.0
    for n, bw, lat in g.phases:
        t += _ring(n, n - 1, nbytes, bw, lat)
        nbytes /= n
    return t


def _gather_time(g: Group, nbytes: float) -> float:
    """An all-gather (or a reduce-scatter) of a ``nbytes`` buffer: across
    hosts on the host's share, then inside each host."""
    if g.phases:
        return _phased(g, nbytes)
    return (_ring(g.hosts, g.hosts - 1, nbytes / g.local, g.inter_bw, g.inter_lat)
            + _ring(g.local, g.local - 1, nbytes, g.intra_bw, g.intra_lat))


def _all_reduce_s(mm: MeshModel, g: Group, nbytes: float) -> float:
    if g.phases:
        return _launch(mm, 2 * _phased(g, nbytes))
    return _launch(mm, 2 * _ring(g.local, g.local - 1, nbytes, g.intra_bw, g.intra_lat)
                   + _ring(g.hosts, 2 * (g.hosts - 1), nbytes / g.local, g.inter_bw,
                           g.inter_lat))


def all_reduce(mm: MeshModel, axes: tuple[int, ...], nbytes: float) -> Cost:
    """All-reduce of a ``nbytes`` buffer: 2(n-1)a + 2(n-1)/n * S/B on one
    host; reduce-scatter, cross-host all-reduce of S/local, all-gather."""
    if (g := _group(mm, axes, nbytes)) is None:
        return ZERO
    return _all_reduce_s(mm, g, nbytes), nbytes


# XLA's combiner passes merge independent all-reduces (and reduce-scatters)
# over the same devices into one collective of up to this many bytes: the
# default of xla_gpu_all_reduce_combine_threshold_bytes and of the
# reduce-scatter combiner, 30 MiB.  XLA:CPU merged all 54 gradient
# all-reduces of a data-parallel gpt step (7.4 MB) into one.
COMBINE_BYTES = 30 * 2**20


def fixed_s(mm: MeshModel, kind: str, axes: tuple[int, ...]) -> float:
    """The part of a ``kind`` collective's time over ``axes`` that does not
    grow with its size: its ring steps' latency and its launch.  A gradient
    reduction merged with others (``COMBINE_BYTES``) pays it once per merged
    collective rather than once per gradient."""
    if (g := _group(mm, axes, 1.0)) is None:
        return 0.0
    if kind == "reduce-scatter" and mm.native_reduce_scatter:
        return _launch(mm, _gather_time(g, 0.0))
    return _all_reduce_s(mm, g, 0.0)


def all_gather(mm: MeshModel, axes: tuple[int, ...], result_bytes: float) -> Cost:
    """All-gather producing ``result_bytes`` per device: (n-1)a + (n-1)/n * S/B."""
    if (g := _group(mm, axes, result_bytes)) is None:
        return ZERO
    return _launch(mm, _gather_time(g, result_bytes)), result_bytes


def reduce_scatter(mm: MeshModel, axes: tuple[int, ...], input_bytes: float) -> Cost:
    """Reduce-scatter of an ``input_bytes`` buffer (result is input/n).

    Where XLA has no native reduce-scatter (its CPU back end) the partitioner's
    all-reduce + slice stays as it is: the cost and bytes of a full all-reduce."""
    if not mm.native_reduce_scatter:
        return all_reduce(mm, axes, input_bytes)
    if (g := _group(mm, axes, input_bytes)) is None:
        return ZERO
    return _launch(mm, _gather_time(g, input_bytes)), input_bytes / g.size


def all_to_all(mm: MeshModel, axes: tuple[int, ...], nbytes: float) -> Cost:
    """All-to-all of a ``nbytes`` buffer per device: (n-1)a + (n-1)/n * S/B
    inside a host; across hosts the (hosts-1)/hosts of the buffer bound for
    other hosts goes over the device's share of the network."""
    if (g := _group(mm, axes, nbytes)) is None:
        return ZERO
    if g.phases:    # dimension-ordered: each phase carries its (n-1)/n of the buffer
        return _launch(mm, sum(_ring(n, n - 1, nbytes, bw, lat) for n, bw, lat in g.phases)), \
            nbytes
    t = _ring(g.size, g.size - 1, nbytes, g.intra_bw, g.intra_lat) \
        if g.hosts == 1 else \
        ((g.size - 1) * g.inter_lat + (g.hosts - 1) / g.hosts * nbytes / g.inter_bw
         + (g.local - 1) / g.size * nbytes / g.intra_bw)
    return _launch(mm, t), nbytes


def collective_permute(mm: MeshModel, axes: tuple[int, ...], nbytes: float) -> Cost:
    """Each device sends one ``nbytes`` buffer to another: one step, a + S/B
    (over the network when the axes cross hosts)."""
    if (g := _group(mm, axes, nbytes)) is None:
        return ZERO
    bw, lat = (g.intra_bw, g.intra_lat) if g.hosts == 1 or g.phases else \
        (g.inter_bw, g.inter_lat)
    return _launch(mm, lat + nbytes / bw), nbytes


def reduce_scatter_kind(mm: MeshModel) -> str:
    """The HLO collective a reduce-scatter becomes on ``mm``'s devices."""
    return "reduce-scatter" if mm.native_reduce_scatter else "all-reduce"
