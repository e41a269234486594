"""A logical mesh with link figures per axis, derived from a ClusterSpec.

Devices of a submesh of ``hosts x devices_per_host`` are numbered host-major;
a logical mesh lays them out row-major.  Axis ``i`` (stride = product of the
later axis sizes) stays inside a host when each of its groups does (``stride *
size`` divides ``devices_per_host``) and then uses the host's links.
Otherwise its collectives cross hosts; they run hierarchically, as NCCL runs
them (:mod:`.collectives`): inside each host over the host's links, across
hosts over the network, where every device of the host that sends at once
gets its share of the host's network cards.
Bandwidths are what the links achieve (``LinkSpec.efficiency``), not peak.
A TPU cluster's axes are laid over the slices' ICI tori instead
(:mod:`.torus`): each axis carries the ring phases of the dimensions it spans.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..cluster import ClusterSpec, DeviceSpec
from ..plan import LogicalMesh
from .torus import axis_phases


@dataclass(frozen=True)
class AxisLink:
    bandwidth: float   # bytes/s per device per direction (the slowest link the axis uses)
    latency: float     # seconds per message step
    crosses_hosts: bool
    local: int = 0     # devices of one group of the axis on one host (0: the whole axis)
    # TPU: (devices, bytes/s, seconds per step) of each ring the axis's collectives run
    phases: tuple[tuple[int, float, float], ...] = ()


@dataclass(frozen=True)
class Group:
    """The devices of one collective and the links between them: ``local``
    of the ``size`` devices share a host (all of them when ``hosts == 1``)."""
    size: int
    local: int
    intra_bw: float
    intra_lat: float
    inter_bw: float     # one device's share of its host's network
    inter_lat: float
    # TPU: the rings of the torus dimensions (and slices) spanned, fastest first
    phases: tuple[tuple[int, float, float], ...] = ()

    @property
    def hosts(self) -> int:
        return self.size // self.local


@dataclass(frozen=True)
class MeshModel:
    """Everything the cost model needs to know about one logical mesh."""
    mesh: LogicalMesh
    links: tuple[AxisLink, ...]
    device: DeviceSpec
    memory_budget: int          # bytes per device available to the plan
    # XLA's GPU and TPU pipelines turn an all-reduce followed by a slice into a
    # reduce-scatter; its CPU pipeline keeps the full all-reduce (and slices
    # locally), so there a reduce-scatter costs, and shows, a whole all-reduce.
    native_reduce_scatter: bool = True
    # the links inside a host, and one device's share of the host's network
    intra: tuple[float, float] = (0.0, 0.0)    # (bytes/s, seconds per step)
    inter: tuple[float, float] = (0.0, 0.0)
    torus: bool = False          # links carry ring phases (a TPU cluster)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mesh.shape

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    def group(self, axes: tuple[int, ...]) -> Group:
        """The devices of a collective over ``axes`` and the links between them."""
        n = math.prod(self.mesh.shape[a] for a in axes)
        local = math.prod(self.links[a].local or self.mesh.shape[a] for a in axes)
        local = max(1, min(n, local))
        if self.torus:
            phases = tuple(sorted((p for a in axes for p in self.links[a].phases),
                                  key=lambda p: -p[1]))
            bw = min((p[1] for p in phases), default=self.intra[0])
            lat = max((p[2] for p in phases), default=self.intra[1])
            return Group(n, local, bw, lat, bw, lat, phases)
        if local == n or not self.intra[0]:
            bw, lat = min(self.links[a].bandwidth for a in axes), \
                max(self.links[a].latency for a in axes)
            return Group(n, n, bw, lat, bw, lat)
        return Group(n, local, *self.intra, *self.inter)


def mesh_model(cluster: ClusterSpec, mesh: LogicalMesh, *,
               submesh: tuple[int, int] | None = None,
               memory_fraction: float = 0.9) -> MeshModel:
    """Link figures of ``mesh`` laid over ``submesh`` (default: the whole cluster).

    ``memory_fraction`` of the device memory is the budget; the rest is left
    to the runtime and XLA's workspace.
    """
    if submesh is None:
        submesh = default_submesh(cluster, mesh.size)
    hosts, dph = submesh
    if mesh.size != hosts * dph:
        raise ValueError(f"logical mesh {mesh} has {mesh.size} devices, submesh {hosts}x{dph} "
                         f"has {hosts * dph}")
    if cluster.tpu is not None:
        return _torus_model(cluster, mesh, submesh, memory_fraction)
    intra = (cluster.intra_host.achieved_bandwidth, cluster.intra_host.latency_s)
    # every device of a host sends across hosts at once (each group's members
    # on the host each carry their share): they split the host's network
    inter = (min(cluster.inter_host.achieved_bandwidth / dph, intra[0]),
             cluster.inter_host.latency_s)
    links = []
    for i, size in enumerate(mesh.shape):
        local = axis_local(mesh.shape, i, dph) if hosts > 1 else size
        if local < size:
            links.append(AxisLink(inter[0], inter[1], True, local))
        else:
            links.append(AxisLink(*intra, False, size))
    budget = int(cluster.device.memory_bytes * memory_fraction)
    return MeshModel(mesh, tuple(links), cluster.device, budget,
                     native_reduce_scatter=not is_cpu(cluster.device),
                     intra=intra, inter=inter if hosts > 1 else intra)


def axis_local(shape: tuple[int, ...], i: int, dph: int) -> int:
    """How many devices of one group of axis ``i`` of a mesh of ``shape``
    (laid row-major over hosts of ``dph`` devices) share a host: the size
    of the axis where every group stays inside a host.  Where the groups
    tile the hosts unevenly (12 devices of hosts of 8: 8 on one host and 4
    on the next; pairs of hosts of 3 devices, one pair split between two
    hosts), the slowest group sets the collective's time: the fewest of its
    devices on one host, each of which carries the most bytes across the
    network (priced as ``size // local`` hosts of ``local``: at least the
    hosts it spans)."""
    size, stride = shape[i], math.prod(shape[i + 1:])
    span = stride * size
    if span <= dph and dph % span == 0:
        return size
    if span > dph and (stride % dph == 0 if stride >= dph else
                       dph % stride == 0 and size % (dph // stride) == 0):
        return max(1, min(size, dph // stride))
    # (a mesh that does not tile the hosts evenly: look at every group)
    others = [k for k in range(math.prod(shape)) if (k // stride) % size == 0]
    local = size
    for base in others:
        on = {}
        for k in range(size):
            host = (base + k * stride) // dph
            on[host] = on.get(host, 0) + 1
        if len(on) > 1:
            local = min(local, *on.values())
    return local


def _torus_model(cluster: ClusterSpec, mesh: LogicalMesh, submesh: tuple[int, int],
                 memory_fraction: float) -> MeshModel:
    links = []
    for size, (phases, slices) in zip(mesh.shape, axis_phases(cluster, mesh, submesh)):
        links.append(AxisLink(min((p[1] for p in phases), default=0.0),
                              max((p[2] for p in phases), default=0.0), slices > 1,
                              max(1, size // slices), phases))
    ici = (cluster.intra_host.achieved_bandwidth, cluster.intra_host.latency_s)
    dcn = (min(cluster.inter_host.achieved_bandwidth / submesh[1], ici[0]),
           cluster.inter_host.latency_s)
    return MeshModel(mesh, tuple(links), cluster.device,
                     int(cluster.device.memory_bytes * memory_fraction),
                     native_reduce_scatter=True, intra=ici, inter=dcn, torus=True)


def is_cpu(device: DeviceSpec) -> bool:
    """A host-CPU device (XLA's CPU back end), as ``ClusterSpec.local()`` names it."""
    return device.kind.strip().lower() in ("cpu", "host", "host cpu") or \
        device.kind.strip().lower().startswith("cpu")


def default_submesh(cluster: ClusterSpec, num_devices: int) -> tuple[int, int]:
    """The compact submesh of ``num_devices``: part of one host, or whole hosts."""
    dph = cluster.devices_per_host
    if num_devices <= dph:
        return (1, num_devices)
    if num_devices % dph or num_devices // dph > cluster.num_hosts:
        raise ValueError(f"{num_devices} devices do not form whole hosts of {dph} devices "
                         f"within {cluster.num_hosts} host(s)")
    return (num_devices // dph, dph)


def mesh_shapes(num_devices: int, max_rank: int = 3) -> list[tuple[int, ...]]:
    """Logical mesh shapes worth trying: every ordered factorisation of the
    device count into at most ``max_rank`` factors > 1 (plus the 1-D mesh)."""
    out: set[tuple[int, ...]] = set()

    def rec(rest: int, prefix: tuple[int, ...]) -> None:
        if rest == 1:
            if prefix:
                out.add(prefix)
            return
        if len(prefix) == max_rank:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                rec(rest // f, prefix + (f,))

    rec(num_devices, ())
    if num_devices == 1:
        out.add((1,))
    return sorted(out, key=lambda s: (len(s), s))


def default_axis_names(rank: int) -> tuple[str, ...]:
    if rank == 1:
        return ("x",)
    if rank == 2:
        return ("x", "y")
    return tuple(f"m{i}" for i in range(rank)) if rank > 3 else ("x", "y", "z")
