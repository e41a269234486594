"""A pipelined step on one accelerator: the host's time per stage program and
the memory a donated step holds, against the plan.

A plan of one stage and several micro-batches runs on the pipeline driver
(``runtime/pipeline_driver.py``) as a pipeline of many stages does: a forward
and a backward program per micro-batch and an update, each handed to the
device by one host thread.  On one GPU this measures what no CPU run can:

- **host time per stage program**: a call made on an idle device returns
  once its programs are dispatched; that time over the programs it ran is
  what ``achieved.pipeline_program_s`` stands for (``meshplan calibrate``
  measures it on a 4-layer MLP; here on gpt steps with Adam, hundreds of
  arrays per program);
- **step time** waited for (each step blocked on before the next call) and
  back to back (10 calls, blocked on once), against
  ``plan.predicted.iteration_s``;
- **memory**: the device allocator's peak (``memory_stats()``) over a run of
  the step with ``donate_argnums=(0,)``, against the stage's predicted memory
  (one stage: the plan's), and whether the donated state was deleted.

Each (model, micro-batches) row runs in a fresh process, so the allocator's
peak is that row's alone; ``jit`` rows run ``jax.jit`` of the plain step
(donated too) and give the loss every row is compared with.

    python benchmarks/gpu_driver.py --out DIR [--models gpt-small-b8,gpt-350m-b8]
        [--micro-batches 1,2,4,8] [--quick]     (runs meshplan calibrate first)
    python benchmarks/gpu_driver.py --report DIR/gpu_driver.json [--cluster FILE]   (CPU)

``--report`` prints the tables and re-predicts every row on CPU with the
device as ``ClusterSpec.local()`` describes it, and with the host's figures
on top: ``--cluster``'s ``achieved.pipeline_program_s`` and
``pipeline_buffer_s`` (a ``meshplan calibrate`` file), or ``--program-s`` /
``--buffer-s``.
Written for a lent GPU (CI has none); ``--quick`` runs every path on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_check import QUICK_STEP_MODELS, STEP_MODELS, device_like, table  # noqa: E402

CALLS = 10


def _config(name: str) -> dict:
    return {**STEP_MODELS, **QUICK_STEP_MODELS}[name]


def _plan(model: Any, m: int, cluster: Any) -> Any:
    import meshplan
    state, batch = model.abstract_args
    return meshplan.plan(model.train_step, state, batch, cluster=cluster,
                         batch_argnums=model.batch_argnums,
                         method=meshplan.Manual(dp=1, tp=1, pp=1, num_micro_batches=m))


def programs_of(m: int) -> int:
    """Stage programs one call runs (one stage): forward and backward per
    micro-batch and the update, or the whole step as one program."""
    from meshplan.cost_model.pipeline import stage_programs
    return 1 if m == 1 else stage_programs(1, m)


def run_row(name: str, m: int) -> dict:
    """Measure one row in this process (``m`` 0: ``jax.jit`` of the step)."""
    import jax
    import meshplan
    from meshplan.cluster import ClusterSpec
    from meshplan.models import build_model
    model = build_model("gpt", _config(name))
    row: dict[str, Any] = {"model": name, "micro_batches": m or "jit"}
    if m:
        plan = _plan(model, m, ClusterSpec.local())
        row.update(predicted_ms=plan.predicted.iteration_s * 1e3,
                   predicted_mem_gib=plan.predicted.peak_memory_bytes / 2**30,
                   stage_mem_gib=plan.stages[0].predicted.memory_bytes / 2**30,
                   programs=programs_of(m))
        step = meshplan.parallelize(model.train_step, plan=plan, donate_argnums=(0,))
    else:
        step = jax.jit(model.train_step, donate_argnums=(0,))

    def peak(label: str) -> None:      # the allocator's peak so far (GPU; CPUs have none)
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            row[f"peak_{label}_gib"] = stats["peak_bytes_in_use"] / 2**30

    state, batch = model.init(0)
    jax.block_until_ready((state, batch))
    peak("init")
    held = jax.tree.leaves(state)
    s, metrics = step(state, batch)
    jax.block_until_ready(s)
    peak("first_call")
    row["loss"] = float(metrics["loss"])
    row["donated_deleted"] = all(x.is_deleted() for x in held)
    del state, held
    waited, dispatch = [], []
    for _ in range(CALLS):
        jax.block_until_ready(s)
        t = time.perf_counter()
        s, _ = step(s, batch)
        dispatch.append(time.perf_counter() - t)
        jax.block_until_ready(s)
        waited.append(time.perf_counter() - t)
    jax.block_until_ready(s)
    peak("waited")
    t = time.perf_counter()
    for _ in range(CALLS):
        s, _ = step(s, batch)
    jax.block_until_ready(s)
    row.update(waited_ms=statistics.median(waited) * 1e3,
               back_to_back_ms=(time.perf_counter() - t) / CALLS * 1e3,
               dispatch_ms=statistics.median(dispatch) * 1e3)
    if m:
        row["host_per_program_us"] = row["dispatch_ms"] * 1e3 / row["programs"]
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        row["peak_gib"] = stats["peak_bytes_in_use"] / 2**30
    row["state_gib"] = sum(x.nbytes for x in jax.tree.leaves(s)) / 2**30
    return row


def dispatch_vs_buffers(counts: Sequence[int] = (1, 16, 128, 512, 2048)) -> list[dict]:
    """Host time of a jitted call (devices idle) against its argument and
    result buffers: ``k`` arrays in and one out, and ``k`` in and ``k`` out."""
    import jax
    import jax.numpy as jnp
    rows = []
    for k in counts:
        xs = [jnp.full((4,), float(i)) for i in range(k)]
        for label, fn in (("k in, 1 out", lambda *a: sum(x[0] for x in a)),
                          ("k in, k out", lambda *a: [x + 1 for x in a])):
            f = jax.jit(fn)
            jax.block_until_ready(f(*xs))
            times = []
            for _ in range(20):
                t = time.perf_counter()
                r = f(*xs)
                times.append(time.perf_counter() - t)
                jax.block_until_ready(r)
            rows.append({"buffers": k, "case": label,
                         "dispatch_us": statistics.median(times) * 1e6})
    return rows


def programs_of_plan(name: str, m: int) -> list[dict]:
    """Each stage program of the one-stage plan: its buffers in and out and
    XLA's ``memory_analysis()`` (GiB), and the live arrays after a call."""
    import jax
    import meshplan
    from meshplan.cluster import ClusterSpec
    from meshplan.models import build_model
    model = build_model("gpt", _config(name))
    plan = _plan(model, m, ClusterSpec.local())
    step = meshplan.parallelize(model.train_step, plan=plan, donate_argnums=(0,))
    state, batch = model.init(0)
    rows = []
    for key, c in step.lower(state, batch).compile().compiled.items():
        a = c.memory_analysis()
        rows.append({"model": name, "micro_batches": m, "program": str(key),
                     "in": len(jax.tree.leaves(c.input_shardings)),
                     "out": len(jax.tree.leaves(c.output_shardings)),
                     **({} if a is None else {
                         "arg_gib": a.argument_size_in_bytes / 2**30,
                         "out_gib": a.output_size_in_bytes / 2**30,
                         "alias_gib": a.alias_size_in_bytes / 2**30,
                         "temp_gib": a.temp_size_in_bytes / 2**30})})
    s, _ = step(state, batch)
    jax.block_until_ready(s)
    live = jax.live_arrays()
    rows.append({"model": name, "micro_batches": m, "program": "live after a call",
                 "in": len(live), "arg_gib": sum(x.nbytes for x in live) / 2**30,
                 "peak_gib": (jax.devices()[0].memory_stats() or {}).get(
                     "peak_bytes_in_use", 0) / 2**30})
    return rows


def measure(out: pathlib.Path, names: Sequence[str], counts: Sequence[int]) -> list[dict]:
    rows: list[dict] = []
    for name in names:
        for m in [0, *counts]:
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--row", name, str(m)],
                                  capture_output=True, text=True, env=os.environ)
            last = (proc.stdout.strip().splitlines() or [""])[-1]
            if last.startswith("{"):
                row = json.loads(last)
            else:
                tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
                row = {"model": name, "micro_batches": m or "jit", "error": tail}
                (out / f"error_{name}_{m}.log").write_text(proc.stderr[-20000:])
            if proc.returncode:
                row["exit"] = proc.returncode
            row["wall_s"] = round(time.perf_counter() - t, 1)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
            (out / "gpu_driver.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def report(rows: Sequence[dict], cluster_file: str | None, program_s: float | None = None,
           buffer_s: float | None = None) -> list[str]:
    """Tables of measured rows; predictions re-made with today's model, and
    with the host's figures of ``cluster_file`` (or given) on top."""
    import dataclasses
    import meshplan
    from meshplan.models import build_model
    device = rows[0].get("device", "")
    ref = {r["model"]: r.get("loss") for r in rows if r["micro_batches"] == "jit"}
    base = device_like(device) if device and not device.startswith("cpu") else None
    host = {}
    if cluster_file:
        a = meshplan.load_cluster(cluster_file).device.achieved
        host = {"pipeline_program_s": a.pipeline_program_s,
                "pipeline_buffer_s": a.pipeline_buffer_s}
    host.update({k: v for k, v in (("pipeline_program_s", program_s),
                                   ("pipeline_buffer_s", buffer_s)) if v is not None})
    out = []
    for r in rows:
        r = dict(r)
        if r.get("loss") is not None and ref.get(r["model"]):
            r["loss_rel_err"] = abs(r["loss"] - ref[r["model"]]) / abs(ref[r["model"]])
        m = r["micro_batches"]
        if base is not None and m != "jit" and "error" not in r:
            model = build_model("gpt", _config(r["model"]))
            r["predicted_ms"] = _plan(model, m, base).predicted.iteration_s * 1e3
            if host:
                a = dataclasses.replace(base.device.achieved, **host)
                c = dataclasses.replace(base, device=dataclasses.replace(base.device, achieved=a))
                r["with_host_ms"] = _plan(model, m, c).predicted.iteration_s * 1e3
        for k in ("predicted_ms", "with_host_ms"):
            if r.get(k) and r.get("back_to_back_ms"):
                r[k.replace("_ms", "") + "/b2b"] = r[k] / r["back_to_back_ms"]
        if r.get("peak_gib") and r.get("stage_mem_gib"):
            r["peak/stage_mem"] = r["peak_gib"] / r["stage_mem_gib"]
        out.append(r)
    cols = ["model", "micro_batches", "waited_ms", "back_to_back_ms", "dispatch_ms",
            "programs", "host_per_program_us", "predicted_ms", "predicted/b2b", "with_host_ms",
            "with_host/b2b", "stage_mem_gib", "peak_gib", "peak/stage_mem", "state_gib",
            "donated_deleted", "loss_rel_err", "error"]
    return table(out, [c for c in cols if any(c in r for r in out)])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--models", default="gpt-small-b8,gpt-350m-b8")
    ap.add_argument("--micro-batches", default="1,2,4,8")
    ap.add_argument("--quick", action="store_true", help="a toy model (a CPU smoke run)")
    ap.add_argument("--row", nargs=2, metavar=("MODEL", "M"), help=argparse.SUPPRESS)
    ap.add_argument("--probe", metavar="MODEL:M,...",
                    help="dispatch time against buffers, and each program's buffers and "
                         "memory_analysis() for these rows (printed as JSON lines)")
    ap.add_argument("--report", metavar="JSON", help="tables of a measured run (CPU)")
    ap.add_argument("--cluster", help="with --report: a calibrated file's host figures "
                                      "(pipeline_program_s, pipeline_buffer_s)")
    ap.add_argument("--program-s", type=float, help="with --report: pipeline_program_s")
    ap.add_argument("--buffer-s", type=float, help="with --report: pipeline_buffer_s")
    args = ap.parse_args(argv)
    if args.row:
        import jax
        row = run_row(args.row[0], int(args.row[1]))
        row["device"] = str(jax.devices()[0].device_kind)
        print(json.dumps(row), flush=True)
        return 0
    if args.probe:
        import jax
        rows = dispatch_vs_buffers()
        for spec in args.probe.split(","):
            name, m = spec.rsplit(":", 1)
            rows += programs_of_plan(name, int(m))
        for r in rows:
            print(json.dumps(r), flush=True)
        return 0
    if args.report:
        print("\n".join(report(json.loads(pathlib.Path(args.report).read_text()),
                               args.cluster, args.program_s, args.buffer_s)))
        return 0
    if not args.out:
        ap.error("--out FOLDER is required to measure (or --report JSON)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(QUICK_STEP_MODELS) if args.quick else args.models.split(",")
    # the host's figures of this machine first (its own process): the report
    # re-predicts every row with them
    cal = out / "calibrated.json"
    proc = subprocess.run([sys.executable, "-m", "meshplan.cli", "calibrate", "--out", str(cal)]
                          + (["--quick"] if args.quick else []), capture_output=True, text=True)
    (out / "calibrate.log").write_text(proc.stdout + proc.stderr)
    rows = measure(out, names, [int(m) for m in args.micro_batches.split(",")])
    print("\n".join(report(rows, str(cal) if proc.returncode == 0 else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
