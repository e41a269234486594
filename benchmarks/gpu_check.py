"""Kernel and train-step times on one real accelerator against the cost model.

The CPU measured grid (``measured_grid.py``) checks the model's structure on
fake devices; this script checks its *device* terms on the hardware itself:

1. matmuls of transformer shapes (bfloat16, and float32 at jax's default
   precision), a streaming elementwise op at growing sizes, and a chain of
   tiny kernels: measured per-kernel time against ``cost_model.compute``'s
   prediction (``compute_time`` with ``kernel_fixed_time``: the roofline plus
   the launch, or the kernel's floor when longer) with the device's datasheet
   peaks and the ``achieved`` figures of the shipped cluster file for the
   device family (``--reference``);
2. ``meshplan calibrate`` on the device (its JSON is written to ``--out``);
3. built-in gpt train steps planned for the one device and run: measured
   step time against ``plan.predicted.iteration_s`` under three clusters
   (``Cluster.local()`` as-is, with the reference file's ``achieved``
   figures, and the calibrated one), and the loss against ``jax.jit`` of the
   undecorated step.

    python benchmarks/gpu_check.py --out DIR [--quick] [--reference FILE]
    python benchmarks/gpu_check.py --predict DIR/gpu_check.json ...   (CPU)

A kernel's time: an unrolled chain of R dependent kernels in one jitted
program, timed at R = 1 and R = R_MAX; (t(R_MAX) - t(1)) / (R_MAX - 1) is one
kernel's time with program dispatch taken out (chained matmuls alternate
(m, k) x (k, n) and (m, n) x (n, k), so every product does the same work).
Times are medians of repeated runs after a warm-up; compilation is never
timed.  Prints markdown tables and writes ``gpu_check.md`` and ``.json``
under ``--out``.  Written for a lent GPU (CI has none); on CPU ``--quick``
runs every path at toy sizes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "examples" / "clusters" / "dgx-h100-x1.json"
R_MAX = 16

# (m, k, n): tokens x hidden -> outputs of a GPT block's matmuls (qkv 3h, the
# MLP's 4h and back) at hidden 1024..8192 and 2k..16k tokens, plus squares
GEMMS = [(2048, 1024, 3072), (2048, 1024, 4096), (8192, 1024, 4096), (8192, 2048, 8192),
         (4096, 4096, 16384), (16384, 4096, 16384), (8192, 8192, 32768),
         (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
         (256, 256, 256), (512, 512, 512)]
QUICK_GEMMS = [(64, 64, 128), (128, 128, 128)]
STREAM_MIB = [1, 4, 16, 64, 256, 1024]
QUICK_STREAM_MIB = [1, 4]

# gpt train steps that fit one 80 GB device with Adam: a small one where fixed
# costs matter, Alpa's gpt-350m at batch 8, and a 2048-wide 8-layer one
STEP_MODELS = {
    "gpt-small-b8": {"hidden": 512, "layers": 4, "heads": 8, "seq_len": 512, "batch": 8,
                     "vocab": 8192, "dtype": "float32", "compute_dtype": "bfloat16"},
    "gpt-350m-b8": {"hidden": 1024, "layers": 24, "heads": 16, "seq_len": 1024, "batch": 8,
                    "vocab": 51200, "dtype": "float32", "compute_dtype": "bfloat16"},
    "gpt-350m-b8-f32": {"hidden": 1024, "layers": 24, "heads": 16, "seq_len": 1024,
                        "batch": 8, "vocab": 51200, "dtype": "float32",
                        "compute_dtype": "float32"},
    "gpt-h2048-l8-b8": {"hidden": 2048, "layers": 8, "heads": 16, "seq_len": 1024, "batch": 8,
                        "vocab": 51200, "dtype": "float32", "compute_dtype": "bfloat16"},
    # held out from the H100 profile the model's Hopper figures came from
    "gpt-h1536-l12-s2048-b4": {"hidden": 1536, "layers": 12, "heads": 12, "seq_len": 2048,
                               "batch": 4, "vocab": 51200, "dtype": "float32",
                               "compute_dtype": "bfloat16"},
}
QUICK_STEP_MODELS = {"gpt-tiny": {"hidden": 64, "layers": 2, "heads": 2, "seq_len": 16,
                                  "batch": 8, "vocab": 128}}


# ---------------------------------------------------------------------------
# timing

def median_s(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn()`` (which blocks) after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def waited_steps(f: Callable, s: Any, batch: Any, steps: int) -> tuple[list[float], Any]:
    """(seconds of each of ``steps`` calls ``s, _ = f(s, batch)``, each waited
    for before the next is made; the last ``s``)."""
    import jax
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        s, _ = f(s, batch)
        jax.block_until_ready(s)
        times.append(time.perf_counter() - t)
    return times, s


def per_kernel_s(make: Callable[[int], Callable[[], Any]], repeats: int) -> float:
    """One kernel's time from chains of 1 and R_MAX kernels (dispatch cancels)."""
    t1 = median_s(make(1), repeats)
    tr = median_s(make(R_MAX), repeats)
    return max(tr - t1, 1e-9) / (R_MAX - 1)


def matmul_chain(m: int, k: int, n: int, dtype: str, precision: str | None):
    import jax
    import jax.numpy as jnp
    key = jax.random.key(0)
    a = (jax.random.normal(key, (m, k), jnp.float32) / math.sqrt(k)).astype(dtype)
    w1 = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / math.sqrt(k)).astype(dtype)
    w2 = (jax.random.normal(jax.random.key(2), (n, k), jnp.float32) / math.sqrt(n)).astype(dtype)

    def make(r: int) -> Callable[[], Any]:
        def chain(x, w1, w2):
            for i in range(r):
                x = jnp.matmul(x, w1 if i % 2 == 0 else w2, precision=precision)
            return x
        f = jax.jit(chain)
        # odd r leaves an (m, n) result, even r an (m, k) one; either is fine
        return lambda: f(a, w1, w2).block_until_ready()
    return make


def stream_chain(nbytes: int):
    """x * 1.0001 + y chained R times: XLA fuses elementwise chains into one
    kernel, so an optimization barrier keeps each step its own kernel."""
    import jax
    import jax.numpy as jnp
    n = nbytes // 4
    x = jnp.ones((n,), jnp.float32)
    y = jnp.full((n,), 0.5, jnp.float32)

    def make(r: int) -> Callable[[], Any]:
        def chain(x, y):
            for _ in range(r):
                x = jax.lax.optimization_barrier(x * 1.0001 + y)
            return x
        f = jax.jit(chain)
        return lambda: f(x, y).block_until_ready()
    return make


# ---------------------------------------------------------------------------
# the reference device: datasheet peaks with the shipped file's achieved figures

def reference_cluster(local: Any, reference: Any) -> Any:
    dev = dataclasses.replace(local.device, achieved=reference.device.achieved)
    return dataclasses.replace(local, device=dev)


def kernel_rows(device: Any, quick: bool, repeats: int, log) -> list[dict]:
    from meshplan.cost_model.compute import compute_time, kernel_fixed_time
    rows = []
    modes = [("bfloat16", None, "bfloat16"), ("float32", None, "float32"),
             ("float32", "highest", "float32")]
    gemms = QUICK_GEMMS if quick else GEMMS
    for dtype, precision, model_dtype in modes:
        shapes = gemms if precision is None else gemms[:3]
        for m, k, n in shapes:
            t = per_kernel_s(matmul_chain(m, k, n, dtype, precision), repeats)
            flops = 2.0 * m * k * n
            size = 2 if dtype == "bfloat16" else 4
            nbytes = size * (m * k + k * n + m * n)
            pred = compute_time(device, flops, nbytes, model_dtype, out_elements=m * n)
            pred += kernel_fixed_time(device, pred, True)
            tf32 = None
            if dtype == "float32" and precision is None and device.flops_for("tfloat32"):
                tf32 = compute_time(device, flops, nbytes, "tfloat32", out_elements=m * n)
                tf32 += kernel_fixed_time(device, tf32, True)
            rows.append({"kind": "matmul", "dtype": dtype + (f" ({precision})" if precision
                                                              else ""),
                         "shape": f"{m}x{k}x{n}", "measured_us": t * 1e6,
                         "tflops": flops / t / 1e12, "predicted_us": pred * 1e6,
                         "ratio": pred / t, "tf32_ratio": None if tf32 is None else tf32 / t})
            log(f"matmul {rows[-1]['dtype']} {m}x{k}x{n}: {t * 1e6:.1f} us "
                f"{flops / t / 1e12:.1f} TFLOP/s, predicted {pred * 1e6:.1f} us")
    for mib in (QUICK_STREAM_MIB if quick else STREAM_MIB):
        nbytes = mib << 20
        t = per_kernel_s(stream_chain(nbytes), repeats)
        moved = 3 * nbytes
        pred = compute_time(device, 0.0, moved)
        pred += kernel_fixed_time(device, pred, False)
        rows.append({"kind": "stream", "dtype": "float32", "shape": f"{mib} MiB x 3",
                     "measured_us": t * 1e6, "gbps": moved / t / 1e9,
                     "predicted_us": pred * 1e6, "ratio": pred / t})
        log(f"stream {mib} MiB: {t * 1e6:.1f} us {moved / t / 1e9:.0f} GB/s")
    return rows


# ---------------------------------------------------------------------------
# train steps

def step_rows(clusters: dict[str, Any], quick: bool, steps: int, log, rows: list[dict],
              save: Callable[[], None], names: Sequence[str] = (),
              counts: Sequence[int] = (1, 4)) -> list[dict]:
    import jax
    import numpy as np
    import meshplan
    from meshplan.models import build_model
    models = QUICK_STEP_MODELS if quick else STEP_MODELS
    if names:
        models = {n: models[n] for n in names}
    methods = [(f"mb={m}", meshplan.Manual(dp=1, tp=1, pp=1, num_micro_batches=m))
               for m in counts] + [("Auto()", meshplan.Auto())]
    run_on = "reference"
    for name, config in models.items():
        model = build_model("gpt", config)
        state, batch = model.init(0)
        ref_state, ref_metrics = jax.jit(model.train_step)(state, batch)
        ref_loss = float(ref_metrics["loss"])
        del ref_state
        for label, method in methods:
            row = {"model": name, "method": label}
            try:
                for cname, cluster in clusters.items():
                    step = meshplan.parallelize(model.train_step, method=method,
                                                cluster=cluster,
                                                batch_argnums=model.batch_argnums)
                    plan = step.plan_for(state, batch)
                    row[f"predicted_ms[{cname}]"] = plan.predicted.iteration_s * 1e3
                    if cname == run_on:
                        runner = step
                        row["predicted_mem_gib"] = plan.predicted.peak_memory_bytes / 2**30
                        row["plan"] = (f"mb={plan.num_micro_batches} "
                                       f"recompute={[s.recompute for s in plan.stages]}")
                s, metrics = runner(state, batch)
                jax.block_until_ready(s)
                row["loss_rel_err"] = abs(float(metrics["loss"]) - ref_loss) / abs(ref_loss)
                times, s = waited_steps(runner, s, batch, steps)
                row["measured_ms"] = statistics.median(times) * 1e3
                if label == "mb=1":    # XLA's own account of the program's memory
                    m = runner.lower(s, batch).compile().memory_analysis()
                    if m is not None:
                        row["compiled_mem_gib"] = (m.argument_size_in_bytes
                                                   + m.output_size_in_bytes
                                                   - m.alias_size_in_bytes
                                                   + m.temp_size_in_bytes) / 2**30
                del s
            except Exception as err:  # noqa: BLE001 -- a row that failed says why
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            log(f"step {name} {label}: {row}")
            rows.append(row)
            save()
        # the plain jitted step's time: what meshplan's one-device plan should match
        f = jax.jit(model.train_step)
        s, _ = f(state, batch)
        jax.block_until_ready(s)
        times, s = waited_steps(f, s, batch, steps)
        rows.append({"model": name, "method": "jax.jit", "measured_ms":
                     statistics.median(times) * 1e3})
        log(f"step {name} jax.jit: {rows[-1]['measured_ms']:.2f} ms")
        del state, batch, s
        np.asarray(0)
    return rows


# ---------------------------------------------------------------------------
# predictions of today's model for measured runs (no accelerator needed)

def device_like(kind: str) -> Any:
    """One device of ``kind`` as ``ClusterSpec.local()`` would describe it there."""
    from meshplan import datasheets
    from meshplan.cluster import Achieved, ClusterSpec, DeviceSpec, LinkSpec
    ds = datasheets.known_device("gpu", kind)
    if ds is None:
        raise SystemExit(f"--predict: no datasheet figures for {kind!r}")
    dev = DeviceSpec(kind=kind, memory_bytes=ds.memory_bytes,
                     memory_bandwidth_bytes_per_s=ds.memory_bandwidth, peak_flops=ds.flops,
                     achieved=Achieved(**dict(ds.achieved)))
    return ClusterSpec(f"one-{kind}", 1, 1, dev, LinkSpec(*ds.intra_host),
                       LinkSpec(*ds.inter_host))


def predict_kernel(device: Any, row: dict) -> float:
    """Seconds the model gives one kernel of a measured row."""
    from meshplan.cost_model.compute import compute_time, kernel_fixed_time
    if row["kind"] == "stream":
        moved = 3 * (int(row["shape"].split()[0]) << 20)
        t = compute_time(device, 0.0, moved)
        return t + kernel_fixed_time(device, t, False)
    m, k, n = map(int, row["shape"].split("x"))
    dtype = row["dtype"].split()[0]
    priced = "tfloat32" if row["dtype"] == "float32" else dtype   # default precision
    nbytes = (2 if dtype == "bfloat16" else 4) * (m * k + k * n + m * n)
    t = compute_time(device, 2.0 * m * k * n, nbytes, priced, out_elements=m * n)
    return t + kernel_fixed_time(device, t, True)


def without_floors(cluster: Any) -> Any:
    """``cluster`` with the kernel floors taken out: launch + roofline, the
    model before the floors (to show what they change)."""
    a = dataclasses.replace(cluster.device.achieved, matmul_kernel_min_s=0.0,
                            memory_kernel_min_s=0.0)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, achieved=a))


def repredict(paths: Sequence[str]) -> list[str]:
    """Today's predictions for the kernels and Manual step rows of measured runs."""
    import meshplan
    from meshplan.models import build_model
    lines = []
    for path in paths:
        run = json.loads(pathlib.Path(path).read_text())
        if not isinstance(run.get("device"), str):      # (the calibrated cluster file)
            lines += [f"({path}: not a gpu_check run, skipped)", ""]
            continue
        cluster = device_like(run["device"])
        bare = without_floors(cluster)
        lines += [f"## {path}: {run['device']}, jax {run['jax']}", ""]
        kernels = [dict(r, predicted_us=predict_kernel(cluster.device, r) * 1e6,
                        no_floor_us=predict_kernel(bare.device, r) * 1e6)
                   for r in run.get("kernels", [])]
        for r in kernels:
            r["ratio"] = r["predicted_us"] / r["measured_us"]
            r["no_floor_ratio"] = r["no_floor_us"] / r["measured_us"]
        if kernels:
            lines += table(kernels, ["kind", "dtype", "shape", "measured_us", "tflops", "gbps",
                                     "no_floor_us", "no_floor_ratio", "predicted_us",
                                     "ratio"]) + [""]
        steps = []
        for r in run.get("steps", []):
            if not (r.get("measured_ms") and r["method"].startswith("mb=")):
                continue
            model = build_model("gpt", STEP_MODELS[r["model"]])
            state, batch = model.abstract_args
            method = meshplan.Manual(dp=1, tp=1, pp=1, num_micro_batches=int(r["method"][3:]))
            plans = [meshplan.plan(model.train_step, state, batch, cluster=c,
                                   batch_argnums=model.batch_argnums, method=method)
                     for c in (bare, cluster)]
            before, pred = (p.predicted.iteration_s * 1e3 for p in plans)
            steps.append({**r, "no_floor_ms": before, "no_floor_ratio": before / r["measured_ms"],
                          "predicted_ms": pred, "ratio": pred / r["measured_ms"],
                          "predicted_mem_gib": plans[1].predicted.peak_memory_bytes / 2**30})
        if steps:
            lines += table(steps, ["model", "method", "measured_ms", "no_floor_ms",
                                   "no_floor_ratio", "predicted_ms", "ratio",
                                   "predicted_mem_gib", "compiled_mem_gib"]) + [""]
    return lines


# ---------------------------------------------------------------------------
# report

def table(rows: Sequence[dict], cols: Sequence[str]) -> list[str]:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "" if v is None else str(v)
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for gpu_check.md/.json and the calibrated cluster")
    ap.add_argument("--predict", nargs="+", metavar="JSON",
                    help="no measuring: today's model's predictions for the rows of these "
                         "gpu_check.json files (runs on CPU)")
    ap.add_argument("--reference", default=str(REFERENCE),
                    help="cluster file whose device.achieved figures are checked")
    ap.add_argument("--quick", action="store_true", help="toy sizes (a CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default="", help="comma-separated step models (default: all)")
    ap.add_argument("--micro-batches", default="1,4",
                    help="comma-separated micro-batch counts of the Manual rows")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: "
                    "kernels, calibrate, steps")
    args = ap.parse_args(argv)
    if args.predict:
        print("\n".join(repredict(args.predict)))
        return 0
    if not args.out:
        ap.error("--out FOLDER is required to measure (or --predict JSON to re-predict)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    import jax
    import meshplan
    from meshplan.tools.calibrate import Options, calibrate

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    dev = jax.devices()[0]
    from meshplan.cluster import ClusterSpec
    local = ClusterSpec.local()
    reference = reference_cluster(local, meshplan.load_cluster(args.reference))
    result: dict[str, Any] = {"device": str(dev.device_kind), "platform": dev.platform,
                              "jax": jax.__version__, "devices": len(jax.devices()),
                              "reference": args.reference,
                              "reference_achieved": reference.device.achieved.to_dict()}
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}")

    def save() -> None:     # after every section: a run cut short keeps what it measured
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")

    if "kernels" not in skip:
        t = time.perf_counter()
        result["kernels"] = kernel_rows(reference.device, args.quick, args.repeats, log)
        log(f"kernels: {time.perf_counter() - t:.0f} s")
        save()
    clusters = {"local": local, "reference": reference}
    if "calibrate" not in skip:
        t = time.perf_counter()
        cal = calibrate(options=Options.quick() if args.quick else Options(repeats=5))
        (out / "calibrated.json").write_text(cal.cluster.to_json() + "\n")
        clusters["calibrated"] = cal.cluster
        result["calibrated"] = {"peak_flops": dict(cal.cluster.device.peak_flops),
                                "memory_bandwidth": cal.cluster.device.memory_bandwidth_bytes_per_s,
                                "achieved": cal.cluster.device.achieved.to_dict()}
        log(f"calibrate: {time.perf_counter() - t:.0f} s: {result['calibrated']}")
        save()
    if "steps" not in skip:
        t = time.perf_counter()
        result["steps"] = []
        step_rows(clusters, args.quick, args.steps, log, result["steps"], save,
                  [m for m in args.models.split(",") if m],
                  [int(m) for m in args.micro_batches.split(",")])
        log(f"steps: {time.perf_counter() - t:.0f} s")

    save()
    lines = [f"# gpu_check: {result['device']} ({result['platform']}), jax {result['jax']}", "",
             f"reference achieved figures from `{args.reference}`: "
             f"{result['reference_achieved']}", ""]
    if "kernels" in result:
        lines += table(result["kernels"], ["kind", "dtype", "shape", "measured_us", "tflops",
                                           "gbps", "predicted_us", "ratio", "tf32_ratio"])
        lines.append("")
    if "calibrated" in result:
        lines += [f"calibrated: {result['calibrated']}", ""]
    if "steps" in result:
        cols = ["model", "method", "measured_ms"] + [f"predicted_ms[{c}]" for c in clusters] \
            + ["predicted_mem_gib", "compiled_mem_gib", "loss_rel_err", "plan", "error"]
        lines += table(result["steps"], cols)
    text = "\n".join(lines) + "\n"
    (out / "gpu_check.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
