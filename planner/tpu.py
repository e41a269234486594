"""TPU slices in a cluster file: the chip, the ICI torus of one slice, and
the data-centre network (DCN) between slices.

A TPU cluster file describes ``num_slices`` identical slices instead of hosts
x devices (``"format"``, ``"name"``, ``"description"`` and ``"sources"`` as
in every cluster file)::

    {
      "format": "meshplan.cluster/1", "name": "tpu-v5e-256-x2",
      "num_slices": 2,
      "slice": {
        "chip": {"kind": "TPU v5 lite", "memory_bytes": ..., "memory_bandwidth_bytes_per_s": ...,
                 "peak_flops": {"bfloat16": 1.97e14}},          # as a GPU file's "device"
        "topology": [16, 16],               # chips along each torus dimension (or "16x16")
        "wraparound": [true, true],         # optional; default: a ring wherever a dimension has > 2 chips
        "hosts": 32,                        # hosts (VMs with a network card) per slice
        "ici": {"bandwidth_bytes_per_s": 5e10, "latency_s": 1e-06}   # per link, per direction
      },
      "dcn": {"bandwidth_bytes_per_s": 2.5e10, "latency_s": 2e-05}   # per host, per direction
    }

The planner sees a slice where a GPU cluster has a host: a ``ClusterSpec``
of ``num_slices`` "hosts" of ``chips`` devices, whose intra-host link is
one ICI link and whose inter-host link is the slice's DCN bandwidth (every
host's network card together).  ``ClusterSpec.tpu`` keeps the torus, which
:mod:`meshplan.cost_model.torus` uses to cost a collective over the rings
of the dimensions a mesh axis spans.

Chips of a slice are numbered with the first torus dimension fastest
(``id = x + X * (y + Y * z)``), slices one after another; a sub-slice of
``d`` chips is the first ``d`` of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .errors import ClusterSpecError

# (cluster.py imports this module: ClusterSpec and LinkSpec in annotations
# name meshplan.cluster's classes, never imported here)

TOP_KEYS = ("format", "name", "num_slices", "slice", "dcn")
TOP_OPTIONAL = ("description", "sources", "num_devices")
SLICE_KEYS = ("chip", "topology", "hosts", "ici")
SLICE_OPTIONAL = ("wraparound",)

HINTS = {
    "num_slices": 'add the number of slices of the job, e.g. "num_slices": 1',
    "slice": 'add a "slice" object with ' + ", ".join(SLICE_KEYS),
    "dcn": 'add the data-centre network between slices, per host: {"bandwidth_bytes_per_s": '
           '..., "latency_s": ...}',
    "chip": 'add a "chip" object like a GPU file\'s "device" (kind, memory_bytes, '
            'memory_bandwidth_bytes_per_s, peak_flops)',
    "topology": 'add the chips along each torus dimension, e.g. "topology": [4, 4, 8]',
    "hosts": 'add the number of hosts of one slice, e.g. "hosts": 32',
    "ici": 'add one ICI link, per direction: {"bandwidth_bytes_per_s": ..., "latency_s": ...}',
}


def chip_index(coords: Sequence[int], topology: Sequence[int]) -> int:
    """The number of the chip at ``coords`` in a slice (first dimension fastest)."""
    i = 0
    for c, size in zip(reversed(tuple(coords)), reversed(tuple(topology))):
        i = i * size + int(c)
    return i


def is_tpu_file(data: Any) -> bool:
    """A decoded cluster file in the TPU format (it names slices, not hosts)."""
    # (num_hosts beside them is refused by the TPU reader, naming num_hosts)
    return isinstance(data, dict) and ("num_slices" in data or "slice" in data)


@dataclass(frozen=True)
class TpuSlice:
    """The torus of one slice: ``topology[i]`` chips along dimension ``i``,
    a ring there when ``wraparound[i]``; ``hosts`` hosts share the slice's
    DCN traffic; ``ici`` is one link per direction, ``dcn`` one host's
    network per direction."""
    topology: tuple[int, ...]
    wraparound: tuple[bool, ...]
    hosts: int
    ici: LinkSpec
    dcn: LinkSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "topology", tuple(int(t) for t in self.topology))
        object.__setattr__(self, "wraparound", tuple(bool(w) for w in self.wraparound))

    @property
    def chips(self) -> int:
        return math.prod(self.topology)

    @property
    def name(self) -> str:
        return "x".join(map(str, self.topology))

    def coords(self, index: int) -> tuple[int, ...]:
        """Torus coordinates of chip ``index`` of a slice (first dimension fastest)."""
        out = []
        for size in self.topology:
            out.append(index % size)
            index //= size
        return tuple(out)

    def index(self, coords: Sequence[int]) -> int:
        return chip_index(coords, self.topology)

    def sub_shape(self, chips: int) -> tuple[int, ...] | None:
        """The block the first ``chips`` chips of a slice fill, or None when
        they do not fill a block (then the cost model treats them as a line)."""
        out, rest = [], chips
        for size in self.topology:
            take = size if rest % size == 0 else (rest if size % rest == 0 else 0)
            if take == 0:
                return None
            out.append(take)
            rest //= take
        return tuple(out) if rest == 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {"topology": list(self.topology), "wraparound": list(self.wraparound),
                "hosts": self.hosts, "ici": self.ici.to_dict()}


def parse_tpu(top: dict[str, Any], r: Any, header: Callable[[dict[str, Any]], tuple],
              device: Callable[[Any, str], Any], link_type: type) -> dict[str, Any]:
    """The ``ClusterSpec`` fields of a TPU cluster file (``r``: the cluster
    parser's reader; ``header`` and ``device`` parse what GPU files share)."""
    r.obj(top, "$", TOP_KEYS, TOP_OPTIONAL)
    name, description, sources = header(top)
    slices = r.count(top["num_slices"], "$.num_slices")
    sl = r.obj(top["slice"], "$.slice", SLICE_KEYS, SLICE_OPTIONAL)
    chip = device(sl["chip"], "$.slice.chip")
    topo_raw = sl["topology"]
    if isinstance(topo_raw, str):       # "4x4x8", as Google writes it
        parts = topo_raw.strip().lower().split("x")
        if not all(p.isdigit() for p in parts):
            raise r.fail("$.slice.topology", f"must be a list of integers such as [4, 4, 8] "
                         f"or a string such as \"4x4x8\", got {_show(topo_raw)}")
        topo_raw = [int(p) for p in parts]
    if not isinstance(topo_raw, list) or not 1 <= len(topo_raw) <= 4:
        raise r.fail("$.slice.topology", f"must be a list of 1 to 4 positive integers "
                     f"(chips per torus dimension), got {_show(topo_raw)}")
    topology = tuple(r.count(t, f"$.slice.topology[{i}]") for i, t in enumerate(topo_raw))
    if "wraparound" in sl:
        wrap_raw = sl["wraparound"]
        if not isinstance(wrap_raw, list) or len(wrap_raw) != len(topology):
            raise r.fail("$.slice.wraparound", f"must be a list of {len(topology)} booleans, one "
                         f"per dimension of the topology, got {_show(wrap_raw)}")
        for i, w in enumerate(wrap_raw):
            if not isinstance(w, bool):
                raise r.fail(f"$.slice.wraparound[{i}]", f"must be true or false, got {_show(w)}")
        wrap = tuple(wrap_raw)
    else:
        wrap = tuple(t > 2 for t in topology)
    chips = math.prod(topology)
    hosts = r.count(sl["hosts"], "$.slice.hosts")
    if chips % hosts:
        raise r.fail("$.slice.hosts", f"is {hosts}, which does not divide the slice's {chips} "
                     f"chips ({'x'.join(map(str, topology))}); give the number of hosts of "
                     "one slice")
    if "num_devices" in top:
        total = r.count(top["num_devices"], "$.num_devices")
        if total != slices * chips:
            raise r.fail("$.num_devices", f"is {total} but num_slices x chips per slice = "
                         f"{slices} x {chips} = {slices * chips}; fix one of them or drop "
                         "num_devices")
    ici = r.link(sl["ici"], "$.slice.ici")
    dcn = r.link(top["dcn"], "$.dcn")
    tpu = TpuSlice(topology, wrap, hosts, ici, dcn)
    return dict(name=name, num_hosts=slices, devices_per_host=chips, device=chip,
                intra_host=ici, inter_host=slice_network(tpu, link_type),
                description=description, sources=sources, tpu=tpu)


def slice_network(tpu: TpuSlice, link_type: type) -> LinkSpec:
    """One slice's DCN: every host's network together (what a GPU cluster
    calls a host's inter-host link)."""
    return link_type(tpu.dcn.bandwidth_bytes_per_s * tpu.hosts, tpu.dcn.latency_s,
                     tpu.dcn.efficiency)


def to_dict(cluster: ClusterSpec, fmt: str) -> dict[str, Any]:
    tpu = cluster.tpu
    assert tpu is not None
    return {"format": fmt, "name": cluster.name, "description": cluster.description,
            "sources": list(cluster.sources), "num_slices": cluster.num_hosts,
            "num_devices": cluster.num_devices,
            "slice": {"chip": cluster.device.to_dict(), **tpu.to_dict()},
            "dcn": tpu.dcn.to_dict()}


def describe(cluster: ClusterSpec, flops: str, achieved: str) -> list[str]:
    """The topology in words, line by line: the chip, one slice's torus, the
    network (the cluster adds its description and sources)."""
    tpu, d = cluster.tpu, cluster.device
    assert tpu is not None
    ici, dcn = tpu.ici, tpu.dcn
    dims = []
    for axis, (size, wrap) in enumerate(zip(tpu.topology, tpu.wraparound)):
        letter = "xyzw"[axis]
        kind = (f"a ring of {size} (wraparound: 2 x {_gb(ici)} per chip each way)" if wrap
                else f"a line of {size} (no wraparound)" if size > 1 else "1 chip")
        dims.append(f"    {letter}: {kind}")
    per_chip = tpu.dcn.bandwidth_bytes_per_s * tpu.hosts / tpu.chips
    slices = cluster.num_hosts
    lines = [
        f"cluster {cluster.name}: {slices} TPU slice(s) of {tpu.name} = "
        f"{tpu.chips} chips each, {cluster.num_devices} chips",
        f"  chip        {d.kind}, {d.memory_bytes / 2**30:.1f} GiB, "
        f"memory {d.memory_bandwidth_bytes_per_s / 1e9:.4g} GB/s",
        f"  peak        {flops} TFLOP/s",
        f"  achieved    {achieved}",
        f"  slice       {tpu.name} ICI torus, {tpu.hosts} host(s) of "
        f"{tpu.chips // tpu.hosts} chips; per dimension:",
        *dims,
        f"  ICI link    {_gb(ici)} per direction, {ici.latency_s * 1e6:.3g} us per hop"
        + (f" ({ici.efficiency:.0%} achieved)" if ici.efficiency != 1.0 else ""),
        (f"  DCN         {slices} slices joined by the data-centre network: {_gb(dcn)} per host"
         f" per direction ({per_chip / 1e9:.4g} GB/s per chip), {dcn.latency_s * 1e6:.3g} us"
         if slices > 1 else
         f"  DCN         one slice (the network, {_gb(dcn)} per host, carries no traffic)"),
        "  axes        a mesh axis over torus dimensions uses their rings; an axis over "
        "slices uses DCN",
    ]
    return lines


def _gb(link: LinkSpec) -> str:
    return f"{link.bandwidth_bytes_per_s / 1e9:.4g} GB/s"


def _show(value: Any) -> str:
    return f"{value!r} (a string)" if isinstance(value, str) else (
        "an object" if isinstance(value, Mapping) else repr(value))


# ---------------------------------------------------------------------------
# Cluster.local() on a TPU: the torus from the devices' coordinates

def topology_of(devices: Sequence[Any]) -> tuple[int, tuple[int, ...], list[tuple[int, int]]]:
    """``(num_slices, topology, order)`` of TPU device objects that carry
    ``coords`` (x, y, z) and, on a multi-slice job, ``slice_index``.
    ``order`` lists ``(slice, chip index)`` of each device in the order given.
    A chip's cores share its coordinates; each chip counts once."""
    coords = []
    for d in devices:
        c = getattr(d, "coords", None)
        if c is None:
            raise ClusterSpecError("$", f"device {d!r} has no 'coords'; describe this TPU "
                                   "job in a cluster file (examples/clusters/tpu-*.json)")
        coords.append((int(getattr(d, "slice_index", 0) or 0), tuple(int(x) for x in c)))
    slices = sorted({s for s, _ in coords})
    rank = len(coords[0][1])
    lo = [min(c[i] for _, c in coords) for i in range(rank)]
    topology = tuple(max(c[i] for _, c in coords) - lo[i] + 1 for i in range(rank))
    while len(topology) > 1 and topology[-1] == 1:     # (a 2-D torus reports z = 0)
        topology = topology[:-1]
    per_slice = {s: {c for t, c in coords if t == s} for s in slices}
    chips = math.prod(topology)
    for s, cs in per_slice.items():
        if len(cs) != chips:
            raise ClusterSpecError("$", f"slice {s} has {len(cs)} chips but its coordinates "
                                   f"span {'x'.join(map(str, topology))} = {chips}; describe "
                                   "this TPU job in a cluster file")
    if len(coords) != len(slices) * chips:
        raise ClusterSpecError("$", f"{len(coords)} devices on {len(slices)} slice(s) of "
                               f"{chips} chips: meshplan models one device per chip; describe "
                               "this TPU job in a cluster file")
    order = [(slices.index(s), chip_index([x - l for x, l in zip(c, lo)][:len(topology)],
                                          topology)) for s, c in coords]
    return len(slices), topology, order
