"""Planning time of ``--method auto`` against model size and device count.

Alpa's GPT weak-scaling suite (gpt-350m on 1 V100 ... gpt-39b on 64) on AWS
p3.16xlarge clusters.  For each row:

* ``cli_s``: ``meshplan plan --model M --cluster C --method auto`` end to end
  (a fresh process: imports, tracing, planning, printing the plan);
* the same planning in this process, split into its parts: the first trace,
  re-tracing per micro-batch count (done while the ILP workers run where
  possible), waiting on layer ILPs, the stage DP and the rest; ``ilp_work_s``
  is what the layer ILPs took summed over the worker processes;
* how many micro-batch counts were searched, how many distinct layer ILPs the
  search needed, how many it solved and how many layer costs came from the
  ILP cache (identical transformer blocks are one problem; the cache starts
  empty for every row).

With ``--check-pruning`` each row is planned a second time searching every
micro-batch count (``PipelineOptions(prune_micro_batches=False)``) and the
table says whether the pruned search chose the same plan.

Rows beyond Alpa's suite (:data:`EXTRA`, on DGX A100 clusters): Megatron-LM's
39.1B on 512 GPUs and 1T on 3072 with ``--method auto``, and one manual
configuration of a GPT-3 175B on 512 (the unit cost of a grid search).
With ``--grid``, a grid of such configurations planned one after another in
one session (``planning_time_grid.md``): what each further one costs.
``rewrite_s`` is the part of the per-count Graphs made by rewriting the first
trace's shapes (:mod:`meshplan.trace.rescale`), ``retrace_s`` the part traced.

    python benchmarks/planning_time.py [--rows gpt-350m,gpt-1.3b] [--workers N] [--check-pruning]
                                       [--no-cli] [--out DIR] [--grid]

Writes benchmarks/results/planning_time.md and .csv.  The figures depend on
the machine and on what else runs on it: the committed ones say where they
were taken.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import pathlib
import platform
import subprocess
import sys
import time

import meshplan
from meshplan.dp_search import Session, search_pipeline
from meshplan.planning import plan_step, retracer
from meshplan.errors import InfeasiblePlanError
from meshplan.models import PRESET_INFO, build_model
from meshplan.trace import trace
from plan_quality import cluster_file, cluster_for, describe   # (benchmarks/ is on sys.path)

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
ROWS = ["gpt-350m", "gpt-760m", "gpt-1.3b", "gpt-2.6b", "gpt-6.7b", "gpt-15b", "gpt-39b"]
KEYS = ["model", "gpus", "cli_s", "total_s", "trace_s", "rewrite_s", "retrace_s", "ilp_wait_s",
        "ilp_work_s", "dp_s", "other_s", "searches", "micro_batch_counts", "bounded", "relaxed_fit",
        "rewritten", "retraced", "distinct_layer_ilps", "solved", "cache_hits", "hit_rate", "plan",
        "tflops_per_gpu"]
# GPT-3 175B (Brown et al. 2020: hidden 12288, 96 layers, 96 heads, seq 2048),
# batch 1536 and precision as Megatron-LM's rows
GPT3_175B = {"hidden": 12288, "layers": 96, "heads": 96, "seq_len": 2048, "vocab": 51200,
             "batch": 1536, "dtype": "float32", "compute_dtype": "bfloat16"}
# row -> (model, overrides, cluster file, method, the CLI's method flags)
EXTRA = {
    "megatron-39.1b": ("megatron-39.1b", {}, "dgx-a100-x64.json", "meshplan.Auto()",
                       ["--method", "auto"]),
    "megatron-1t": ("megatron-1t", {}, "dgx-a100-x384.json", "meshplan.Auto()",
                    ["--method", "auto"]),
    "gpt3-175b-manual": ("gpt", GPT3_175B, "dgx-a100-x64.json",
                         "meshplan.Manual(dp=8, tp=8, pp=8, num_micro_batches=96)",
                         ["--method", "manual", "--dp", "8", "--tp", "8", "--pp", "8",
                          "--micro-batches", "96"]),
}
CHECK_KEYS = ["exhaustive_s", "exhaustive_counts", "exhaustive_plan", "same_choice"]
# --grid: hand plans (dp, tp, pp, micro-batches) of the GPT-3 175B shape on
# dgx-a100-x64, one after another in one session, as a user's grid search runs
GRID = ((8, 8, 8, 96), (4, 8, 16, 96), (2, 8, 32, 96), (8, 8, 8, 192), (4, 8, 16, 192),
        (8, 8, 8, 48))


def cli_seconds(name: str, gpus: int) -> float:
    """Wall time of the CLI command a user would type, in a fresh process."""
    cmd = [sys.executable, "-m", "meshplan.cli", "plan", "--model", name,
           "--cluster", str(cluster_file(gpus)), "--method", "auto"]
    if name in EXTRA:
        model, overrides, cluster, _, flags = EXTRA[name]
        cmd = [sys.executable, "-m", "meshplan.cli", "plan", "--model", model,
               *[f"--model-arg={k}={v}" for k, v in overrides.items()],
               "--cluster", str(ROOT / "examples" / "clusters" / cluster), *flags]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - t0


def run_row(name: str, check_pruning: bool, cli: bool = True) -> dict:
    if name in EXTRA:
        model, overrides, cluster_name, method_text, _ = EXTRA[name]
        cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / cluster_name)
        gpus, method = cluster.num_devices, eval(method_text, {"meshplan": meshplan})
    else:
        model, overrides, method = name, {}, meshplan.Auto()
        gpus = PRESET_INFO[name]["gpus"]
        cluster = cluster_for(gpus)
    row: dict = {"model": name, "gpus": gpus, "cli_s": cli_seconds(name, gpus) if cli else ""}
    session = Session.from_env()            # every row starts cold
    m = build_model(model, overrides)
    t0 = time.perf_counter()
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name=name)
    t1 = time.perf_counter()
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, name, graph=graph)
    s: dict = {}
    try:
        planned = plan_step(graph, cluster, method, retrace=rt, session=session)
        plan = planned.plan
        s = dataclasses.asdict(planned.search) if planned.search else {}
    except InfeasiblePlanError as e:
        plan = None
        row["plan"] = f"does not fit ({str(e)[:60]})"
    t2 = time.perf_counter()
    row.update(total_s=t2 - t0, trace_s=t1 - t0, rewrite_s=s.get("rewrite_s", 0.0),
               retrace_s=s.get("trace_s", 0.0) - s.get("rewrite_s", 0.0),
               ilp_wait_s=s.get("ilp_s", 0.0), ilp_work_s=s.get("ilp_work_s", 0.0),
               dp_s=s.get("dp_s", 0.0))
    row["other_s"] = row["total_s"] - sum(row[k] for k in ("trace_s", "rewrite_s", "retrace_s",
                                                           "ilp_wait_s", "dp_s"))
    for k in ("searches", "micro_batch_counts", "bounded", "relaxed_fit", "rewritten", "retraced",
              "distinct_layer_ilps", "solved", "cache_hits"):
        row[k] = s.get(k, "")
    looked_up = s.get("solved", 0) + s.get("cache_hits", 0)
    row["hit_rate"] = f"{s['cache_hits'] / looked_up:.0%}" if looked_up else ""
    if plan is not None:
        row.update(plan=describe(plan), tflops_per_gpu=round(plan.predicted.tflops_per_device, 2))
    if check_pruning and isinstance(method, meshplan.Auto):
        row.update(check_row(graph, cluster, rt, session))
    return row


def grid(out: pathlib.Path) -> None:
    """:data:`GRID` planned with ``meshplan.plan`` in one session: the seconds
    of each configuration and how the session gave it the step's Graph."""
    cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / "dgx-a100-x64.json")
    m = build_model("gpt", GPT3_175B)
    session = Session.from_env()
    lines = ["| dp | tp | pp | micro-batches | seconds | micro-batch Graph | TFLOP/s per GPU |",
             "|---:|---:|---:|---:|---:|---|---:|"]
    for dp, tp, pp, mb in GRID:
        t0 = time.perf_counter()
        try:
            p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                              method=meshplan.Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=mb),
                              session=session)
            tflops = f"{p.predicted.tflops_per_device:.1f}"
        except InfeasiblePlanError as e:
            tflops = f"does not fit ({str(e)[:40]})"
        dt = time.perf_counter() - t0
        how = next(iter(session.traces.values())).retrace.log[-1][1]
        lines.append(f"| {dp} | {tp} | {pp} | {mb} | {dt:.1f} | {how} | {tflops} |")
        print(lines[-1], flush=True)
    text = ["# Planning time of a grid of hand plans in one session (GPT-3 175B shape, "
            "dgx-a100-x64)", "",
            f"Command: `python benchmarks/planning_time.py --grid`, {time.strftime('%Y-%m-%d')}, "
            f"{os.cpu_count()} CPUs.  Each row `meshplan.plan(train_step, state, batch, "
            "method=Manual(dp, tp, pp, num_micro_batches), session=session)` in turn, one "
            "session: the first traces the step at its batch and at the micro-batch size; "
            "later ones reuse the trace, the micro-batch Graph (`kept`: that count's Graph "
            "again; `rewritten`: from the first trace's shapes) and its layer analysis, and "
            "solve only the layer ILPs of meshes not yet seen.", ""] + lines
    out.mkdir(parents=True, exist_ok=True)
    (out / "planning_time_grid.md").write_text("\n".join(text) + "\n")
    print(f"wrote {out / 'planning_time_grid.md'}")


def check_row(graph, cluster, rt, session) -> dict:
    """The pipeline search with and without micro-batch pruning (warm cache:
    the time is of the exhaustive search's extra counts)."""
    opts = meshplan.Auto().request(cluster.num_devices).pipeline
    out: dict = {}
    choices = []
    for prune in (True, False):
        t0 = time.perf_counter()
        try:
            p, stats = search_pipeline(
                graph, cluster, dataclasses.replace(opts, prune_micro_batches=prune),
                method_name="auto", retrace=rt, session=session)
            choices.append((describe(p), round(p.predicted.iteration_s, 9)))
        except InfeasiblePlanError:
            choices.append(("does not fit", None))
        if not prune:
            out.update(exhaustive_s=time.perf_counter() - t0,
                       exhaustive_counts=stats.micro_batch_counts if choices[-1][1] else "",
                       exhaustive_plan=choices[-1][0])
    out["same_choice"] = "yes" if choices[0] == choices[1] else "NO"
    return out


def fmt(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def write(rows: list[dict], keys: list[str], command: str, workers: int,
          out: pathlib.Path = OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "planning_time.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})
    lines = [
        "# Planning time (Alpa GPT suite on AWS p3.16xlarge, `--method auto`; Megatron-LM "
        "rows on DGX A100)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs visible, {workers} ILP worker "
        f"process(es), {time.strftime('%Y-%m-%d')}.  Seconds of wall time; other jobs may have "
        "shared the CPUs.",
        "",
        "`cli`: `meshplan plan --model M --cluster C --method auto` end to end in a fresh "
        "process.  The same planning in this process: `total` = `trace` (the first trace of "
        "the step) + `rewrite` (the step's Graph at each micro-batch size searched, rewritten "
        "from the first trace) + `retrace` (tracing it where the rewrite is not proven exact: "
        "the first count, a probe, and micro-batches of one example; mostly while the "
        "workers solve the previous count's layer ILPs) + `ilp wait` (waiting on the layer "
        "ILPs) + `dp` (the stage-submesh DP) + `other` (layering, layer subgraphs, plan "
        "assembly, the one-stage comparison).  `searches`: inter-operator searches (a second "
        "one, with every gradient reduced each micro-batch, where memory binds); the "
        "counts and seconds after it sum them.  `bounded`: micro-batch counts (among "
        "`micro batch counts`) passed over because even with memory to spare (every stage its "
        "fastest way on its layers' uncapped plans) they plan no faster than the best so far; "
        "`relaxed fit`: counts whose relaxed plan fit the memory as it was, which is then "
        "their plan (no capped layer ILP solved).  "
        "`ilp work`: what the layer ILPs took, summed "
        "over the worker processes.  `distinct layer ilps`: the problems the search needed "
        "(identical blocks count once); `hit rate`: layer costs found in the cache over all "
        "layer-cost look-ups.  `plan`: stages x [logical mesh], micro-batches, schedule.",
    ]
    if "same_choice" in keys:
        lines += ["", "`exhaustive`: the pipeline search again with every micro-batch count "
                  "(no pruning), on a warm ILP cache; `same choice`: whether both searches "
                  "chose the same plan."]
    lines += ["", "| " + " | ".join(k.replace("_", " ") for k in keys) + " |",
              "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    (out / "planning_time.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--workers", type=int, default=None,
                    help="ILP worker processes (default: MESHPLAN_WORKERS, else the CPUs)")
    ap.add_argument("--check-pruning", action="store_true",
                    help="also search every micro-batch count and compare the choices")
    ap.add_argument("--no-cli", action="store_true",
                    help="skip the end-to-end CLI run of each row (half the time)")
    ap.add_argument("--out", type=pathlib.Path, default=OUT,
                    help=f"folder for planning_time.md and .csv (default {OUT})")
    ap.add_argument("--grid", action="store_true",
                    help="instead, time a grid of 175B hand plans planned in one session")
    args = ap.parse_args(argv)
    if args.workers is not None:
        os.environ["MESHPLAN_WORKERS"] = str(args.workers)
    if args.grid:
        grid(args.out)
        return 0
    workers = Session.from_env().workers
    keys = KEYS + (CHECK_KEYS if args.check_pruning else [])
    rows = []
    for name in args.rows.split(","):
        if name not in PRESET_INFO and name not in EXTRA:
            print(f"unknown row {name!r}: use one of {', '.join(ROWS + list(EXTRA))}",
                  file=sys.stderr)
            return 2
        row = run_row(name, args.check_pruning, cli=not args.no_cli)
        print("  ".join(f"{k}={fmt(row.get(k, ''))}" for k in keys), flush=True)
        rows.append(row)
        # written after every row: a long run stopped early keeps what it measured
        write(rows, keys, "python benchmarks/planning_time.py " + " ".join(argv or sys.argv[1:]),
              workers, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
