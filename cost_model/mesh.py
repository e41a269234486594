"""A logical mesh with link figures per axis, derived from a ClusterSpec.

Devices of a submesh of ``hosts x devices_per_host`` are numbered host-major;
a logical mesh lays them out row-major.  Axis ``i`` (stride = product of the
later axis sizes) stays inside a host when ``stride * size <= devices_per_host``
and then uses the host's links; otherwise its collectives cross hosts and every
device of a host shares the host's network bandwidth (one figure per axis, as
in Alpa).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..cluster import ClusterSpec, DeviceSpec
from ..plan import LogicalMesh


@dataclass(frozen=True)
class AxisLink:
    bandwidth: float   # bytes/s per device per direction
    latency: float     # seconds per message step
    crosses_hosts: bool


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

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mesh.shape

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    def group_link(self, axes: tuple[int, ...]) -> tuple[int, float, float]:
        """(devices, bandwidth, latency) of a collective over several axes at once:
        the slowest axis sets the pace."""
        n = math.prod(self.mesh.shape[a] for a in axes)
        bw = min(self.links[a].bandwidth for a in axes)
        lat = max(self.links[a].latency for a in axes)
        return n, bw, lat


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
    links = []
    for i, size in enumerate(mesh.shape):
        stride = math.prod(mesh.shape[i + 1:])
        crosses = hosts > 1 and stride * size > dph
        if crosses:
            # groups of this axis that run at once on one host share its network
            concurrent = max(1, min(dph, hosts * dph // size))
            per_dev = min(cluster.inter_host.bandwidth_bytes_per_s / concurrent,
                          cluster.intra_host.bandwidth_bytes_per_s)
            links.append(AxisLink(per_dev, cluster.inter_host.latency_s, True))
        else:
            links.append(AxisLink(cluster.intra_host.bandwidth_bytes_per_s,
                                  cluster.intra_host.latency_s, False))
    budget = int(cluster.device.memory_bytes * memory_fraction)
    return MeshModel(mesh, tuple(links), cluster.device, budget,
                     native_reduce_scatter=not is_cpu(cluster.device))


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
