"""Where a train step's time goes on one GPU, kernel by kernel, against the cost model.

``gpu_check.py`` compares whole steps and isolated kernels with the model; on
an H200 a step of the 350M gpt measured a quarter slower than predicted while
isolated kernels of its sizes were priced right.  This script says where a
step's time goes: it profiles the jitted step (the program meshplan's
one-device plan runs) and sorts the GPU's kernels by what XLA made of them
(matmuls, fusions, copies...), next to the model's time for the same kinds of
work (``benchmarks/results/gpu_profile.md``: the quarter was host time between
steps that were each waited for).

On the GPU (writes ``profile_<model>.json.gz``: the step's measured time, its
kernels as the profiler saw them and the optimized HLO text; and, for the
first model, the profiler's raw trace)::

    python benchmarks/gpu_profile.py --out DIR [--models gpt-350m-b8,...] [--quick]

On CPU, afterwards (reads those files; the model's side is planned here for
the device the profile names)::

    python benchmarks/gpu_profile.py --analyze DIR/profile_*.json.gz

Steps are timed two ways: each waited for before the next is called, as
``gpu_check.py`` times them (median of ``--steps`` after a warm-up), and
``--steps`` dispatched back to back and waited for once (the host prepares
a step while the device runs the one before).  The profile covers
``--profile-steps`` further steps, and per-step figures are its totals
divided by that count.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_check import QUICK_STEP_MODELS, STEP_MODELS, device_like, waited_steps  # noqa: E402

RAW_LIMIT = 15 << 20        # raw traces larger than this (gzipped) stay behind
OTHER_ROWS = 12             # rows of the non-matmul table (the largest either side)


# ---------------------------------------------------------------------------
# reading a profile (no accelerator needed)

MATMUL_KERNEL = re.compile(r"nvjet|gemm|xmma|cutlass|cublas")


def kernel_class(name: str) -> str:
    """What XLA made a GPU kernel of, from its name: a matmul (cuBLAS, or a
    Triton GEMM fusion), an XLA fusion (loop: element-wise; input: reductions,
    scatters, transposes; kCustom ``fusion_N`` / ``triton_*``: block-level
    fusions such as softmax), a lone transpose or convert, or a memset."""
    if MATMUL_KERNEL.search(name):
        return "matmul"
    if name.startswith(("loop_", "input_", "fusion", "triton_")):
        return "fusion"
    if name.startswith("wrapped_"):
        return "transpose/convert"
    if name.lower().startswith("memset") or name.lower().startswith("memcpy"):
        return "memset/memcpy"
    return "other"


def kernels_of(profile: dict) -> list[dict]:
    """The kernel events (the profiler's stream lines, not the lines it
    derives from them), in start order."""
    threads = profile["threads"]
    return sorted((e for e in profile["events"]
                   if "Stream" in threads.get(f"{e['pid']}/{e['tid']}", "")),
                  key=lambda e: e["ts"])


def result_shapes(hlo: str) -> dict[str, tuple[int, ...]]:
    """HLO instruction name -> the shape of its result (a tuple's first)."""
    out: dict[str, tuple[int, ...]] = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = \(?\w+\[([\d,]*)\]", hlo, re.M):
        out.setdefault(m.group(1), tuple(int(x) for x in m.group(2).split(",") if x))
    return out


def measured_side(profile: dict) -> dict:
    """Per step: kernel count and busy time per class, the device's busy
    time and the span of a step's kernels, and kernel count and time by
    result size (the HLO instruction's result, a tuple's first), matmuls
    and the rest apart."""
    ks = kernels_of(profile)
    steps = profile["profile_steps"]
    per = len(ks) // steps
    classes: dict[str, list[float]] = {}
    for e in ks:
        c = classes.setdefault(kernel_class(e["name"]), [0.0, 0.0])
        c[0] += 1 / steps
        c[1] += e["dur"] * 1e-3 / steps
    spans = [k[-1]["ts"] + k[-1]["dur"] - k[0]["ts"]
             for k in (ks[i * per:(i + 1) * per] for i in range(steps)) if k]
    shapes = result_shapes(profile["hlo"])
    by_size: dict[str, dict[int, list[float]]] = {"matmuls": {}, "others": {}}
    for e in ks:
        shape = shapes.get(e["args"].get("hlo_op", ""))
        if shape is not None:
            kind = "matmuls" if kernel_class(e["name"]) == "matmul" else "others"
            m = by_size[kind].setdefault(math.prod(shape), [0.0, 0.0])
            m[0] += 1 / steps
            m[1] += e["dur"] * 1e-3 / steps
    return {"classes": classes, "kernels": len(ks) / steps,
            "busy_ms": sum(c[1] for c in classes.values()),
            "span_ms": statistics.median(spans) * 1e-3 if spans else float("nan"),
            **by_size}


def model_side(profile: dict) -> dict:
    """The cost model's account of the same step on the device the profile
    ran on (as ``ClusterSpec.local()`` describes it there today): per class
    of work the kernels it counts and their time, the matmuls' and the rest's
    time by result size, and the one-device plan's predicted iteration."""
    import jax
    import meshplan
    from meshplan import datasheets
    from meshplan.api import _abstract, trace_step
    from meshplan.cluster import ClusterSpec
    from meshplan.cost_model.fusion import FUSIBLE, NO_KERNEL, kernels
    from meshplan.cost_model.mesh import mesh_model
    from meshplan.graph import strip_markers
    from meshplan.ilp.build import build_problem
    from meshplan.ilp.strategies import MATMULS
    from meshplan.models import build_model
    from meshplan.plan import LogicalMesh
    if datasheets.known_device("gpu", profile["device"]) is not None:
        cluster = device_like(profile["device"])
    else:       # (no datasheet figures: the device as it was seen)
        cluster = ClusterSpec.from_dict(profile["local_cluster"])
    model = build_model("gpt", profile["config"])
    state, batch = jax.eval_shape(lambda: model.init(0))
    # (as a one-stage plan sees it: meshplan's own markers taken out)
    graph = strip_markers(trace_step(model.train_step, _abstract((state, batch)),
                                     model.batch_argnums, "step")[0])
    built = build_problem(graph, mesh_model(cluster, LogicalMesh(("data",), (1,))))
    launches = kernels(graph)
    classes: dict[str, list[float]] = {}
    others: dict[int, list[float]] = {}     # the rest by result size
    matmuls: dict[int, list[float]] = {}
    flops: dict[int, float] = {}
    batched: set[int] = set()       # result sizes with a batched product among them
    for g in built.groups:
        if g.root_node is None:
            continue
        node = graph.nodes[g.root_node]
        p = node.primitive
        name = ("matmul" if p in MATMULS else "fusion" if p in FUSIBLE
                else "views (no kernel)" if p in NO_KERNEL else "other")
        c = classes.setdefault(name, [0.0, 0.0])
        c[0] += launches.get(node.id, 0)
        c[1] += g.compute[0] * 1e3
        if p not in MATMULS:
            size = max((math.prod(graph.tensors[t].shape) for t in node.outputs), default=0)
            o = others.setdefault(size, [0.0, 0.0])
            o[0] += launches.get(node.id, 0)
            o[1] += g.compute[0] * 1e3
        if p in MATMULS:
            size = math.prod(graph.tensors[node.outputs[0]].shape)
            m = matmuls.setdefault(size, [0.0, 0.0])
            m[0] += 1
            m[1] += g.compute[0] * 1e3
            flops[size] = flops.get(size, 0.0) + node.flops
            dims = dict(node.params).get("dimension_numbers")
            if p != "dot_general" or (dims and dims[1][0]):
                batched.add(size)
    step = meshplan.parallelize(model.train_step,
                                method=meshplan.Manual(dp=1, tp=1, pp=1, num_micro_batches=1),
                                cluster=cluster, batch_argnums=model.batch_argnums)
    plan = step.plan_for(state, batch)
    return {"classes": classes, "matmuls": matmuls, "others": others, "flops": flops,
            "batched": batched, "iteration_ms": plan.predicted.iteration_s * 1e3}


def _rate(meas: dict, model: dict, size: int) -> float:
    """TFLOP/s of the matmuls with results of ``size`` elements: the model's
    FLOPs over the measured time (nan where either side has none)."""
    mt = meas["matmuls"].get(size, (0, 0.0))[1]
    if not mt or size not in model["matmuls"]:
        return float("nan")
    return model["flops"][size] / (mt * 1e-3) / 1e12


def plain_gemm_rates(meas: dict, model: dict) -> list[float]:
    """TFLOP/s of each result size whose matmuls are all plain 2-D products
    and ran as the kernels the model counts (no split-K, nothing batched):
    what a step's GEMMs achieve."""
    out = []
    for size, (mk, _) in meas["matmuls"].items():
        pk = model["matmuls"].get(size, (0, 0.0))[0]
        if mk and round(mk) == round(pk) and size not in model["batched"]:
            out.append(_rate(meas, model, size))
    return out


def _row(cells: Sequence[Any]) -> str:
    def cell(x: Any) -> str:
        if isinstance(x, float):
            return "" if math.isnan(x) else f"{x:.2f}"
        return str(x)
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def analyze(paths: Sequence[str]) -> str:
    """Markdown: for each profile, the step (waited for, back to back, the
    device busy) against the model, its work by class, and its matmuls."""
    lines: list[str] = []
    for path in paths:
        with gzip.open(path, "rt") as fp:
            prof = json.load(fp)
        meas, model = measured_side(prof), model_side(prof)
        lines += [f"### {prof['model']} on {prof['device']} (jax {prof['jax']}; XLA_FLAGS "
                  f"`{prof['xla_flags'] or '(none)'}`)", "",
                  _row(["waited for, ms", "back to back, ms", "kernels busy, ms",
                        "kernels a step", "predicted, ms", "predicted / back to back",
                        "argument buffers"]), _row(["---"] * 7),
                  _row([prof["measured_ms"], prof.get("pipelined_ms", float("nan")),
                        meas["busy_ms"], f"{meas['kernels']:.0f}", model["iteration_ms"],
                        model["iteration_ms"] / prof.get("pipelined_ms", float("nan")),
                        prof.get("argument_buffers", "")]), ""]
        lines += [_row(["measured class", "kernels", "ms", "", "model class", "kernels", "ms"]),
                  _row(["---"] * 7)]
        mc = sorted(meas["classes"].items(), key=lambda kv: -kv[1][1])
        pc = sorted(model["classes"].items(), key=lambda kv: -kv[1][1])
        for i in range(max(len(mc), len(pc))):
            a = mc[i] if i < len(mc) else ("", ("", float("nan")))
            b = pc[i] if i < len(pc) else ("", ("", float("nan")))
            lines.append(_row([a[0], f"{a[1][0]:.0f}" if a[0] else "", a[1][1], "",
                               b[0], f"{b[1][0]:.0f}" if b[0] else "", b[1][1]]))
        attributed = sum(k for k, _ in meas["matmuls"].values())
        if attributed < 0.9 * meas["classes"].get("matmul", (0, 0))[0]:
            lines += ["", "(matmul kernels not attributed to HLO instructions: the profile "
                      "ran with command buffers, whose kernels name the buffer)", ""]
            continue
        lines += ["", _row(["matmul result elements", "measured kernels", "measured ms",
                            "TFLOP/s", "model matmuls", "model ms", "model / measured"]),
                  _row(["---"] * 7)]
        sizes = sorted(set(meas["matmuls"]) | set(model["matmuls"]),
                       key=lambda s: -meas["matmuls"].get(s, [0, 0])[1])
        for s in sizes:
            mk, mt = meas["matmuls"].get(s, (0, 0.0))
            pk, pt = model["matmuls"].get(s, (0, 0.0))
            lines.append(_row([s, f"{mk:.0f}", mt, _rate(meas, model, s), f"{pk:.0f}", pt,
                               pt / mt if mt else float("nan")]))
        plain = plain_gemm_rates(meas, model)
        if plain:
            lines += ["", f"Unbatched GEMMs (rows of plain 2-D products, as many kernels as "
                      f"the model counts): median {statistics.median(plain):.1f} TFLOP/s "
                      f"({min(plain):.1f}-{max(plain):.1f}, {len(plain)} rows)."]
        lines += ["", _row(["other work: result elements", "measured kernels", "measured ms",
                            "", "model kernels", "model ms", "model / measured"]),
                  _row(["---"] * 7)]
        sizes = sorted(set(meas["others"]) | set(model["others"]),
                       key=lambda s: -max(meas["others"].get(s, (0, 0.0))[1],
                                          model["others"].get(s, (0, 0.0))[1]))
        for s in sizes[:OTHER_ROWS]:
            mk, mt = meas["others"].get(s, (0, 0.0))
            pk, pt = model["others"].get(s, (0, 0.0))
            lines.append(_row([s, f"{mk:.0f}", mt, "", f"{pk:.0f}", pt,
                               pt / mt if mt else float("nan")]))
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# measuring (on the GPU)

def device_events(trace: dict) -> tuple[dict[str, str], dict[str, str], list[dict]]:
    """(process names, thread names, the events of accelerator processes) of
    a profiler trace: complete ("X") events of every process not named
    ``/host:...``.  Each event keeps its name, start, duration, process,
    thread and arguments.  (A device process has kernel lines, one per
    stream, and lines derived from them: XLA ops, modules, name scopes.)"""
    events = trace.get("traceEvents", [])
    names = {str(e["pid"]): e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {f"{e['pid']}/{e.get('tid', '')}": e.get("args", {}).get("name", "")
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    keep = {pid for pid, n in names.items() if not n.startswith("/host")}
    out = [{"name": e.get("name", ""), "ts": e.get("ts", 0.0), "dur": e.get("dur", 0.0),
            "pid": str(e["pid"]), "tid": str(e.get("tid", "")), "args": e.get("args", {})}
           for e in events if e.get("ph") == "X" and str(e.get("pid")) in keep]
    return names, threads, out


def step_timings(f: Any, s: Any, batch: Any, steps: int) -> tuple[dict, Any]:
    """Milliseconds a step takes waited for (median, and each), back to back
    (``steps`` dispatched, waited for once: the host prepares step i+1 while
    the device runs step i), and the host's time per call with the device
    busy (a call returns once the device takes the work, so not a host cost
    alone); and the last state."""
    import jax
    times, s = waited_steps(f, s, batch, steps)
    jax.block_until_ready(s)
    t = time.perf_counter()
    for _ in range(steps):
        s, _ = f(s, batch)
    jax.block_until_ready(s)
    pipelined = (time.perf_counter() - t) / steps
    calls = []
    for _ in range(steps):
        t = time.perf_counter()
        s, _ = f(s, batch)
        calls.append(time.perf_counter() - t)
    jax.block_until_ready(s)
    return {"measured_ms": statistics.median(times) * 1e3,
            "measured_ms_all": [x * 1e3 for x in times], "pipelined_ms": pipelined * 1e3,
            "host_call_ms": statistics.median(calls) * 1e3}, s


def profile_model(name: str, config: dict, out: pathlib.Path, steps: int, profile_steps: int,
                  keep_raw: bool, log) -> dict:
    import jax
    from meshplan.cluster import ClusterSpec
    from meshplan.models import build_model
    model = build_model("gpt", config)
    state, batch = model.init(0)
    f = jax.jit(model.train_step)
    t = time.perf_counter()
    compiled = f.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    s, _ = f(state, batch)
    jax.block_until_ready(s)
    timings, s = step_timings(f, s, batch, steps)
    timings["argument_buffers"] = len(jax.tree.leaves((state, batch)))
    log(f"{name}: {timings['measured_ms']:.2f} ms a step waited for, "
        f"{timings['pipelined_ms']:.2f} ms back to back, host {timings['host_call_ms']:.2f} ms "
        f"a call, {timings['argument_buffers']} argument buffers (compile {compile_s:.0f} s)")
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            s = waited_steps(f, s, batch, profile_steps)[1]
        found = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        if not found:
            raise RuntimeError(f"the profiler wrote no trace under {tmp}")
        with gzip.open(found[0], "rt") as fp:
            trace = json.load(fp)
        if keep_raw and os.path.getsize(found[0]) <= RAW_LIMIT:
            shutil.copy(found[0], out / f"raw_trace_{name}.json.gz")
    processes, threads, events = device_events(trace)
    log(f"{name}: {len(events)} device events in {profile_steps} steps; processes {processes}")
    dev = jax.devices()[0]
    result = {"model": name, "config": config, "device": str(dev.device_kind),
              "platform": dev.platform, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              **timings, "profile_steps": profile_steps, "processes": processes, "threads": threads,
              "events": events,
              "hlo": compiled.as_text(),
              "local_cluster": json.loads(ClusterSpec.local().to_json())}
    path = out / f"profile_{name}.json.gz"
    with gzip.open(path, "wt") as fp:
        json.dump(result, fp)
    log(f"{name}: wrote {path} ({path.stat().st_size >> 10} KiB)")
    return result


def measure(args: argparse.Namespace) -> int:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = QUICK_STEP_MODELS if args.quick else STEP_MODELS
    names = [m for m in args.models.split(",") if m] or list(models)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    for i, name in enumerate(names):
        try:
            profile_model(name, models[name], out, args.steps, args.profile_steps,
                          keep_raw=(i == 0 and not args.no_raw), log=log)
        except Exception as err:  # noqa: BLE001 -- the next model still runs
            log(f"{name}: failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for profile_<model>.json.gz (measure on the GPU)")
    ap.add_argument("--analyze", nargs="+", metavar="JSON_GZ",
                    help="no measuring: break measured profiles down against the model (CPU)")
    ap.add_argument("--models", default="gpt-350m-b8,gpt-h2048-l8-b8",
                    help="comma-separated gpu_check step models")
    ap.add_argument("--quick", action="store_true", help="a toy model (a CPU smoke run)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--no-raw", action="store_true", help="keep no raw trace")
    args = ap.parse_args(argv)
    if args.analyze:
        print(analyze(args.analyze))
        return 0
    if not args.out:
        ap.error("--out FOLDER to measure, or --analyze FILES")
    if args.quick and args.models == ap.get_default("models"):
        args.models = ",".join(QUICK_STEP_MODELS)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
