"""Planning time of ``--method auto`` against model size and device count.

Alpa's GPT weak-scaling suite (gpt-350m on 1 V100 ... gpt-39b on 64) on AWS
p3.16xlarge clusters.  For each row: the wall time of planning end to end and
its parts (tracing, re-tracing per micro-batch count, layer ILPs, stage DP),
how many distinct layer ILPs the search needed, how many it solved and how
many layer costs came from the ILP cache (identical transformer blocks are
one problem; the cache starts empty for every row).

    python benchmarks/planning_time.py [--rows gpt-350m,gpt-1.3b] [--workers N]

Writes benchmarks/results/planning_time.md and .csv.  The figures depend on
the machine and on what else runs on it: the committed ones say where they
were taken.
"""
from __future__ import annotations

import argparse
import csv
import os
import pathlib
import platform
import sys
import time

import meshplan
from meshplan import dp_search
from meshplan.api import plan_graph, retracer
from meshplan.errors import InfeasiblePlanError
from meshplan.models import PRESET_INFO, build_model
from meshplan.trace import trace
from plan_quality import cluster_for    # (benchmarks/ is on sys.path when run as a script)

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
ROWS = ["gpt-350m", "gpt-760m", "gpt-1.3b", "gpt-2.6b", "gpt-6.7b", "gpt-15b", "gpt-39b"]
KEYS = ["model", "gpus", "total_s", "trace_s", "retrace_s", "ilp_s", "dp_s", "other_s",
        "micro_batch_counts", "distinct_layer_ilps", "solved", "cache_hits", "hit_rate",
        "stages", "micro_batches", "tflops_per_gpu"]


def run_row(name: str) -> dict:
    gpus = PRESET_INFO[name]["gpus"]
    cluster = cluster_for(gpus)
    dp_search._LAYER_CACHE.clear()          # every row starts cold
    m = build_model(name)
    t0 = time.perf_counter()
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name=name)
    t1 = time.perf_counter()
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, name)
    row: dict = {"model": name, "gpus": gpus}
    try:
        plan = plan_graph(graph, cluster, meshplan.Auto(), retrace=rt)
    except InfeasiblePlanError as e:
        plan = None
        row["tflops_per_gpu"] = f"does not fit ({str(e)[:60]})"
    t2 = time.perf_counter()
    s = dict(dp_search.LAST_SEARCH)
    row.update(total_s=t2 - t0, trace_s=t1 - t0, retrace_s=s.get("trace_s", 0.0),
               ilp_s=s.get("ilp_s", 0.0), dp_s=s.get("dp_s", 0.0))
    row["other_s"] = row["total_s"] - sum(row[k] for k in ("trace_s", "retrace_s", "ilp_s", "dp_s"))
    for k in ("micro_batch_counts", "distinct_layer_ilps", "solved", "cache_hits"):
        row[k] = s.get(k, "")
    looked_up = s.get("solved", 0) + s.get("cache_hits", 0)
    row["hit_rate"] = f"{s['cache_hits'] / looked_up:.0%}" if looked_up else ""
    if plan is not None:
        row.update(stages=len(plan.stages), micro_batches=plan.num_micro_batches,
                   tflops_per_gpu=round(plan.predicted.tflops_per_device, 2))
    return row


def fmt(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def write(rows: list[dict], command: str, workers: int) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "planning_time.csv", "w", newline="") as f:
        w = csv.DictWriter(f, KEYS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in KEYS})
    lines = [
        "# Planning time of `--method auto` (Alpa GPT suite, AWS p3.16xlarge)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs visible, {workers} ILP worker "
        f"process(es), {time.strftime('%Y-%m-%d')}.  Seconds of wall time; other jobs may have "
        "shared the CPUs.",
        "",
        "Parts: `trace` the first trace of the step; `retrace` tracing it again at each "
        "micro-batch size; `ilp` layer ILPs (build and solve, or waiting on the worker "
        "processes); `dp` the stage-submesh DP without the ILPs it triggered; `other` "
        "layering, layer subgraphs, plan assembly and the one-stage comparison.  "
        "`distinct layer ilps`: the problems the search needed (identical blocks count once); "
        "`hit rate`: layer costs found in the cache over all layer-cost look-ups.",
        "",
        "| " + " | ".join(k.replace("_", " ") for k in KEYS) + " |",
        "|" + "---|" * len(KEYS),
    ]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in KEYS) + " |" for r in rows]
    (OUT / "planning_time.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--workers", type=int, default=None,
                    help="ILP worker processes (default: MESHPLAN_WORKERS, else the CPUs)")
    args = ap.parse_args(argv)
    if args.workers is not None:
        os.environ["MESHPLAN_WORKERS"] = str(args.workers)
    workers = dp_search._workers()
    rows = []
    for name in args.rows.split(","):
        if name not in PRESET_INFO:
            print(f"unknown row {name!r}: use one of {', '.join(ROWS)}", file=sys.stderr)
            return 2
        row = run_row(name)
        print("  ".join(f"{k}={fmt(row.get(k, ''))}" for k in KEYS), flush=True)
        rows.append(row)
        # written after every row: a long run stopped early keeps what it measured
        write(rows, "python benchmarks/planning_time.py " + " ".join(argv or sys.argv[1:]), workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
