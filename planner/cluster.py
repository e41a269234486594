"""ClusterSpec: an abstract description of the devices a plan targets.

A cluster is ``num_hosts`` hosts with ``devices_per_host`` identical devices
each.  The planner only ever sees this abstract description (shapes, memory,
FLOP/s and link figures); real devices are bound in ``meshplan.runtime``.

JSON format (``"format": "meshplan.cluster/1"``)::

    {
      "format": "meshplan.cluster/1",
      "name": "dgx-a100-x2",
      "description": "free text",                      # optional
      "sources": ["citation", ...],                      # optional
      "num_hosts": 2,
      "devices_per_host": 8,
      "num_devices": 16,                                 # optional; must equal hosts * devices_per_host
      "device": {
        "kind": "A100-SXM4-80GB",
        "memory_bytes": 85899345920,
        "memory_bandwidth_bytes_per_s": 2.039e12,
        "peak_flops": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}
      },
      "links": {
        "intra_host": {"bandwidth_bytes_per_s": 300e9, "latency_s": 5e-6},
        "inter_host": {"bandwidth_bytes_per_s": 200e9, "latency_s": 1e-5}
      }
    }

Optional, what the hardware achieves rather than its peak (absent: the
ideal peak figures, no overheads)::

      "device": {..., "achieved": {
        "matmul_efficiency": 0.86,      # fraction of peak FLOP/s a large matmul reaches
        "memory_efficiency": 0.9,       # fraction of memory bandwidth a streaming kernel reaches
        "kernel_launch_s": 5e-6,        # fixed cost of every kernel (fusion, matmul, collective)
        "matmul_kernel_min_s": 1e-5,    # a matmul kernel's shortest time, launch included:
                                        # it costs max(this, launch + roofline) (0: launch only)
        "memory_kernel_min_s": 3e-6,    # the same floor for every other compute kernel
                                        # (a fusion, a reduction, a copy); not collectives
        "program_dispatch_s": 2e-5,     # fixed cost of launching one compiled program
        "dispatch_per_device_s": 1e-6,  # and what it adds per device the program runs on
        "compute_units": 108,           # SMs / cores a matmul's tiles are spread over (0: none)
        "tile_elements": 16384,         # output elements of one matmul tile (128 x 128)
        "shared_host_compute": false,   # the devices of a host share one pool of compute
        "overlap_communication": true,  # collectives run beside compute (GPU streams):
                                        # gradient reductions and pipeline sends can hide
                                        # under it (cost_model/overlap.py); false: every
                                        # collective on the critical path (XLA's CPU back end)
        "fusion_writes_shared": false   # true: a fused value several operators read is
      }},                               # written to memory and read back (XLA's CPU back
                                        # end); false: kept in registers (GPU)
      "links": {"intra_host": {..., "efficiency": 0.7}}   # fraction of bandwidth a large
                                                          # collective reaches (bus bandwidth)

Optional, the link between each device and its host's memory (PCIe), what
offloading state to host memory pays (absent: offloading is not planned)::

      "links": {..., "host_device": {"bandwidth_bytes_per_s": 31.5e9, "latency_s": 1e-5,
                                     "efficiency": 0.8,          # optional, as for links
                                     "separate_memory": true}}   # optional; false: the
                                                                 # device memory is the host's

``links.intra_host.bandwidth_bytes_per_s`` is per device, per direction.
``links.inter_host.bandwidth_bytes_per_s`` is the whole host's network
bandwidth per direction (all NICs together); the cost model shares it among
the devices of a host that communicate across hosts at the same time.

Parsing is strict: unknown keys, missing keys, wrong types and impossible
values raise :class:`~meshplan.errors.ClusterSpecError` naming the JSON path
of the culprit (``$.device.peak_flops.bfloat16``) and what to change.
Bandwidths, memory and FLOP/s must be positive; a latency may be zero (an
idealised link) but not negative.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from . import tpu as _tpu
from .errors import ClusterSpecError, warn

CLUSTER_FORMAT = "meshplan.cluster/1"

# dtype names a cluster file may give a peak FLOP/s figure for.
KNOWN_DTYPES = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn",
                "float8_e5m2", "int8", "int32", "tfloat32")
_DTYPE_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
    "fp32": "float32", "f32": "float32", "single": "float32",
    "fp64": "float64", "f64": "float64", "double": "float64", "tf32": "tfloat32",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2",
    "i8": "int8", "s8": "int8", "complex64": "float32", "complex128": "float64",
}
# Where flops_for looks when the exact dtype has no figure (before float32).
_FLOPS_FALLBACK = {
    "bfloat16": ("float16",),
    "float16": ("bfloat16",),
    "float8_e4m3fn": ("float8_e5m2", "bfloat16", "float16"),
    "float8_e5m2": ("float8_e4m3fn", "bfloat16", "float16"),
    # integer operations (a random generator's) run on the 32-bit integer units
    "uint32": ("int32",), "uint8": ("int32",), "uint16": ("int32",), "uint64": ("int32",),
    "int16": ("int32",), "int64": ("int32",),
}


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_bytes_per_s: float
    latency_s: float
    # fraction of the bandwidth a large collective reaches (nccl-tests' bus
    # bandwidth over the link's peak); 1.0 is the ideal link
    efficiency: float = 1.0

    @property
    def achieved_bandwidth(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency

    def to_dict(self) -> dict[str, float]:
        d = {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}
        if self.efficiency != 1.0:
            d["efficiency"] = self.efficiency
        return d


@dataclass(frozen=True)
class HostLink:
    """One device's link to its host's memory (PCIe), per direction: what
    moving offloaded state between host and device costs.  ``separate_memory``
    False: the device's memory is the host's own (XLA's CPU devices), so a
    copy "to the host" frees nothing the planner counts."""
    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float = 1.0
    separate_memory: bool = True

    @property
    def achieved_bandwidth(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` one way (one transfer)."""
        return self.latency_s + nbytes / self.achieved_bandwidth if nbytes > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                             "latency_s": self.latency_s}
        if self.efficiency != 1.0:
            d["efficiency"] = self.efficiency
        if not self.separate_memory:
            d["separate_memory"] = False
        return d


@dataclass(frozen=True)
class Achieved:
    """What a device achieves, as opposed to its datasheet peak.  The
    defaults are the ideal device (peak rates, no fixed costs): a cluster
    file without an ``achieved`` object plans as it always did."""
    matmul_efficiency: float = 1.0     # large matmul FLOP/s over peak
    memory_efficiency: float = 1.0     # streaming bandwidth over peak
    kernel_launch_s: float = 0.0       # per kernel (fusion, matmul, collective)
    # A kernel's shortest time, launch included (ramp-up, a GEMM's prologue and
    # epilogue): a compute kernel costs max(floor, launch + roofline).  0: no
    # floor beyond the launch, as files from before these fields were planned
    matmul_kernel_min_s: float = 0.0   # matmuls and convolutions
    memory_kernel_min_s: float = 0.0   # every other compute kernel (not collectives)
    program_dispatch_s: float = 0.0    # per compiled program launched
    # added to a program's dispatch per device it runs on: one process
    # enqueues each device's copy (XLA:CPU measured 18 us on one device, 118
    # on eight: benchmarks/cpu_effects.py).  0: the same on any devices
    dispatch_per_device_s: float = 0.0
    # The host's seconds per stage program of a pipeline: the driver's own
    # work (inputs, sends, running sums) and jit's dispatch of the program,
    # measured on a real pipeline by `meshplan calibrate`.  One thread per
    # host dispatches the programs of its stages, so a pipelined step takes at
    # least this times the busiest host's programs (dp_search.stages._host_s).
    # 0: not known
    pipeline_program_s: float = 0.0
    # ... and its seconds per array buffer a stage program takes or makes (one
    # per device an array lives on): jit's dispatch grows with them (an H200
    # host: about 8 us each, gpt-350m's programs 300-2000 buffers,
    # benchmarks/results/gpu_driver.md).  0: not known
    pipeline_buffer_s: float = 0.0
    # XLA's fake CPU devices: the time a program on several devices takes
    # while the host's other devices are busy, per program and per device it
    # runs on (its device threads wait for cores the busy ones hold; a
    # program on one device runs in the caller's thread).  Measured by
    # `meshplan calibrate` with a trivial program on a quarter and on half of
    # the devices while the others run matmuls (the 2-core host: 1.4-1.6 ms
    # on 2 and 4 of 8 devices against 65-120 us on an idle host,
    # benchmarks/results/measured_grid.md, stop 72).  Charged for every stage
    # program on several devices of a pipeline of two or more stages,
    # whose other stages keep the host busy.  0: not known, or none
    busy_program_s: float = 0.0
    busy_program_per_device_s: float = 0.0
    compute_units: int = 0             # matmul tiles spread over these (0: no wave quantization)
    tile_elements: int = 128 * 128     # output elements per matmul tile
    # the devices of a host share one pool of compute (XLA's fake CPU
    # devices): a device idle in a pipeline bubble lends its share to others
    shared_host_compute: bool = False
    # collectives run beside compute (GPU streams), so gradient reductions and
    # pipeline sends can hide under it (cost_model/overlap.py).  False, the
    # default, puts every collective on the critical path, as XLA's CPU back
    # end runs them and as files from before this field were planned
    overlap_communication: bool = False
    # a fused value that several operators read is written to memory and
    # read back by each (XLA's CPU back end: cost_model.fusion); False: each
    # reading kernel has it in registers (a GPU's XLA), as files from before
    # this field were planned
    fusion_writes_shared: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in _UNSET_UNWRITTEN + _FALSE_UNWRITTEN:  # written only when given:
            if not d[key]:                              # older files stay as they were
                del d[key]
        return d

    @property
    def is_ideal(self) -> bool:
        return self == Achieved()

    def dispatch_s(self, devices: int) -> float:
        """Launching one compiled program on ``devices`` devices."""
        return self.program_dispatch_s + devices * self.dispatch_per_device_s

    def busy_s(self, devices: int) -> float:
        """What a program on ``devices`` devices adds while other devices of
        its host are busy (``busy_program_s``); nothing on one device."""
        if devices < 2:
            return 0.0
        return self.busy_program_s + devices * self.busy_program_per_device_s


# written only when non-zero: files from before these fields stay as they were
_UNSET_UNWRITTEN = ("matmul_kernel_min_s", "memory_kernel_min_s", "dispatch_per_device_s",
                    "pipeline_program_s", "pipeline_buffer_s", "busy_program_s",
                    "busy_program_per_device_s")
# ... and only when true
_FALSE_UNWRITTEN = ("fusion_writes_shared",)


@dataclass(frozen=True)
class DeviceSpec:
    kind: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    # (dtype name, FLOP/s) pairs, sorted by dtype name.
    peak_flops: tuple[tuple[str, float], ...]
    achieved: Achieved = Achieved()

    def __post_init__(self) -> None:
        # Accept a mapping or unsorted pairs; store the canonical sorted tuple.
        pairs = self.peak_flops.items() if isinstance(self.peak_flops, Mapping) else self.peak_flops
        object.__setattr__(self, "peak_flops",
                           tuple(sorted((str(k), float(v)) for k, v in pairs)))

    def flops_for(self, dtype: Any) -> float:
        """Peak FLOP/s for ``dtype`` (a numpy/jax dtype or its name).

        Without an exact figure: float16 and bfloat16 stand in for each other,
        a float8 uses the other float8 then the 16-bit figure, float64 is half
        the float32 figure, integers other than int8 use the int32 figure
        when there is one, and everything else (tfloat32, bool, unknown
        names, integers without an int32 figure) uses the float32 figure.  If float32 itself is missing
        the smallest figure given is used, a conservative guess.
        """
        table = dict(self.peak_flops)
        if not table:
            raise ClusterSpecError("$.device.peak_flops",
                                   "is empty; give at least a float32 figure")
        name = _dtype_name(dtype)
        if name in table:
            return table[name]
        for alt in _FLOPS_FALLBACK.get(name, ()):
            if alt in table:
                return table[alt]
        f32 = table.get("float32", min(table.values()))
        return f32 / 2 if name == "float64" else f32

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "memory_bytes": self.memory_bytes,
             "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
             "peak_flops": dict(self.peak_flops)}
        if not self.achieved.is_ideal:
            d["achieved"] = self.achieved.to_dict()
        return d


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    num_hosts: int
    devices_per_host: int
    device: DeviceSpec
    intra_host: LinkSpec
    inter_host: LinkSpec
    description: str = ""
    sources: tuple[str, ...] = ()
    # TPU slices (meshplan.tpu): a "host" is then a slice, its devices the chips
    tpu: _tpu.TpuSlice | None = None
    # device <-> host memory (None: not given; offloading is not planned)
    host_link: HostLink | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    @property
    def shape(self) -> tuple[int, int]:
        """``(num_hosts, devices_per_host)``: the physical mesh."""
        return (self.num_hosts, self.devices_per_host)

    @property
    def inter_host_bandwidth_per_device(self) -> float:
        """A host's network bandwidth shared evenly by its devices."""
        return self.inter_host.bandwidth_bytes_per_s / self.devices_per_host

    # -- JSON --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        if self.tpu is not None:
            return _tpu.to_dict(self, CLUSTER_FORMAT)
        return {
            "format": CLUSTER_FORMAT,
            "name": self.name,
            "description": self.description,
            "sources": list(self.sources),
            "num_hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "num_devices": self.num_devices,
            "device": self.device.to_dict(),
            "links": {"intra_host": self.intra_host.to_dict(),
                      "inter_host": self.inter_host.to_dict(),
                      **({"host_device": self.host_link.to_dict()}
                         if self.host_link is not None else {})},
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>") -> ClusterSpec:
        return parse_cluster(data, source=source)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<json>") -> ClusterSpec:
        return parse_cluster(_decode_json(text, source), source=source)

    # -- derived specs -------------------------------------------------------
    def with_devices(self, num_hosts: int, devices_per_host: int) -> ClusterSpec:
        """The same hardware cut down to ``num_hosts`` x ``devices_per_host``.

        Used for submeshes: both counts must fit inside this cluster.
        """
        for key, value, limit in (("num_hosts", num_hosts, self.num_hosts),
                                  ("devices_per_host", devices_per_host,
                                   self.devices_per_host)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterSpecError(f"$.{key}", f"a submesh needs a positive integer "
                                       f"{key}, got {_show(value)}")
            if value > limit:
                raise ClusterSpecError(f"$.{key}", f"a submesh of {self.name!r} can have at "
                                       f"most {limit} {key.replace('_', ' ')}, got {value}")
        if (num_hosts, devices_per_host) == self.shape:
            return self
        return dataclasses.replace(self, name=f"{self.name}[{num_hosts}x{devices_per_host}]",
                                   num_hosts=num_hosts, devices_per_host=devices_per_host)

    @classmethod
    def local(cls) -> ClusterSpec:
        """Describe the devices JAX sees (``jax.devices()``) in this process.

        Memory is the allocator limit XLA reports when it reports one (for CPU,
        the host's physical memory split evenly among the local devices).
        Peak FLOP/s and the intra-host link come from a table of datasheet
        figures for known device kinds; link figures are platform defaults,
        not measurements.
        """
        import jax  # lazily: parsing cluster files must not need jax
        from meshplan import datasheets  # (and not the device tables)

        devices = jax.devices()
        hosts, per_host = jax.process_count(), jax.local_device_count()
        platform = devices[0].platform.lower()
        if platform == "tpu":
            return cls.from_tpu_devices(devices, process_count=hosts)
        kind = str(devices[0].device_kind).strip() or platform
        notes = []
        if hosts * per_host != len(devices):
            notes.append(f"{hosts} processes with {per_host} local devices do not make up "
                         f"the {len(devices)} devices; treated as one host")
            hosts, per_host = 1, len(devices)
        known = datasheets.known_device(platform, kind)
        if known is None:
            known = datasheets.generic_device(platform)
            warn(f"meshplan: no datasheet figures for device kind {kind!r} on "
                 f"{platform}; using rough defaults (see ClusterSpec.describe())")
        memory = datasheets.allocator_limit(jax.local_devices()[0])
        if memory is not None:
            notes.append("memory is the XLA allocator limit")
        elif platform == "cpu":
            memory = max(1, datasheets.physical_memory() // per_host)
            notes.append("memory is the host's physical memory split among local devices")
        else:
            memory = datasheets.memory_from_kind(kind) or known.memory_bytes
            notes.append("memory is the nominal figure for the device kind")
        notes_text = "; ".join(notes)
        description = (f"Described from jax.devices(): {len(devices)} x {kind!r} on {platform}. "
                       f"{known.note} {notes_text[:1].upper()}{notes_text[1:]}. Link figures "
                       f"are platform defaults (estimates), not measurements; "
                       f"`meshplan calibrate` measures them.")
        return cls(
            name=f"local-{platform}-{hosts}x{per_host}", num_hosts=hosts,
            devices_per_host=per_host,
            device=DeviceSpec(kind=kind, memory_bytes=int(memory),
                              memory_bandwidth_bytes_per_s=known.memory_bandwidth,
                              peak_flops=known.flops,
                              # XLA's host devices are threads over the same cores
                              achieved=Achieved(**{**dict(known.achieved),
                                                   "shared_host_compute": platform == "cpu"})),
            intra_host=LinkSpec(*known.intra_host), inter_host=LinkSpec(*known.inter_host),
            host_link=_local_host_link(platform, known, datasheets.HOST_LINK_EFFICIENCY),
            description=description, sources=(known.source,))

    @classmethod
    def from_tpu_devices(cls, devices: Any, *, process_count: int = 1) -> ClusterSpec:
        """A TPU job from jax's device objects: the torus from their ``coords``,
        the slices from their ``slice_index``; chip and link figures from the
        datasheet table.  Plan device ids follow meshplan's chip numbering
        (slice-major, first torus dimension fastest); the runtime binds them
        to jax's devices in that order (``meshplan.shardings.sorted_devices``)."""
        from meshplan import datasheets

        slices, topology, _ = _tpu.topology_of(devices)
        kind = str(devices[0].device_kind).strip() or "tpu"
        known = datasheets.known_device("tpu", kind) or datasheets.generic_device("tpu")
        chips = math.prod(topology)
        hosts = max(1, process_count // slices)
        hosts = hosts if chips % hosts == 0 else 1
        tpu = _tpu.TpuSlice(topology, tuple(t > 2 for t in topology), hosts,
                            LinkSpec(*known.intra_host), LinkSpec(*known.inter_host))
        return cls(name=f"local-tpu-{tpu.name}-x{slices}",
                   num_hosts=slices, devices_per_host=chips,
                   device=DeviceSpec(kind=kind, memory_bytes=known.memory_bytes,
                                     memory_bandwidth_bytes_per_s=known.memory_bandwidth,
                                     peak_flops=known.flops),
                   intra_host=tpu.ici, inter_host=_tpu.slice_network(tpu, LinkSpec),
                   description=(f"Described from jax.devices(): {slices} slice(s) of "
                                f"{tpu.name} x {kind!r}, torus from the chips' coords. "
                                f"{known.note} Link figures are platform defaults, not "
                                "measurements."),
                   sources=(known.source,), tpu=tpu)

    # -- printing ------------------------------------------------------------
    def describe(self) -> str:
        d = self.device
        flops = ", ".join(f"{k} {v / 1e12:.4g}" for k, v in d.peak_flops)
        if self.tpu is not None:
            lines = _tpu.describe(self, flops, _achieved_text(d.achieved))
        else:
            lines = self._describe_hosts(flops)
        if self.description:
            lines.append(f"  about       {self.description}")
        if self.sources:
            lines.append("  sources")
            lines.extend(f"    - {s}" for s in self.sources)
        return "\n".join(lines)

    def _describe_hosts(self, flops: str) -> list[str]:
        d = self.device
        return [
            f"cluster {self.name}: {self.num_hosts} host(s) x {self.devices_per_host} "
            f"device(s) = {self.num_devices} devices",
            f"  device      {d.kind}, {d.memory_bytes / 2**30:.1f} GiB, "
            f"memory {d.memory_bandwidth_bytes_per_s / 1e9:.4g} GB/s",
            f"  peak        {flops} TFLOP/s",
            f"  achieved    {_achieved_text(d.achieved)}",
            f"  intra-host  {_link_text(self.intra_host)} per device per direction",
            f"  inter-host  {_link_text(self.inter_host)} per host per direction "
            f"({self.inter_host_bandwidth_per_device / 1e9:.4g} GB/s per device)",
            f"  host link   {_host_link_text(self.host_link)}",
        ]

    def __str__(self) -> str:
        return self.describe()


def _link_text(link: LinkSpec) -> str:
    eff = f" ({link.efficiency:.0%} achieved)" if link.efficiency != 1.0 else ""
    return f"{link.bandwidth_bytes_per_s / 1e9:.4g} GB/s{eff}, {link.latency_s * 1e6:.3g} us"


def _local_host_link(platform: str, known: Any, efficiency: float) -> HostLink | None:
    """The host link of local devices: on XLA's CPU devices host memory is
    device memory ("offloading" is a copy at memory bandwidth); a known GPU
    has its PCIe link (``meshplan.datasheets``); others have none."""
    if platform == "cpu":
        return HostLink(known.memory_bandwidth, 0.0, separate_memory=False)
    if known.host_link is None:
        return None
    return HostLink(*known.host_link, efficiency=efficiency)


def _host_link_text(h: HostLink | None) -> str:
    if h is None:
        return "not given (offloading to host memory is not planned)"
    eff = f" ({h.efficiency:.0%} achieved)" if h.efficiency != 1.0 else ""
    shared = "" if h.separate_memory else "; host memory is device memory"
    return (f"{h.bandwidth_bytes_per_s / 1e9:.4g} GB/s{eff}, {h.latency_s * 1e6:.3g} us "
            f"per device per direction{shared}")


def _achieved_text(a: Achieved) -> str:
    if a.is_ideal:
        return "not given: peak rates, no fixed costs (ideal)"
    waves = (f", tiles of {a.tile_elements} over {a.compute_units} units"
             if a.compute_units else "")
    shared = ", devices share the host's compute" if a.shared_host_compute else ""
    shared += ", collectives overlap compute" if a.overlap_communication else ""
    shared += ", shared fused values written to memory" if a.fusion_writes_shared else ""
    per_device = (f" + {a.dispatch_per_device_s * 1e6:.3g} us per device"
                  if a.dispatch_per_device_s else "")
    floors = (f", kernels at least {a.matmul_kernel_min_s * 1e6:.3g} us (matmul) and "
              f"{a.memory_kernel_min_s * 1e6:.3g} us (other)"
              if a.matmul_kernel_min_s or a.memory_kernel_min_s else "")
    host = (f", {a.pipeline_program_s * 1e6:.3g} us of the host per pipeline program"
            if a.pipeline_program_s else "")
    host += (f" + {a.pipeline_buffer_s * 1e6:.3g} us per buffer" if a.pipeline_buffer_s else "")
    host += (f", a stage program on several devices {a.busy_program_s * 1e6:.3g} us + "
             f"{a.busy_program_per_device_s * 1e6:.3g} us per device beside busy devices"
             if a.busy_program_s or a.busy_program_per_device_s else "")
    return (f"matmul {a.matmul_efficiency:.0%}, memory {a.memory_efficiency:.0%} of peak, "
            f"{a.kernel_launch_s * 1e6:.3g} us per kernel{floors}, "
            f"{a.program_dispatch_s * 1e6:.3g} us per program{per_device}{host}{waves}{shared}")


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype.strip().lower()
    else:
        try:
            import numpy as np
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype).lower()
    return _DTYPE_ALIASES.get(name, name)


# ---------------------------------------------------------------------------
# Parsing

_MAX_COUNT = 2**53          # counts (hosts, devices, bytes) beyond this are not real
_TOP_REQUIRED = ("format", "name", "num_hosts", "devices_per_host", "device", "links")
_TOP_OPTIONAL = ("description", "sources", "num_devices")
_DEVICE_KEYS = ("kind", "memory_bytes", "memory_bandwidth_bytes_per_s", "peak_flops")
_DEVICE_OPTIONAL = ("achieved",)
_ACHIEVED_KEYS = tuple(f.name for f in dataclasses.fields(Achieved))
_LINKS_KEYS = ("intra_host", "inter_host")
_LINKS_OPTIONAL = ("host_device",)
_HOST_LINK_OPTIONAL = ("efficiency", "separate_memory")
_LINK_KEYS = ("bandwidth_bytes_per_s", "latency_s")
_LINK_OPTIONAL = ("efficiency",)

_HINTS = {
    "format": f'add "format": "{CLUSTER_FORMAT}"',
    "name": 'add a short name, e.g. "name": "my-cluster"',
    "num_hosts": 'add the number of hosts, e.g. "num_hosts": 1',
    "devices_per_host": 'add the number of devices on each host, e.g. "devices_per_host": 8',
    "device": 'add a "device" object with ' + ", ".join(_DEVICE_KEYS),
    "links": 'add a "links" object with "intra_host" and "inter_host"',
    "kind": 'add the device kind, e.g. "kind": "A100-SXM4-80GB"',
    "memory_bytes": "add the memory of one device in bytes (an integer)",
    "memory_bandwidth_bytes_per_s": "add the memory bandwidth of one device in bytes/s",
    "peak_flops": 'add peak FLOP/s per dtype, e.g. "peak_flops": {"float32": 1.95e13}',
    "intra_host": 'add the link between devices of one host: {"bandwidth_bytes_per_s": ..., '
                  '"latency_s": ...}',
    "inter_host": 'add the network between hosts: {"bandwidth_bytes_per_s": ..., '
                  '"latency_s": ...}',
    "bandwidth_bytes_per_s": "add the bandwidth in bytes per second, per direction",
    "latency_s": "add the latency in seconds, e.g. 5e-06",
    **_tpu.HINTS,
}


class _Reader:
    """Validates one decoded JSON value; every failure names its JSON path."""

    def __init__(self, source: str):
        self.where = "" if source == "<dict>" else f" (in {source})"

    def fail(self, path: str, problem: str) -> ClusterSpecError:
        return ClusterSpecError(path, problem + self.where)

    def obj(self, value: Any, path: str, required: tuple[str, ...],
            optional: tuple[str, ...] = ()) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a JSON object, got {_show(value)}")
        allowed = required + optional
        for key in value:
            if key not in allowed:
                close = _suggest(str(key), allowed)
                hint = f"did you mean {close!r}? " if close else ""
                raise self.fail(f"{path}.{key}", f"unknown key {key!r}; {hint}allowed keys "
                                f"here: {', '.join(allowed)}")
        for key in required:
            if key not in value:
                raise self.fail(f"{path}.{key}", f"is missing; {_HINTS[key]}")
        return value

    def string(self, value: Any, path: str, *, empty_ok: bool = False) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"must be a string, got {_show(value)}")
        if not empty_ok and not value.strip():
            raise self.fail(path, "must be a non-empty string")
        return value

    def count(self, value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"must be a positive integer, got {_show(value)}")
        if value < 1:
            raise self.fail(path, f"must be a positive integer, got {_show(value)}")
        if value > _MAX_COUNT:
            # (found by fuzzing: 10**400 hosts loaded, then broke float arithmetic)
            raise self.fail(path, f"is implausibly large ({_show(value)}); at most "
                            f"2**53 = {_MAX_COUNT}")
        return value

    def number(self, value: Any, path: str, *, zero_ok: bool = False) -> float:
        want = "a non-negative number" if zero_ok else "a positive number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"must be {want}, got {_show(value)}")
        try:
            value = float(value)
        except OverflowError:
            # (found by fuzzing: an integer beyond float range raised OverflowError)
            raise self.fail(path, f"must be {want}, got {_show(value)} (too large for a "
                            "float)") from None
        if not math.isfinite(value):
            raise self.fail(path, f"must be {want}, got {_show(value)} (not finite)")
        if value < 0 or (value == 0 and not zero_ok):
            raise self.fail(path, f"must be {want}, got {value}")
        return float(value)

    def fraction(self, value: Any, path: str) -> float:
        v = self.number(value, path)
        if v > 1:
            raise self.fail(path, f"is a fraction of the peak figure, at most 1, got {v}")
        return v

    def link(self, value: Any, path: str) -> LinkSpec:
        d = self.obj(value, path, _LINK_KEYS, _LINK_OPTIONAL)
        return LinkSpec(
            bandwidth_bytes_per_s=self.number(d["bandwidth_bytes_per_s"],
                                              f"{path}.bandwidth_bytes_per_s"),
            latency_s=self.number(d["latency_s"], f"{path}.latency_s", zero_ok=True),
            efficiency=self.fraction(d.get("efficiency", 1.0), f"{path}.efficiency"))

    def host_link(self, value: Any, path: str) -> HostLink:
        d = self.obj(value, path, _LINK_KEYS, _HOST_LINK_OPTIONAL)
        separate = d.get("separate_memory", True)
        if not isinstance(separate, bool):
            raise self.fail(f"{path}.separate_memory", f"must be true or false, got "
                            f"{_show(separate)}")
        return HostLink(
            bandwidth_bytes_per_s=self.number(d["bandwidth_bytes_per_s"],
                                              f"{path}.bandwidth_bytes_per_s"),
            latency_s=self.number(d["latency_s"], f"{path}.latency_s", zero_ok=True),
            efficiency=self.fraction(d.get("efficiency", 1.0), f"{path}.efficiency"),
            separate_memory=separate)

    def achieved(self, value: Any, path: str) -> Achieved:
        d = self.obj(value, path, (), _ACHIEVED_KEYS)
        out: dict[str, Any] = {}
        for key in ("matmul_efficiency", "memory_efficiency"):
            if key in d:
                out[key] = self.fraction(d[key], f"{path}.{key}")
        for key in ("kernel_launch_s", "program_dispatch_s") + _UNSET_UNWRITTEN:
            if key in d:
                out[key] = self.number(d[key], f"{path}.{key}", zero_ok=True)
        if "compute_units" in d:
            units = d["compute_units"]
            out["compute_units"] = 0 if units == 0 and not isinstance(units, bool) else \
                self.count(units, f"{path}.compute_units")
        if "tile_elements" in d:
            out["tile_elements"] = self.count(d["tile_elements"], f"{path}.tile_elements")
        for key in ("shared_host_compute", "overlap_communication") + _FALSE_UNWRITTEN:
            if key in d:
                if not isinstance(d[key], bool):
                    raise self.fail(f"{path}.{key}", f"must be true or false, got "
                                    f"{_show(d[key])}")
                out[key] = d[key]
        return Achieved(**out)

    def peak_flops(self, value: Any, path: str) -> tuple[tuple[str, float], ...]:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a JSON object of dtype name -> FLOP/s, "
                            f"got {_show(value)}")
        if not value:
            raise self.fail(path, 'is empty; give at least one figure, e.g. '
                            '{"float32": 1.95e13}')
        pairs = []
        for key, flops in value.items():
            if key not in KNOWN_DTYPES:
                alias = _DTYPE_ALIASES.get(str(key).lower())
                hint = (f"write {alias!r}" if alias in KNOWN_DTYPES
                        else f"use one of {', '.join(KNOWN_DTYPES)}")
                raise self.fail(f"{path}.{key}", f"unknown dtype {key!r}; {hint}")
            pairs.append((key, self.number(flops, f"{path}.{key}")))
        return tuple(sorted(pairs))


def parse_cluster(data: Any, *, source: str = "<dict>") -> ClusterSpec:
    """Validate a decoded cluster JSON object and build a :class:`ClusterSpec`.

    ``source`` (a file name) is appended to error messages.
    """
    r = _Reader(source)
    fmt = data.get("format") if isinstance(data, dict) else None
    if isinstance(fmt, str) and fmt.startswith("meshplan.plan/"):
        raise r.fail("$.format", f"is {fmt!r}: this is a plan file, not a cluster "
                     f"({CLUSTER_FORMAT}); give a cluster JSON (one in examples/clusters, or "
                     "what meshplan calibrate wrote)")
    if _tpu.is_tpu_file(data):
        return ClusterSpec(**_tpu.parse_tpu(data, r, lambda top: _header(r, top),
                                            lambda v, path: _device(r, v, path), LinkSpec))
    top = r.obj(data, "$", _TOP_REQUIRED, _TOP_OPTIONAL)
    name, description, sources = _header(r, top)
    hosts = r.count(top["num_hosts"], "$.num_hosts")
    per_host = r.count(top["devices_per_host"], "$.devices_per_host")
    if "num_devices" in top:
        total = r.count(top["num_devices"], "$.num_devices")
        if total != hosts * per_host:
            raise r.fail("$.num_devices", f"is {total} but num_hosts x devices_per_host = "
                         f"{hosts} x {per_host} = {hosts * per_host}; fix one of them "
                         f"or drop num_devices")

    device = _device(r, top["device"], "$.device")
    links = r.obj(top["links"], "$.links", _LINKS_KEYS, _LINKS_OPTIONAL)
    return ClusterSpec(
        name=name, num_hosts=hosts, devices_per_host=per_host, device=device,
        intra_host=r.link(links["intra_host"], "$.links.intra_host"),
        inter_host=r.link(links["inter_host"], "$.links.inter_host"),
        host_link=(r.host_link(links["host_device"], "$.links.host_device")
                   if "host_device" in links else None),
        description=description, sources=sources)


def _header(r: _Reader, top: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    """``(name, description, sources)``, checking the format, of any cluster file."""
    fmt = top["format"]
    if fmt != CLUSTER_FORMAT:
        raise r.fail("$.format", f'must be "{CLUSTER_FORMAT}", got {_show(fmt)}')
    name = r.string(top["name"], "$.name")
    description = r.string(top.get("description", ""), "$.description", empty_ok=True)
    raw_sources = top.get("sources", [])
    if not isinstance(raw_sources, list):
        raise r.fail("$.sources", f"must be a list of strings, got {_show(raw_sources)}")
    return name, description, tuple(r.string(s, f"$.sources[{i}]")
                                    for i, s in enumerate(raw_sources))


def _device(r: _Reader, value: Any, path: str) -> DeviceSpec:
    dev = r.obj(value, path, _DEVICE_KEYS, _DEVICE_OPTIONAL)
    memory = r.count(dev["memory_bytes"], f"{path}.memory_bytes")
    return DeviceSpec(
        kind=r.string(dev["kind"], f"{path}.kind"),
        memory_bytes=memory,
        memory_bandwidth_bytes_per_s=r.number(dev["memory_bandwidth_bytes_per_s"],
                                              f"{path}.memory_bandwidth_bytes_per_s"),
        peak_flops=r.peak_flops(dev["peak_flops"], f"{path}.peak_flops"),
        achieved=r.achieved(dev.get("achieved", {}), f"{path}.achieved"))


def _decode_json(text: str, source: str) -> Any:
    def reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ClusterSpecError("$", f"key {key!r} appears twice in one JSON object "
                                       f"in {source}; keep one")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=reject_duplicates)
    except json.JSONDecodeError as e:
        raise ClusterSpecError("$", f"{source} is not valid JSON: {e.msg} at line "
                               f"{e.lineno}, column {e.colno}; fix the syntax there") from None
    except RecursionError:
        # (found by fuzzing: "[[[[..." deeper than Python's recursion limit)
        raise ClusterSpecError("$", f"{source} nests JSON arrays/objects too deeply to be a "
                               "cluster description") from None
    except ValueError as e:
        # (found by fuzzing: an integer literal of more than 4300 digits)
        raise ClusterSpecError("$", f"{source} is not a usable JSON document: {e}") from None


def load_cluster(path: str | os.PathLike[str]) -> ClusterSpec:
    """Read and validate a cluster JSON file."""
    if not isinstance(path, (str, os.PathLike)):
        raise ClusterSpecError("$", f"load_cluster takes the path of a cluster JSON file, not "
                               f"{type(path).__name__} (a cluster's dict: ClusterSpec.from_dict)")
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        local = " (the local devices: meshplan.Cluster.local())" if source == "local" else ""
        raise ClusterSpecError("$", f"cluster file {source!r} does not exist{local}; check the "
                               f"path (examples live in examples/clusters/)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ClusterSpecError("$", f"cannot read cluster file {source!r}: {e}") from None
    return parse_cluster(_decode_json(text, source), source=source)


def _suggest(key: str, allowed: tuple[str, ...]) -> str | None:
    """The allowed key a misspelt ``key`` probably meant, if any."""
    close = difflib.get_close_matches(key, allowed, n=1)
    if not close:  # compare first words too: 'bandwith' -> 'bandwidth_bytes_per_s'
        heads = {a.split("_")[0]: a for a in allowed}
        close = [heads[h] for h in difflib.get_close_matches(key.split("_")[0], heads, n=1)]
    return close[0] if close else None


def _show(value: Any) -> str:
    """A short rendering of a JSON value for error messages."""
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"{json.dumps(value)} (a string)"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, float) and value.is_integer():
        return f"{value!r} (a float)"
    if isinstance(value, int) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value))) if value.bit_length() < 14000 else 'many'} digits"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
