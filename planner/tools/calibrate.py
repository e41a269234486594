"""``meshplan calibrate``: measure the local devices into a cluster JSON.

What is measured, all local devices at once (each device runs its own copy,
so devices that share chips or cores -- the fake CPU devices of
``--xla_force_host_platform_device_count`` -- report their share):

- peak FLOP/s per dtype (float32, bfloat16, float16 where the back end runs
  them): a jitted ``jnp.matmul`` of two n x n matrices per device, n doubled
  until one run is long enough to be compute bound; 2 n^3 / kernel time;
- memory bandwidth: ``z = x + y`` on large per-device arrays (read 2, write 1):
  3 x array bytes / kernel time (a call's time less the program dispatch
  measured below, :func:`kernel_seconds`);
- fixed costs: a jitted chain of k dependent small matmuls per device, k
  in a few sizes; the line t = a + b k gives the cost of launching one
  program (a) and one kernel (b, ``achieved.kernel_launch_s``); with
  several devices the chain runs on one device too, and the line through
  both dispatches splits a into ``achieved.program_dispatch_s`` and
  ``achieved.dispatch_per_device_s``;
- shared compute: the largest matmul on one device alone against every
  device at once; when the devices' throughput divides (each runs at under
  two thirds of its speed alone) they share the host's compute
  (``achieved.shared_host_compute``, what XLA's fake CPU devices do);
- where they share it (4 devices or more): a trivial program on a quarter
  and on half of the devices, each call waited for, on an idle host and
  while a thread keeps the other half busy with matmuls; the line through
  the time added gives ``achieved.busy_program_s`` and
  ``busy_program_per_device_s`` (:func:`busy_program`): what a pipeline's
  stage program on several devices pays while the other stages hold the
  cores.  On CPU, ``achieved.fusion_writes_shared`` is set (XLA:CPU's
  fusion, not measured);
- per axis of the physical mesh (hosts x devices per host): ``psum`` inside
  ``jax.shard_map`` at a small, a middle and a large message size (grown until
  bandwidth bound), each repeated in a ``fori_loop``; the line t = a + b S
  through the smallest and the largest gives the ring all-reduce model the
  cost model uses,
  t = 2(n-1) alpha + 2(n-1)/n S / B, so alpha = a / 2(n-1), B = 2(n-1) / (n b).

A calibration on a busy host measures the other work as much as the devices
(a shared machine's figures halved within a day).  So it checks itself: a
load average over half the CPUs before it starts, or the float32 matmul
timed again at the end more than 25% off its first time, gives a warning
(``Calibration.warnings``; the CLI prints them, the cluster's description
records them), and the faster of the two matmul times is kept.

Every time is the median of several timed runs after a warm-up run, each run
ended by ``block_until_ready``.  The timer is injectable (``timer(fn)`` runs
``fn`` once and returns seconds) so tests can drive the arithmetic with
synthetic times; the figure arithmetic lives in small pure functions.
"""
from __future__ import annotations

import datetime
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from .. import progress
from ..cluster import Achieved, ClusterSpec, DeviceSpec, LinkSpec
from ..datasheets import allocator_limit, physical_memory
from ..errors import MeshplanError

Timer = Callable[[Callable[[], Any]], float]

MATMUL_DTYPES = ("float32", "bfloat16", "float16")


def wall_timer(fn: Callable[[], Any]) -> float:
    """Run ``fn`` once (it blocks until its results are ready); seconds taken."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Options:
    """Sizes and repetitions.  ``Options.quick()`` is for tests and a first look."""
    repeats: int = 5                    # timed runs; the median is kept
    warmup: int = 1                     # untimed runs first (compilation)
    target_s: float = 0.2               # grow a size until one run takes this long
    matmul_min_n: int = 256
    matmul_max_n: int = 8192
    # random words per device (the integer rate): up to a draw's size in a
    # step; on the 8 devices of the 2-core host a word took 1.5x as long at
    # 1M words as at 64K-256K (and 3x at 4M on one device)
    bits_min: int = 1 << 12
    bits_max: int = 1 << 18
    memory_min_bytes: int = 1 << 20     # per device, per array
    memory_max_bytes: int = 1 << 30
    collective_small_bytes: int = 1 << 12
    collective_max_bytes: int = 1 << 28
    collective_loop: int = 8            # collectives per timed run (fori_loop)
    launch_chain: tuple[int, ...] = (1, 16, 64)   # kernels per program for the fixed costs
    buffer_counts: tuple[int, int] = (16, 256)    # arrays in (and out) of the buffer timing
    dtypes: tuple[str, ...] = MATMUL_DTYPES
    quick_mode: bool = False

    @classmethod
    def quick(cls) -> "Options":
        return cls(repeats=3, target_s=0.005, matmul_min_n=64, matmul_max_n=256,
                   bits_min=1 << 10, bits_max=1 << 16,
                   memory_min_bytes=1 << 16, memory_max_bytes=1 << 22,
                   collective_small_bytes=1 << 10, collective_max_bytes=1 << 20,
                   collective_loop=4, launch_chain=(1, 16), buffer_counts=(16, 128),
                   quick_mode=True)


@dataclass(frozen=True)
class Measurement:
    """One measured figure and how it was obtained."""
    what: str            # "matmul float32", "memory", "psum over 'device'"
    value: float         # FLOP/s or bytes/s (or, for collectives, bandwidth)
    size: int            # n of the matmul, bytes per device per array, largest message
    seconds: float       # median time of one run at ``size`` (per collective for psum)
    latency_s: float = 0.0


@dataclass(frozen=True)
class Calibration:
    cluster: ClusterSpec
    measurements: tuple[Measurement, ...]
    # what makes the figures doubtful (a busy host, a speed that changed
    # while measuring): one line each, for the user to act on
    warnings: tuple[str, ...] = ()


# ---------------------------------------------------------------------------
# pure arithmetic

def matmul_flops(n: int, seconds: float) -> float:
    """FLOP/s of an n x n by n x n matmul taking ``seconds``."""
    return 2.0 * n ** 3 / seconds


def add_bandwidth(nbytes: int, seconds: float) -> float:
    """Bytes/s of ``x + y`` over arrays of ``nbytes`` each (two read, one written)."""
    return 3.0 * nbytes / seconds


def kernel_seconds(seconds: float, dispatch_s: float) -> float:
    """A single timed call's kernel time: the call less launching its program
    (on a GPU the 0.1 ms of dispatch and waiting is 5-25% of a large matmul or
    copy; benchmarks/results/gpu_check.md).  A call under twice the dispatch
    is mostly fixed cost and keeps its whole time."""
    return seconds - dispatch_s if seconds > 2 * dispatch_s else seconds


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + b * s`` through ``(s, t)`` points: ``(a, b)``."""
    if len(points) < 2:
        raise ValueError("a line needs at least two points")
    xs = [float(p[0]) for p in points]
    ys = [float(p[1]) for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("the points need at least two different sizes")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def split_dispatch(on_all: float, alone: float, n: int) -> tuple[float, float]:
    """(fixed, per device) seconds of a program's dispatch from its dispatch
    on ``n`` devices and on one: the line through both, neither part
    negative (noise that puts one device above all of them: no per-device part)."""
    if n < 2:
        return on_all, 0.0
    per_device = min(on_all / n, max(0.0, (on_all - alone) / (n - 1)))
    return on_all - n * per_device, per_device


def busy_program(quiet: Sequence[tuple[int, float]], loaded: Sequence[tuple[int, float]]
                 ) -> tuple[float, float]:
    """(per program, per device) seconds a program on several devices adds
    while the host's other devices are busy, from (devices, seconds) of the
    same program on an idle host (``quiet``) and beside busy devices
    (``loaded``): the line through the differences, neither part negative."""
    idle = dict(quiet)
    extra = [(k, max(0.0, t - idle[k])) for k, t in loaded]
    if len(extra) < 2:
        return (extra[0][1], 0.0) if extra else (0.0, 0.0)
    a, b = fit_line(extra)
    if b < 0:                       # (noise: no growth with the devices)
        return sum(t for _, t in extra) / len(extra), 0.0
    if a < 0:                       # (a line through zero at most)
        return 0.0, sum(t for _, t in extra) / sum(k for k, _ in extra)
    return a, b


def fixed_costs(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(program dispatch, kernel launch) seconds from (kernels, seconds) runs
    of one program: the line t = dispatch + k * launch; noise that makes
    either negative makes it zero."""
    a, b = fit_line(points)
    return max(a, 0.0), max(b, 0.0)


# first and last timing of the same matmul further apart than this: the
# host's speed changed while it was measured (other work came or went)
STEADY_WITHIN = 0.25


def unsteady(first_s: float, again_s: float, within: float = STEADY_WITHIN) -> str | None:
    """A warning if one matmul timed at the start (``first_s``) and again at
    the end (``again_s``) of a calibration differs by more than ``within``."""
    slow, fast = max(first_s, again_s), min(first_s, again_s)
    if fast > 0 and slow / fast - 1 > within:
        return (f"the same float32 matmul took {first_s * 1e3:.3g} ms at the start and "
                f"{again_s * 1e3:.3g} ms at the end: the host's speed changed while it was "
                "measured (other work running?); the faster is kept; calibrate again on a "
                "quiet machine")
    return None


def busy(load: float, cpus: int) -> str | None:
    """A warning if the host's load average (``load`` runnable tasks over the
    last minute) is over half its ``cpus`` before calibrating: devices that
    share cores with other work measure slow."""
    if cpus > 0 and load > cpus / 2:
        return (f"the host was busy before calibrating (load average {load:.2f} on {cpus} "
                "CPUs): figures measured now may be low; calibrate again on a quiet machine")
    return None


# a device whose throughput with every device busy is below this fraction of
# its throughput alone shares its compute with the others
SHARED_BELOW = 2 / 3


def shares_compute(alone_s: float, together_s: float) -> bool:
    """Do devices share compute, given one matmul's time on one device alone
    and on every device at once?"""
    return alone_s / together_s < SHARED_BELOW


def all_reduce_link(points: Sequence[tuple[float, float]], n: int) -> LinkSpec:
    """The (latency, bandwidth) of a link from all-reduce times over ``n`` devices.

    ``points`` are (bytes per device, seconds per all-reduce).  The ring model
    t = 2(n-1) alpha + 2(n-1)/n * S/B is the line through the smallest and the
    largest message (a least-squares line over sizes that far apart would be
    all slope and no intercept); a negative intercept (noise) becomes zero
    latency.  A non-positive slope (the large message was
    no slower than the small one) takes the bandwidth from the largest point
    alone.
    """
    if n < 2:
        raise ValueError("an all-reduce needs at least two devices")
    a, b = fit_line([min(points), max(points)])
    steps = 2 * (n - 1)
    if b <= 0:
        s, t = max(points)
        b, a = t / s, 0.0
    return LinkSpec(bandwidth_bytes_per_s=steps / n / b, latency_s=max(a, 0.0) / steps)


# ---------------------------------------------------------------------------
# timing

def median_time(fn: Callable[[], Any], timer: Timer, repeats: int, warmup: int,
                pick: Callable[[Sequence[float]], float] = statistics.median) -> float:
    """Median seconds of ``repeats`` timed runs of ``fn`` after ``warmup`` runs
    (``pick=min``: the fastest)."""
    for _ in range(warmup):
        timer(fn)
    times = [timer(fn) for _ in range(max(1, repeats))]
    t = pick(times)
    if not (t > 0 and math.isfinite(t)):
        raise MeshplanError(f"calibrate: a timed run took {t!r} s; the timer is broken")
    return t


def grow(make: Callable[[int], Callable[[], Any]], sizes: Sequence[int], timer: Timer,
         opts: Options, growth: float = 2.0) -> tuple[int, float]:
    """Try ``sizes`` in order (one warm-up and one timed run each) until a run
    takes ``opts.target_s`` -- or the next size, ``growth`` times slower, would
    take over 4 x that; the median time at that size: ``(size, seconds)``."""
    def enough(t: float) -> bool:
        return t >= opts.target_s or t * growth > 4 * opts.target_s

    for k, size in enumerate(sizes):
        fn = make(size)
        timer(fn)                      # warm-up: compile
        last = k == len(sizes) - 1
        if enough(timer(fn)) or last:
            med = median_time(fn, timer, opts.repeats, 0)
            if enough(med) or last:    # not one noisy run
                return size, med
    raise ValueError("no sizes to try")


def _doubling(lo: int, hi: int, factor: int = 2) -> list[int]:
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= factor
    out.append(hi)
    return out


# ---------------------------------------------------------------------------
# the jax programs

def _physical_mesh(devices: Sequence[Any]):
    """(mesh, hosts, per_host): the devices as a ("host", "device") mesh."""
    import numpy as np
    from jax.sharding import Mesh
    by_proc: dict[int, list[Any]] = {}
    for d in devices:
        by_proc.setdefault(int(getattr(d, "process_index", 0)), []).append(d)
    counts = {len(v) for v in by_proc.values()}
    if len(counts) == 1:
        hosts, per_host = len(by_proc), counts.pop()
        ordered = [d for p in sorted(by_proc) for d in sorted(by_proc[p], key=lambda d: d.id)]
    else:
        hosts, per_host, ordered = 1, len(devices), list(devices)
    return Mesh(np.array(ordered, dtype=object).reshape(hosts, per_host), ("host", "device")), \
        hosts, per_host


def _per_device(mesh, body: Callable, shapes: Sequence[tuple[int, ...]], dtype: Any,
                fill: float) -> Callable[[], Any]:
    """``body`` run on every device at once on its own arrays of ``shapes``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    spec = P(("host", "device"))
    sharding = NamedSharding(mesh, spec)
    n = mesh.size
    make = jax.jit(lambda: tuple(jnp.full((n,) + tuple(s), fill, dtype) for s in shapes),
                   out_shardings=tuple(sharding for _ in shapes))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(spec for _ in shapes),
                              out_specs=spec, check_vma=False))
    args = make()
    return lambda: jax.block_until_ready(f(*args))


def _matmul_fn(mesh, dtype: str) -> Callable[[int], Callable[[], Any]]:
    import jax.numpy as jnp
    return lambda n: _per_device(mesh, lambda a, b: jnp.matmul(a, b), [(n, n), (n, n)],
                                 jnp.dtype(dtype), 0.5)


def _add_fn(mesh) -> Callable[[int], Callable[[], Any]]:
    import jax.numpy as jnp
    return lambda nbytes: _per_device(mesh, lambda x, y: x + y,
                                      [(nbytes // 4,), (nbytes // 4,)], jnp.float32, 1.0)


def _psum_fn(mesh, axis: str, loop: int) -> Callable[[int], Callable[[], Any]]:
    import jax
    import jax.numpy as jnp

    def body(x):
        return jax.lax.fori_loop(0, loop, lambda i, y: jax.lax.psum(y, axis), x)
    # zeros: a psum of zeros stays zero however often it is repeated
    return lambda nbytes: _per_device(mesh, body, [(max(1, nbytes // 4),)], jnp.float32, 0.0)


def _chain_fn(mesh) -> Callable[[int], Callable[[], Any]]:
    """k dependent 8 x 8 matmuls per device: k kernels of next to no work."""
    import jax.numpy as jnp

    def body(k):
        def chain(x, w):
            for _ in range(k):
                x = jnp.matmul(x, w)
            return x
        return chain
    return lambda k: _per_device(mesh, body(k), [(8, 8), (8, 8)], jnp.float32, 0.125)


def _bits_fn(mesh) -> Callable[[int], Callable[[], Any]]:
    """n random 32-bit words per device from JAX's default generator, keyed
    by the device's input (a constant key would be folded at compile time),
    summed in the same kernel (as a dropout mask is used where it is made:
    the generator's work, not the writing of its words)."""
    import jax
    import jax.numpy as jnp

    def body(x):
        key = jax.random.wrap_key_data(x[0, :2])
        return jnp.sum(jax.random.bits(key, x.shape, jnp.uint32), keepdims=True)
    return lambda n: _per_device(mesh, body, [(max(n, 2),)], jnp.uint32, 1)


def bits_ops(n: int) -> float:
    """The integer operations meshplan counts for drawing n 32-bit words
    with JAX's default generator (planner.flops.random_bits_flops)."""
    import jax
    from ..flops import random_bits_flops
    return random_bits_flops((), ((1, n),), {
        "bit_width": 32, "partitionable": bool(jax.config.jax_threefry_partitionable)})


def _supported(dtype: str, mesh) -> bool:
    try:
        _matmul_fn(mesh, dtype)(8)()
        return True
    except Exception:  # the back end cannot run this dtype
        return False


# ---------------------------------------------------------------------------
# the whole calibration

def calibrate(*, name: str | None = None, options: Options | None = None,
              timer: Timer = wall_timer, devices: Sequence[Any] | None = None,
              reporter: progress.Progress | None = None) -> Calibration:
    """Measure ``devices`` (default ``jax.devices()``) and describe them as a cluster."""
    import jax
    opts = options or Options()
    reporter = reporter or progress.Progress()
    devices = list(devices if devices is not None else jax.devices())
    if not devices:
        raise MeshplanError("calibrate: jax sees no devices")
    mesh, hosts, per_host = _physical_mesh(devices)
    dev0 = devices[0]
    platform = str(dev0.platform).lower()
    kind = str(getattr(dev0, "device_kind", "") or platform).strip()
    measurements: list[Measurement] = []
    how: list[str] = []
    warnings = [w for w in (busy(*_host_load()),) if w]

    # fixed costs first: the rates below are of kernels, without their dispatch
    achieved = _measure_fixed_costs(mesh, devices, opts, timer, reporter, measurements, how)
    dispatch = achieved.dispatch_s(len(devices))
    flops = _measure_matmuls(mesh, platform, opts, timer, reporter, measurements, how, dispatch)
    flops["int32"] = _measure_integer(mesh, opts, timer, reporter, measurements, how, dispatch)
    memory, mem_bw = _measure_memory(mesh, dev0, platform, per_host, opts, timer, reporter,
                                     measurements, how, dispatch)
    links = _measure_links(mesh, hosts, per_host, opts, timer, reporter, measurements, how)
    per_buffer = _measure_buffers(mesh, devices, opts, timer, reporter, measurements, how)
    busy_s, busy_per_device = _measure_busy_program(devices, achieved.shared_host_compute,
                                                    opts, timer, reporter, measurements, how)
    achieved = replace(achieved, pipeline_buffer_s=per_buffer,
                       pipeline_program_s=_measure_pipeline_host(
                           devices, opts, timer, reporter, measurements, how, per_buffer),
                       busy_program_s=busy_s, busy_program_per_device_s=busy_per_device)
    if platform == "cpu":
        # (XLA:CPU writes a fused value several operators read and reads it
        # back in each: its compiled steps' bytes, benchmarks/results/measured_grid.md
        # stop 70; a property of the compiler, not measured here)
        achieved = replace(achieved, fusion_writes_shared=True)
        how.append("achieved.fusion_writes_shared: true, as XLA's CPU back end fuses")
    warnings += _recheck(mesh, opts, timer, reporter, measurements, how, flops, dispatch)

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        import jaxlib
        jaxlib_version = f", jaxlib {jaxlib.__version__}"
    except (ImportError, AttributeError):
        jaxlib_version = ""
    description = (
        f"Measured by `meshplan calibrate{' --quick' if opts.quick_mode else ''}` on {now} "
        f"with jax {jax.__version__}{jaxlib_version}: {hosts} host(s) x {per_host} "
        f"{kind!r} ({platform}) device(s), all devices measured at once. "
        + ". ".join(how) + "."
        + "".join(f" Warning: {w}." for w in warnings))
    spec = ClusterSpec(
        name=name or f"calibrated-{platform}-{hosts}x{per_host}", num_hosts=hosts,
        devices_per_host=per_host,
        device=DeviceSpec(kind=kind, memory_bytes=int(memory),
                          memory_bandwidth_bytes_per_s=mem_bw, peak_flops=flops,
                          achieved=achieved),
        intra_host=links["intra_host"], inter_host=links["inter_host"],
        description=description,
        sources=(f"meshplan calibrate, {now}, jax {jax.__version__}",))
    return Calibration(cluster=spec, measurements=tuple(measurements), warnings=tuple(warnings))


def _host_load() -> tuple[float, int]:
    """(1-minute load average, usable CPUs); (0, 0) where the OS has none."""
    import os
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    try:
        return os.getloadavg()[0], cpus
    except (AttributeError, OSError):
        return 0.0, 0


def _recheck(mesh, opts: Options, timer: Timer, reporter, measurements: list, how: list,
             flops: dict[str, float], dispatch_s: float) -> list[str]:
    """Time the float32 matmul once more at the end: a warning where the
    host's speed changed meanwhile (the faster figure is kept in ``flops``)."""
    first = next((m for m in measurements if m.what == "matmul float32"), None)
    if first is None:
        return []
    with reporter.step("calibrate: matmul float32 again"):
        again = median_time(_matmul_fn(mesh, "float32")(first.size), timer, opts.repeats,
                            opts.warmup)
    how.append(f"the float32 matmul timed again at the end: {again * 1e3:.3g} ms "
               f"({first.seconds * 1e3:.3g} ms at the start)")
    flops["float32"] = max(flops["float32"],
                           matmul_flops(first.size, kernel_seconds(again, dispatch_s)))
    w = unsteady(first.seconds, again)
    return [w] if w else []


def _measure_matmuls(mesh, platform: str, opts: Options, timer: Timer, reporter,
                     measurements: list, how: list, dispatch_s: float) -> dict[str, float]:
    """Matmul FLOP/s per dtype."""
    flops: dict[str, float] = {}
    sizes = _doubling(opts.matmul_min_n, opts.matmul_max_n)
    skipped = []
    for dtype in opts.dtypes:
        if not _supported(dtype, mesh):
            skipped.append(dtype)
            continue
        with reporter.step(f"calibrate: matmul {dtype}"):
            n, t = grow(_matmul_fn(mesh, dtype), sizes, timer, opts, growth=8)
        flops[dtype] = matmul_flops(n, kernel_seconds(t, dispatch_s))
        measurements.append(Measurement(f"matmul {dtype}", flops[dtype], n, t))
    if not flops:
        raise MeshplanError(f"calibrate: none of the dtypes {', '.join(opts.dtypes)} runs a "
                            f"matmul on {platform}")
    how.append("peak_flops: jitted jnp.matmul of two n x n matrices on every device at once, "
               "2 n^3 / (median time less the program dispatch), " + ", ".join(
                   f"{m.what.split()[1]} n={m.size} {m.seconds * 1e3:.3g} ms" for m in measurements
                   if m.what.startswith("matmul "))
               + (f" ({', '.join(skipped)} not supported, not listed)" if skipped else ""))

    return flops


def _measure_integer(mesh, opts: Options, timer: Timer, reporter, measurements: list,
                     how: list, dispatch_s: float) -> float:
    """The int32 rate: the operations meshplan counts for a random draw over
    its time (the rate a dropout mask's bits are made at here)."""
    with reporter.step("calibrate: random bits"):
        n, t = grow(_bits_fn(mesh), _doubling(opts.bits_min, opts.bits_max, 4), timer, opts,
                    growth=4)
    rate = bits_ops(n) / kernel_seconds(t, dispatch_s)
    measurements.append(Measurement("random bits", rate, n, t))
    how.append(f"peak_flops.int32: jax.random.bits of n 32-bit words on every device at once "
               f"(JAX's default generator), the integer operations meshplan counts for them "
               f"(planner/flops.py) / (median time less the program dispatch), n={n} "
               f"{t * 1e3:.3g} ms")
    return rate


def _measure_fixed_costs(mesh, devices, opts: Options, timer: Timer, reporter,
                         measurements: list, how: list) -> Achieved:
    """Program dispatch and kernel launch costs, and whether the devices share
    compute.  The rates measured elsewhere are already what the devices
    achieve, so the efficiencies stay 1."""
    import numpy as np
    from jax.sharding import Mesh
    with reporter.step("calibrate: fixed costs"):
        points = _chain_points(_chain_fn(mesh), opts, timer)
    dispatch, launch = fixed_costs(points)
    measurements.append(Measurement("program dispatch", dispatch, 0, points[0][1]))
    measurements.append(Measurement("kernel launch", launch, int(points[-1][0]), points[-1][1]))
    how.append("achieved.program_dispatch_s and kernel_launch_s: a jitted chain of k dependent "
               "8 x 8 matmuls on every device (the fastest of "
               f"{4 * opts.repeats} runs), the line t = dispatch + k launch through "
               + ", ".join(f"k={int(k)} {t * 1e6:.3g} us" for k, t in points))
    shared, fixed, per_device = False, dispatch, 0.0
    if len(devices) > 1:
        alone_mesh = Mesh(np.array(devices[:1], dtype=object).reshape(1, 1), ("host", "device"))
        with reporter.step("calibrate: dispatch on one device"):
            alone_points = _chain_points(_chain_fn(alone_mesh), opts, timer)
        one = fixed_costs(alone_points)[0]
        fixed, per_device = split_dispatch(dispatch, one, len(devices))
        measurements.append(Measurement("program dispatch, one device", one, 0,
                                        alone_points[0][1]))
        how.append(f"achieved.dispatch_per_device_s: the same chain on one device dispatched in "
                   f"{one * 1e6:.3g} us against {dispatch * 1e6:.3g} on all {len(devices)}: "
                   f"{fixed * 1e6:.3g} us per program + {per_device * 1e6:.3g} per device")
        n = opts.matmul_min_n * 2
        with reporter.step("calibrate: shared compute"):
            alone = median_time(_matmul_fn(alone_mesh, "float32")(n), timer, opts.repeats,
                                opts.warmup)
            together = median_time(_matmul_fn(mesh, "float32")(n), timer, opts.repeats,
                                   opts.warmup)
        shared = shares_compute(alone, together)
        how.append(f"achieved.shared_host_compute: a float32 matmul n={n} took "
                   f"{alone * 1e3:.3g} ms on one device alone and {together * 1e3:.3g} ms on "
                   f"all {len(devices)} at once: "
                   + ("the devices share compute" if shared else "each device has its own"))
    return Achieved(kernel_launch_s=launch, program_dispatch_s=fixed,
                    dispatch_per_device_s=per_device, shared_host_compute=shared)


# the pipeline whose host time calibrate measures: a small MLP (two stages where it can)
PIPELINE_MODEL = {"layers": 4, "hidden": 32, "in_dim": 32, "out_dim": 10, "batch": 16,
                  "optimizer": "sgd"}
PIPELINE_MICRO_BATCHES = 4


def _measure_buffers(mesh, devices, opts: Options, timer: Timer, reporter, measurements: list,
                     how: list) -> float:
    """``achieved.pipeline_buffer_s``: the host's time of a jitted call per
    array buffer it takes and makes (a program of ``k`` arrays in and ``k``
    out, each on every device, timed to its return at two ``k``: the slope
    per buffer).  0 where the slope is not positive (not resolved)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    n, where = len(devices), NamedSharding(mesh, PartitionSpec())
    step = jax.jit(lambda *xs: [x + 1 for x in xs])

    def dispatch_s(k: int) -> float:
        xs = [jax.device_put(jnp.full((4,), float(i)), where) for i in range(k)]
        held = [step(*xs)]

        def call() -> None:
            held[0] = step(*xs)
        return _median_dispatch(call, held, opts.warmup, max(3, opts.repeats), timer)
    k1, k2 = opts.buffer_counts
    with reporter.step("calibrate: the host's time per buffer"):
        t1, t2 = dispatch_s(k1), dispatch_s(k2)
    per = max(0.0, (t2 - t1) / (2 * (k2 - k1) * n))
    measurements.append(Measurement("program buffer, host", per, 2 * k2 * n, t2))
    how.append(f"achieved.pipeline_buffer_s: a jitted call of k arrays in and k out, each on "
               f"all {n} device(s), returned in {t1 * 1e6:.3g} us at k={k1} and "
               f"{t2 * 1e6:.3g} us at k={k2} (medians): {per * 1e6:.3g} us per buffer")
    return per


def _measure_pipeline_host(devices, opts: Options, timer: Timer, reporter, measurements: list,
                           how: list, per_buffer_s: float = 0.0) -> float:
    """``achieved.pipeline_program_s``: the host's time per stage program of a
    real pipeline (a small MLP over every device, 4 micro-batches, in
    ``Manual(pp=2)`` on an even device count, else one stage, which the
    pipeline driver runs alike): one call's dispatch, which returns before
    the devices finish, over the stage programs it runs.  Only on the devices
    JAX sees (the plan runs on those); else 0, not known."""
    import jax
    n = len(devices)
    if list(devices) != list(jax.devices()):
        how.append("achieved.pipeline_program_s: not measured (it takes all the devices "
                   "JAX sees)")
        return 0.0
    stages = 2 if n % 2 == 0 else 1
    import meshplan
    from ..cost_model.pipeline import stage_programs
    from ..models import build_model
    with reporter.step("calibrate: a pipeline's host time"):
        m = build_model("mlp", PIPELINE_MODEL)
        state, batch = m.init(0)
        mb = PIPELINE_MICRO_BATCHES
        try:
            plan = meshplan.plan(m.train_step, state, batch, cluster=ClusterSpec.local(),
                                 method=meshplan.Manual(dp=1, tp=n // stages, pp=stages,
                                                        num_micro_batches=mb, schedule="1f1b"))
        except MeshplanError as e:
            how.append(f"achieved.pipeline_program_s: not measured ({e})")
            return 0.0
        step = meshplan.parallelize(m.train_step, plan=plan)
        held = [state]

        def dispatch() -> None:
            held[0], _ = step(held[0], batch)
        call = _median_dispatch(dispatch, held, opts.warmup + 2, max(3, opts.repeats), timer)
    programs = stage_programs(stages, mb)
    buffers = _buffers_run(step, plan, state, batch) if per_buffer_s else 0
    per = max(0.0, call - buffers * per_buffer_s) / programs
    measurements.append(Measurement("pipeline program, host", per, programs, call))
    net = (f", less its {buffers} array buffers at {per_buffer_s * 1e6:.3g} us"
           if buffers else "")
    how.append(f"achieved.pipeline_program_s: a 4-layer MLP as a {stages}-stage pipeline "
               f"over the {n} device(s), {mb} micro-batches: a call dispatched its {programs} stage "
               f"programs in {call * 1e3:.3g} ms (median of {max(3, opts.repeats)}){net}: "
               f"{per * 1e6:.3g} us each")
    return per


BUSY_CALLS = 20         # trivial programs per timed run (each waited for)


def _measure_busy_program(devices, shared: bool, opts: Options, timer: Timer, reporter,
                          measurements: list, how: list) -> tuple[float, float]:
    """``achieved.busy_program_s`` and ``busy_program_per_device_s``: a
    trivial program on a quarter and on half of the devices, each call
    waited for, on an idle host and while a thread keeps the other half busy
    with matmuls (:func:`busy_program`).  Only where the devices share the
    host's compute and there are 4 or more."""
    n = len(devices)
    if not shared or n < 4:
        how.append("achieved.busy_program_s: not measured (" + (
            "the devices do not share compute" if not shared else "fewer than 4 devices") + ")")
        return 0.0, 0.0
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    counts = sorted({max(2, n // 4), n // 2})

    def trivial(k: int) -> Callable[[], None]:
        where = NamedSharding(Mesh(np.array(devices[:k]), ("x",)), PartitionSpec("x"))
        x = jax.device_put(jnp.ones((k * 256,), jnp.float32), where)
        f = jax.jit(lambda a: a * 1.0001 + 1.0, out_shardings=where)
        f(x).block_until_ready()

        def calls() -> None:
            for _ in range(BUSY_CALLS):
                f(x).block_until_ready()
        return calls

    def timed(k: int, fn: Callable[[], None]) -> tuple[int, float]:
        return k, median_time(fn, timer, opts.repeats, opts.warmup) / BUSY_CALLS

    others = devices[n // 2:]
    where = NamedSharding(Mesh(np.array(others), ("x",)), PartitionSpec("x"))
    work = [jax.device_put(jnp.ones((len(others) * 256, 256), jnp.float32), where)]
    matmul = jax.jit(lambda a: jnp.tanh(a @ a[:256].T * 1e-3), out_shardings=where)
    stop, running = threading.Event(), threading.Event()

    def keep_busy() -> None:
        while not stop.is_set():
            work[0] = matmul(work[0])
            work[0].block_until_ready()
            running.set()

    with reporter.step("calibrate: programs beside busy devices"):
        fns = {k: trivial(k) for k in counts}
        matmul(work[0]).block_until_ready()         # (compiled before it keeps them busy)
        quiet = [timed(k, fns[k]) for k in counts]
        worker = threading.Thread(target=keep_busy, daemon=True)
        worker.start()
        try:
            started = running.wait(timeout=60)
            loaded = [timed(k, fns[k]) for k in counts] if started else []
        finally:
            stop.set()
            worker.join()
    if not loaded:
        how.append("achieved.busy_program_s: not measured (the matmuls meant to keep the "
                   "other devices busy did not run)")
        return 0.0, 0.0
    per_program, per_device = busy_program(quiet, loaded)
    for (k, q), (_, t) in zip(quiet, loaded):
        measurements.append(Measurement(f"program on {k} devices, beside busy ones, added",
                                        max(0.0, t - q), k, t))
    how.append("achieved.busy_program_s and busy_program_per_device_s: a jitted a * 1.0001 + 1 "
               "on k devices, each call waited for, " + ", ".join(
                   f"k={k} {q * 1e6:.3g} us idle and {t * 1e6:.3g} us while the other "
                   f"{n - n // 2} devices ran matmuls" for (k, q), (_, t) in zip(quiet, loaded))
               + f": {per_program * 1e6:.3g} us per program + {per_device * 1e6:.3g} us per "
               "device")
    return per_program, per_device


def _median_dispatch(call: Callable[[], None], held: list, skip: int, repeats: int,
                     timer: Timer) -> float:
    """The median host time of ``call()`` (which puts its results in
    ``held[0]``), each call made on idle devices, after ``skip`` untimed."""
    import jax
    times = []
    for k in range(skip + repeats):
        jax.block_until_ready(held[0])
        t = timer(call)
        if k >= skip:
            times.append(t)
    jax.block_until_ready(held[0])
    return statistics.median(times)


def _buffers_run(step, plan, state, batch) -> int:
    """The array buffers one call of pipelined ``step`` hands its programs
    and gets back: each program's arguments and results, once per device of
    its stage, times the runs of a call."""
    import jax
    compiled = step.lower(state, batch).compile()
    return sum(compiled.runs(key) * len(plan.stages[key[1]].devices)
               * (len(jax.tree.leaves(c.input_shardings)) + len(jax.tree.leaves(c.output_shardings)))
               for key, c in compiled.compiled.items())


def _chain_points(make, opts: Options, timer: Timer) -> list[tuple[float, float]]:
    """(kernels, seconds) of :func:`_chain_fn` chains: the fastest of many
    runs (these take well under a millisecond, and the host's other threads
    only ever add to them: a median of five once put k=16 above k=64)."""
    return [(float(k), median_time(make(k), timer, 4 * opts.repeats, opts.warmup, min))
            for k in opts.launch_chain]


def _measure_memory(mesh, dev0, platform: str, per_host: int, opts: Options, timer: Timer,
                    reporter, measurements: list, how: list,
                    dispatch_s: float) -> tuple[int, float]:
    """Device memory (bytes) and memory bandwidth (bytes/s)."""
    mem_limit = allocator_limit(dev0)
    if mem_limit is not None:
        memory, mem_how = mem_limit, "the XLA allocator limit (device.memory_stats()['bytes_limit'])"
    else:
        memory = max(1, physical_memory() // per_host)
        mem_how = (f"device.memory_stats() has no limit on {platform}: the host's physical "
                   f"memory split among its {per_host} device(s)")
    hi = max(opts.memory_min_bytes, min(opts.memory_max_bytes, memory // 16))
    with reporter.step("calibrate: memory bandwidth"):
        nbytes, t = grow(_add_fn(mesh), _doubling(opts.memory_min_bytes, hi, 4), timer, opts,
                         growth=4)
    mem_bw = add_bandwidth(nbytes, kernel_seconds(t, dispatch_s))
    measurements.append(Measurement("memory", mem_bw, nbytes, t))
    how.append(f"memory_bandwidth_bytes_per_s: jitted x + y of float32 arrays of "
               f"{nbytes / 2**20:.3g} MiB per device, 3 x array bytes / (median time less the "
               f"program dispatch) "
               f"({t * 1e3:.3g} ms)")
    how.append(f"memory_bytes: {mem_how}")

    return memory, mem_bw


def _measure_links(mesh, hosts: int, per_host: int, opts: Options, timer: Timer, reporter,
                   measurements: list, how: list) -> dict[str, LinkSpec]:
    """All-reduce bandwidth and latency per mesh axis (within a host, between hosts)."""
    links: dict[str, LinkSpec] = {}
    small = opts.collective_small_bytes
    for axis, size, key in (("device", per_host, "intra_host"), ("host", hosts, "inter_host")):
        if size < 2:
            continue
        make = _psum_fn(mesh, axis, opts.collective_loop)
        with reporter.step(f"calibrate: psum over {axis!r} ({size} devices)"):
            # the large message: grown until a run is long enough (bandwidth bound)
            large, t_large = grow(make, _doubling(min(small * 16, opts.collective_max_bytes),
                                                  opts.collective_max_bytes, 4), timer, opts,
                              growth=4)
            points = [(float(large), t_large / opts.collective_loop)]
            for s in sorted({small, int(math.sqrt(small * large))} - {large}):
                t = median_time(make(s), timer, opts.repeats, opts.warmup) / opts.collective_loop
                points.append((float(s), t))
            points.sort()
        link = all_reduce_link(points, size)
        if key == "inter_host":   # the JSON wants the whole host's network bandwidth
            link = replace(link, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s * per_host)
        links[key] = link
        measurements.append(Measurement(f"psum over {axis!r}", link.bandwidth_bytes_per_s,
                                        large, points[-1][1], link.latency_s))
        how.append(f"links.{key}: psum over mesh axis {axis!r} ({size} devices) in "
                   f"jax.shard_map, {opts.collective_loop} in a fori_loop per run, at "
                   + ", ".join(f"{int(s)} B {t * 1e6:.3g} us" for s, t in points)
                   + "; the ring model t = 2(n-1) alpha + 2(n-1)/n S/B through the smallest and "
                     "largest message"
                   + (f", times {per_host} devices per host" if key == "inter_host" else ""))
    for key in ("intra_host", "inter_host"):
        if key not in links:
            links[key] = getattr(ClusterSpec.local(), key)
            why = ("only one device per host" if key == "intra_host" else "one host")
            how.append(f"links.{key}: not measured ({why}); meshplan's platform default")

    return links
