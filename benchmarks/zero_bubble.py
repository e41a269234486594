"""ZB-H1 against 1F1B and GPipe in the planner's cost model, and what the
search picks when it may choose zb-h1.

For each case (a built-in model, a cluster file, a stage count p and a
micro-batch count m) this plans ``PipeshardParallel(stages=p,
num_micro_batches=m, schedule=S)`` for S in gpipe, 1f1b, zb-h1 and with
``schedule=("gpipe", "1f1b", "zb-h1")`` (searched: the fastest that fits;
``"auto"`` searches GPipe and 1F1B only), and prints the predicted iteration
times and the largest stage memory as a Markdown table.  The figures are
predictions (no GPU is used): ZB-H1 is priced by
:mod:`meshplan.dp_search.zero_bubble` (every stage keeps p micro-batches,
the time walks the schedule's order with each stage's F, B and W cut by
FLOPs).  Planning shares one session, so the layer ILPs are solved once per case.

    python benchmarks/zero_bubble.py [--cases gpt-350m:256:dgx-a100-x1:4:8,...]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import meshplan
from meshplan.api import plan_graph, retracer
from meshplan.dp_search import Session
from meshplan.errors import InfeasiblePlanError
from meshplan.models import build_model
from meshplan.trace import trace
from meshplan.units import human_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
# model:batch:cluster:stages:micro-batches
CASES = "gpt-350m:256:dgx-a100-x1:4:4,gpt-350m:256:dgx-a100-x1:4:8,gpt-350m:256:dgx-a100-x1:2:8"
SCHEDULES = ("gpipe", "1f1b", "zb-h1", ("gpipe", "1f1b", "zb-h1"))


def run_case(spec: str) -> dict:
    name, batch, cluster_name, p, mb = spec.split(":")
    m = build_model(name, {"batch": batch})
    cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / f"{cluster_name}.json")
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name=name)
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, name)
    session = Session.from_env()
    row = {"case": f"{name} batch {batch}, {cluster_name}, p={p}, m={mb}"}
    t0 = time.perf_counter()
    for sched in SCHEDULES:
        try:
            plan = plan_graph(graph, cluster, meshplan.PipeshardParallel(
                stages=int(p), num_micro_batches=int(mb), schedule=sched), retrace=rt,
                session=session)
            text = (f"{plan.predicted.iteration_s * 1e3:.1f} ms, "
                    f"{human_bytes(plan.predicted.peak_memory_bytes)}")
            if not isinstance(sched, str):
                text = f"{plan.schedule} ({text})"
        except InfeasiblePlanError:
            text = "does not fit"
        row[sched if isinstance(sched, str) else "searched"] = text
    row["plan s"] = f"{time.perf_counter() - t0:.0f}"
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES)
    args = ap.parse_args(argv)
    rows = []
    for spec in args.cases.split(","):
        print(f"planning {spec} ...", file=sys.stderr, flush=True)
        rows.append(run_case(spec))
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
