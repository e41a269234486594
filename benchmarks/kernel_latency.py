"""A kernel's shortest time, from the committed raw gpu_check kernel timings.

    python benchmarks/kernel_latency.py [benchmarks/results/gpu_check/h200-run1.json ...]

A real kernel does not get faster than a floor however little work it has:
launch, the first wave's ramp-up, a GEMM's prologue and epilogue.  This script
reads the per-kernel timings ``benchmarks/gpu_check.py`` measured (chains of
dependent kernels, program dispatch cancelled) and derives two floors:

* the matmul floor: square products of one dtype whose time stays flat while
  their FLOPs grow 8x (each sweep's sizes, smallest first, while the median
  time stays within 2x of the sweep's fastest);
* the streaming floor: the same rule on the ``x * a + y`` sweep.

Each figure is the median of those timings, printed with their range.  Rows
under 0.5 us are timing noise (a chain of 16 measured no slower than one)
and are left out.  Nothing here looks at train steps: they are the check.

It then prices every measured kernel both ways the floor can combine with
the roofline -- ``max(floor, launch + roofline)`` and ``floor + roofline`` --
and prints each rule's error, so the choice in ``cost_model/compute.py``
can be checked against the data.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
from typing import Sequence

HERE = pathlib.Path(__file__).resolve().parent
RAW = HERE / "results" / "gpu_check"
DEFAULT_FILES = (RAW / "h200-run1.json", RAW / "h200-run2-kernels.json")
NOISE_US = 0.5       # a per-kernel time below this is timing noise
FLAT = 2.0           # "flat": within this factor of the sweep's fastest median


def load(paths: Sequence[pathlib.Path]) -> tuple[str, dict[tuple[str, str, str], list[float]]]:
    """(device kind, (kind, dtype, shape) -> measured us, one per run)."""
    rows: dict[tuple[str, str, str], list[float]] = {}
    kinds = set()
    for p in paths:
        run = json.loads(pathlib.Path(p).read_text())
        kinds.add(run["device"])
        for r in run.get("kernels", []):
            rows.setdefault((r["kind"], r["dtype"], r["shape"]), []).append(r["measured_us"])
    if len(kinds) != 1:
        raise SystemExit(f"kernel_latency: the files measured {sorted(kinds)}; give one device's")
    return kinds.pop(), rows


def _size(kind: str, shape: str) -> float:
    if kind == "stream":
        return float(shape.split()[0])
    m, k, n = map(int, shape.split("x"))
    return float(m) * k * n


def flat_region(rows: dict, kind: str, dtype: str) -> list[tuple[str, list[float]]]:
    """The sweep's smallest sizes whose time does not grow with their work.
    Matmul sweeps are the square products (m = k = n)."""
    sweep = []
    for (k, d, shape), ts in rows.items():
        if k != kind or d != dtype:
            continue
        if kind == "matmul" and len(set(shape.split("x"))) != 1:
            continue
        ts = [t for t in ts if t >= NOISE_US]
        if ts:
            sweep.append((_size(kind, shape), shape, ts))
    sweep.sort()
    if not sweep:
        return []
    fastest = min(statistics.median(ts) for _, _, ts in sweep)
    out = []
    for _, shape, ts in sweep:
        if statistics.median(ts) > FLAT * fastest:
            break
        out.append((shape, ts))
    return out


def roofline_s(device, kind: str, dtype: str, shape: str) -> float:
    """The model's roofline for a measured kernel (no launch, no floor)."""
    from meshplan.cost_model.compute import compute_time
    if kind == "stream":
        return compute_time(device, 0.0, 3 * (int(shape.split()[0]) << 20))
    m, k, n = map(int, shape.split("x"))
    base = dtype.split()[0]
    priced = "tfloat32" if dtype == "float32" else base     # jax's default precision
    nbytes = (2 if base == "bfloat16" else 4) * (m * k + k * n + m * n)
    return compute_time(device, 2.0 * m * k * n, nbytes, priced, out_elements=m * n)


SWEEPS = (("matmul", ("bfloat16", "float32")), ("stream", ("float32",)))


def floors(rows: dict) -> dict[str, tuple[float, list[float], list]]:
    """kind -> (floor in seconds: the median, its timings in us, the flat
    regions per dtype as (dtype, [(shape, timings)]))."""
    out = {}
    for kind, dtypes in SWEEPS:
        regions = [(d, flat_region(rows, kind, d)) for d in dtypes]
        times = [t for _, region in regions for _, ts in region for t in ts]
        out[kind] = (statistics.median(times) * 1e-6, times, regions)
    return out


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", default=[str(p) for p in DEFAULT_FILES],
                    help="gpu_check.json files of one device (default: the committed H200 runs)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from gpu_check import device_like
    kind, rows = load([pathlib.Path(f) for f in args.files])
    device = device_like(kind).device
    launch = device.achieved.kernel_launch_s
    print(f"# Kernel floors on {kind} from {', '.join(pathlib.Path(f).name for f in args.files)}")
    print()
    derived = floors(rows)
    for kind_, (floor, times, regions) in derived.items():
        for d, region in regions:
            print(f"{kind_} {d}: flat region " + ", ".join(
                f"{s} ({'/'.join(f'{t:.1f}' for t in ts)} us)" for s, ts in region))
        print(f"  -> {kind_} floor: median {floor * 1e6:.2f} us of {len(times)} "
              f"timings, range {min(times):.1f}-{max(times):.1f} us")
    print()
    print(f"Combining with the roofline (kernel launch {launch * 1e6:.2g} us): "
          "predicted / measured, every timing over the noise")
    rules = {"max(floor, launch + roofline)": lambda f, r: max(f, launch + r),
             "floor + roofline": lambda f, r: max(f, launch) + r,
             "launch + roofline (no floor)": lambda f, r: launch + r}
    print()
    print("| rule | kernels | geometric mean | median abs log error | roofline < 50 us: "
          "geometric mean | range | median abs log error |")
    print("|---|---|---|---|---|---|---|")
    for name, rule in rules.items():
        ratios, small = [], []
        for (k, d, shape), ts in rows.items():
            r = roofline_s(device, k, d, shape)
            p = rule(derived[k][0], r)
            for t in ts:
                if t < NOISE_US:
                    continue
                ratios.append(p / (t * 1e-6))
                if r < 50e-6:
                    small.append(p / (t * 1e-6))
        err = statistics.median(abs(math.log(x)) for x in ratios)
        err_s = statistics.median(abs(math.log(x)) for x in small)
        print(f"| {name} | {len(ratios)} | {_geomean(ratios):.2f} | {err:.3f} | "
              f"{_geomean(small):.2f} | {min(small):.2f}-{max(small):.2f} | {err_s:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
